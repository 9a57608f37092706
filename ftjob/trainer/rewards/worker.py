"""The process a reward function runs in: ``python -m ftjob.trainer.rewards.worker FD PID``.

functions.py starts one per function and keeps it for the whole run, so a call costs a
round trip, not an interpreter. It loads the function once (a file by path, or a module by
name), then answers calls until its parent closes the socket. A plain interpreter rather
than multiprocessing's spawn: spawn would import the trainer's __main__ (and torch) again
in every worker; fork would copy a process holding CUDA and NCCL threads.

Messages over the socket (FD, a multiprocessing Connection): the parent sends the target,
then keyword arguments per call; the worker answers ("ok", [float | None, ...]),
("bad", what was wrong with the return value) or ("error", where and what it raised).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import numbers
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """A worker outlives nothing: SIGKILL it when the trainer goes (Linux), and leave SIGINT
    and SIGTERM to the trainer, which stops at a step boundary and needs its rewards there."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # Not Linux: the closed socket still ends an idle worker; only a hung one outlives.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(0)  # the parent went before the death signal was set


def load(target: str, is_file: bool) -> tuple[Any, str | None]:
    """The function ``target`` names (file.py:fn or module:fn) and the file it lives in."""
    where, name = target.rsplit(":", 1)
    if is_file:
        path = Path(where)
        # Appended, not prepended: a user's math.py must not hide the standard library's math.
        sys.path.append(str(path.parent))
        spec = importlib.util.spec_from_file_location(f"_ftjob_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # so that pickle and dataclasses find it
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    file = getattr(module, "__file__", None)
    if not hasattr(module, name):
        raise LookupError(f"{where} has no attribute {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise LookupError(f"{where}:{name} is a {type(fn).__name__}, not a function")
    return fn, file


def describe(e: BaseException, file: str | None) -> dict[str, Any]:
    """Where ``e`` came from: the innermost frame in the user's file (else the innermost one
    outside this module), with its code line and the whole traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:
        found = {"file": e.filename, "line": e.lineno, "function": None, "code": e.text}
    else:
        here = str(Path(__file__).resolve())
        mine = [f for f in frames if file and _same(f.filename, file)]
        other = [f for f in frames if not _same(f.filename, here)]
        frame = (mine or other or frames or [None])[-1]
        found = {"file": None, "line": None, "function": None, "code": None}
        if frame is not None:
            found = {"file": frame.filename, "line": frame.lineno, "function": frame.name}
            found["code"] = frame.line
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    found |= {"type": type(e).__name__, "message": str(e), "traceback": text}
    # entered: False for a traceback of serve's frame alone, where the call itself failed
    # (the function's signature) before any line of the function ran.
    return found | {"entered": len(frames) > 1}


def _same(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def values(out: Any) -> tuple[str, Any]:
    """A function's return value as ("ok", floats and Nones) or ("bad", what it is)."""
    if hasattr(out, "tolist"):  # a numpy array or a torch tensor
        out = out.tolist()
    if not isinstance(out, list | tuple):
        return "bad", f"returned {type(out).__name__}, not a list"
    result = []
    for i, v in enumerate(out):
        if v is None:
            result.append(None)
        elif isinstance(v, numbers.Real):
            result.append(float(v))
        else:
            return "bad", f"returned a list whose item {i} is {type(v).__name__} ({v!r:.60})"
    return "ok", result


def serve(conn: Connection) -> None:
    target, is_file = conn.recv()
    file = None
    try:
        fn, file = load(target, is_file)
    except BaseException as e:  # noqa: BLE001 - any failure to load is the user's to see
        conn.send(("error", describe(e, file or (target.rsplit(":", 1)[0] if is_file else None))))
        return
    conn.send(("ready", file))
    while True:
        try:
            kwargs = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is done with us
        try:
            conn.send(values(fn(**kwargs)))
        except BaseException as e:  # noqa: BLE001 - whatever the function raised goes back
            traceback.print_exception(e)  # to the trainer's log, which the error points at
            conn.send(("error", describe(e, file)))


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[2]))
    serve(Connection(int(sys.argv[1])))
