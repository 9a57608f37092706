"""A user's reward function, run in a worker process that a time limit can stop.

The function is called as TRL's GRPOTrainer calls its reward functions, so a TRL reward
function works unchanged::

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], records=[{...}, ...],
       answer=[...], ...)

every argument a list with one entry per completion: the prompts (text, or chat message lists),
the completions (text; for chat prompts a list of one assistant message,
``[{"role": "assistant", "content": text}]``, as TRL passes them), their token ids where the
trainer gives them, the dataset records whole (ftjob's addition; TRL functions take **kwargs
and ignore it), and each field of the records as a column, as TRL passes dataset columns
(TRL's ``trainer_state``, ``log_extra`` and ``log_metric`` are not passed: TRL's own functions
default them). It returns one float, or None (no reward for that completion), per completion.

Each function gets its own worker process (worker.py), started when :class:`Rewards` is built
and kept: a missing file, a syntax error or a missing function is found before the first step,
and a call costs a round trip. A call that outlives ``timeoutSeconds`` kills the worker (a
thread could not be stopped); the next call starts a fresh one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ftjob.job import inputs
from ftjob.trainer.rewards.errors import RewardError

# Starting an interpreter and importing the function's module: not the call's limit, which
# would refuse a module with heavy imports under a short timeoutSeconds.
LOAD_SECONDS = 120
# The arguments' own names (and TRL's prompt and completion columns): a record field of the same
# name is not passed as a column (records[i] still holds it).
RESERVED = ("prompts", "completions", "completion_ids", "records", "prompt", "completion")


def resolve(function: str, root: Path | None) -> tuple[str, bool]:
    """``path/file.py:fn`` or ``package.module:fn`` -> the target the worker loads and whether
    it is a file; a file that is not there is refused here. A relative path is read beside
    ``root`` (None: FTJOB_SOURCE_ROOT, the job file's folder, as for dataset paths)."""
    where, name = function.rsplit(":", 1)
    if not (where.endswith(".py") or "/" in where):
        return function, False
    path = Path(inputs.resolve(where, root))  # as the trainer reads dataset.source
    if not path.is_file():
        raise RewardError(
            f"reward function {function}: no such file (looked at {path})",
            where=where,
            fix="put the file on the job's volume or in a ConfigMap mounted into the pods (a "
            "relative path is read beside the job file), or correct training.grpo.rewards[]."
            "function",
        )
    return f"{path}:{name}", True


def trl_arguments(
    prompts: list, completions: list[str], records: list[dict], completion_ids: list | None
) -> dict[str, Any]:
    """The keyword arguments of a TRL-style reward function for one batch."""
    chat = bool(prompts) and isinstance(prompts[0], list)
    shown = [[{"role": "assistant", "content": c}] for c in completions] if chat else completions
    kwargs: dict[str, Any] = {"prompts": list(prompts), "completions": list(shown)}
    kwargs["records"] = list(records)
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
    fields = dict.fromkeys(k for r in records for k in r if k not in RESERVED)
    kwargs |= {k: [r.get(k) for r in records] for k in fields}
    return kwargs


class Worker:
    """One function in its own process: :meth:`start`, then :meth:`submit` and :meth:`collect`
    per call (submit every worker's call first, and they run side by side)."""

    def __init__(self, name: str, target: str, is_file: bool, timeout: float):
        self.name, self.target, self.is_file, self.timeout = name, target, is_file, timeout
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.file: str | None = None
        self.deadline: float | None = None
        self.expected = 0

    def start(self) -> None:
        """Launch the process and send it the target (:meth:`ready` waits for its answer)."""
        mine, theirs = socket.socketpair()
        command = [sys.executable, "-m", "ftjob.trainer.rewards.worker"]
        self.proc = subprocess.Popen(
            [*command, str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(mine.detach())
        self.conn.send((self.target, self.is_file))

    def ready(self) -> None:
        kind, payload = self._answer(LOAD_SECONDS, "to load")
        if kind == "error":
            self.close()
            raise _load_error(self.name, self.target, payload)
        self.file = payload

    def submit(self, kwargs: dict[str, Any], expected: int) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            self.close()  # it ended while idle (the kernel's OOM killer, say): a fresh one
        if self.proc is None:
            self.start()
            self.ready()
        self.expected = expected
        self.deadline = time.monotonic() + self.timeout
        try:
            self.conn.send(kwargs)
        except OSError:  # it ended since the check above: collect() reports how
            self.deadline = time.monotonic()

    def collect(self) -> list[float | None]:
        kind, payload = self._answer(self.deadline - time.monotonic(), "to return")
        if kind == "error":
            raise _call_error(self.name, self.target, payload)
        if kind == "bad":
            raise _shape_error(self.name, self.target, f"{payload}", self.expected)
        if len(payload) != self.expected:
            what = f"returned {len(payload)} values"
            raise _shape_error(self.name, self.target, what, self.expected)
        return payload

    def _answer(self, seconds: float, doing: str) -> tuple[str, Any]:
        """The worker's next message; killed past ``seconds``, or dead, a RewardError."""
        if not self.conn.poll(max(seconds, 0)):
            self.close()
            limit = LOAD_SECONDS if doing == "to load" else self.timeout
            raise RewardError(
                f"reward {self.name!r} ({self.target}) took longer than {limit:g} s {doing}; "
                "its process was stopped",
                where=_short(self.target),
                fix="make the function faster (or return None for completions it cannot "
                "judge in time), or raise the reward's timeoutSeconds",
            )
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.wait() if self.proc else None
            self.close()
            raise RewardError(
                f"reward {self.name!r} ({self.target}): its process ended (exit code {code}) "
                f"while {doing.removeprefix('to ')}ing",
                where=_short(self.target),
                fix="the function (or a library it calls) exited or crashed the interpreter; "
                "run it by hand on a few completions, and keep it from calling exit()",
            ) from None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            self.proc.kill()  # a no-op for a worker that has ended
            self.proc.wait()
            self.proc = None


def _short(target: str) -> str:
    return target.rsplit(":", 1)[0]


def _at(payload: dict) -> str:
    where = f"{payload.get('file')}:{payload.get('line')}" if payload.get("file") else "?"
    function = f" in {payload['function']}" if payload.get("function") else ""
    code = f": {payload['code'].strip()}" if payload.get("code") else ""
    return f"{where}{function}{code}"


def _load_error(name: str, target: str, payload: dict) -> RewardError:
    kind, message = payload["type"], payload["message"]
    if kind == "LookupError":
        fix = "name a function the module defines (path/to/file.py:function_name)"
    elif kind == "SyntaxError":
        fix = "correct the syntax error at that line of the file"
    elif kind in ("ModuleNotFoundError", "ImportError"):
        fix = (
            "install the missing module in the trainer image, or put a file on the volume "
            "and name it path/to/file.py:function_name"
        )
    else:
        fix = "the module raised while it was imported; run it by hand to see why"
    return RewardError(
        f"reward {name!r}: cannot load {target}: {kind}: {message} (at {_at(payload)})",
        where=_where(payload) or _short(target),
        fix=fix,
    )


def _call_error(name: str, target: str, payload: dict) -> RewardError:
    if payload.get("entered", True):
        return RewardError(
            f"reward {name!r} raised {payload['type']}: {payload['message']} (at {_at(payload)})",
            where=_where(payload),
            fix="correct the function at that line (its full traceback is in the trainer's "
            "log); return None for a completion it cannot judge rather than raising",
        )
    return RewardError(
        f"reward {name!r} ({target}) could not be called: {payload['type']}: {payload['message']}",
        where=_short(target),
        fix="end the function's parameters with **kwargs: it is called, as TRL calls reward "
        "functions, with prompts, completions, completion_ids and every field of the records",
    )


def _shape_error(name: str, target: str, what: str, expected: int) -> RewardError:
    return RewardError(
        f"reward {name!r} ({target}) {what}; it must return a list of {expected} floats (or "
        "None), one per completion",
        where=_short(target),
        fix="return one float per completion, in the order of completions, e.g. "
        "[score(c) for c in completions]",
    )


def _where(payload: dict) -> str | None:
    return f"{payload['file']}:{payload['line']}" if payload.get("file") else None
