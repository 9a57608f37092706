"""The job's rewards together: one column per reward, the weights, and their metrics.

    rewards = Rewards(spec.training.grpo.rewards, root)    # user functions load here
    per_func = rewards.score(prompts, completions, records, completion_ids=ids)   # (N, F)
    total = (per_func * rewards.weights).nansum(1)         # as TRL's GRPOTrainer sums them
    rewards.metrics(per_func)   # {"rewards/<name>/mean": ..., "rewards/<name>/std": ...}

The built-ins that cannot hang (exact match, numeric, length) run here; regex and user functions
run in worker processes (functions.py), all sent before any is awaited so they overlap.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ftjob.api.rewards import RewardSpec, metric_names, reward_names
from ftjob.trainer.rewards import builtins
from ftjob.trainer.rewards.errors import RewardError
from ftjob.trainer.rewards.functions import Worker, resolve, trl_arguments

REGEX_TARGET = "ftjob.trainer.rewards.builtins:regex_reward"


class _Builtin:
    """A built-in reward computed in this process when collected."""

    def __init__(self, spec: RewardSpec, name: str):
        self.spec, self.name, self.batch = spec, name, None

    def submit(self, batch: dict[str, Any]) -> None:
        self.batch = batch

    def collect(self) -> list[float | None]:
        s, b, self.batch = self.spec, self.batch, None
        if s.type == "length":
            return builtins.length_penalty(_lengths(s, b, self.name), *_limits(s))
        references = builtins.field_values(b["records"], s.field, self.name)
        if s.type == "exactMatch":
            return builtins.exact_match(b["completions"], references)
        return builtins.numeric(b["completions"], references, s.tolerance)

    def close(self) -> None:
        pass


class _Remote:
    """A reward run by a worker process: a user's function, or the regex built-in."""

    def __init__(self, spec: RewardSpec, name: str, root: Path | None):
        self.spec = spec
        if spec.type == "function":
            target, is_file = resolve(spec.function, root)
        else:
            target, is_file = REGEX_TARGET, False
        self.worker = Worker(name, target, is_file, spec.timeout_seconds)

    def submit(self, batch: dict[str, Any]) -> None:
        if self.spec.type == "regex":
            kwargs = {"completions": batch["completions"], "pattern": self.spec.pattern}
        else:
            kwargs = trl_arguments(
                batch["prompts"], batch["completions"], batch["records"], batch["ids"]
            )
        self.worker.submit(kwargs, len(batch["completions"]))

    def collect(self) -> list[float | None]:
        return self.worker.collect()

    def close(self) -> None:
        self.worker.close()


def _lengths(spec: RewardSpec, batch: dict[str, Any], name: str) -> list[int]:
    if spec.unit == "characters":
        return [len(c) for c in batch["completions"]]
    if batch["ids"] is None:
        raise RewardError(
            f"reward {name!r} counts tokens but score() was given no completion_ids",
            fix="pass completion_ids to Rewards.score, or set the reward's unit: characters",
        )
    return [len(ids) for ids in batch["ids"]]


def _limits(spec: RewardSpec) -> tuple[int, int]:
    buffer = spec.buffer_length or max(1, spec.max_length // 4)
    return spec.max_length, buffer


class Rewards:
    """The job's rewards (``training.grpo.rewards``); ``root`` is where relative function
    files are read (None: FTJOB_SOURCE_ROOT, the job file's folder, as for dataset paths).

    Every user function's file is loaded here, in its worker, so that a missing file, a
    syntax error or a missing function fails before the first step. Call :meth:`close` (or
    use it as a context manager) to stop the workers; they also end with this process.
    """

    def __init__(self, specs: list[RewardSpec], root: Path | None = None):
        self.specs = list(specs)
        self.names: list[str] = reward_names(self.specs)
        self.weights = torch.tensor([s.weight for s in self.specs], dtype=torch.float32)
        self._parts: list[_Builtin | _Remote] = []
        try:
            for spec, name in zip(self.specs, self.names, strict=True):
                remote = spec.type in ("function", "regex")
                self._parts.append(_Remote(spec, name, root) if remote else _Builtin(spec, name))
            workers = [p.worker for p in self._parts if isinstance(p, _Remote)]
            for w in workers:
                w.start()  # all launched before any is awaited: their start-ups overlap
            for w in workers:
                w.ready()
        except BaseException:
            self.close()
            raise

    def check(self, record: dict) -> None:
        """Refuse a dataset record that lacks a field a reward reads (exactMatch, numeric):
        call it on the first record when the data is loaded, so that a wrong field fails
        before the first step rather than at it."""
        for part in self._parts:
            if isinstance(part, _Builtin) and part.spec.type in ("exactMatch", "numeric"):
                builtins.field_values([record], part.spec.field, part.name)

    def score(
        self,
        prompts: list,
        completions: list[str],
        records: list[dict],
        completion_ids: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """(N, F) float32: reward f of completion n, NaN where it gave None. ``prompts`` are
        text or chat message lists; ``records`` the completions' dataset records (a prompt's
        record repeated for each of its completions); ``completion_ids`` their token ids
        (needed by a length reward in tokens, and passed to user functions as TRL does)."""
        n = len(completions)
        if not (len(prompts) == n == len(records)) or (
            completion_ids is not None and len(completion_ids) != n
        ):
            raise ValueError(
                f"score() needs one prompt, record (and completion_ids) per completion: got "
                f"{len(prompts)} prompts, {n} completions, {len(records)} records"
            )
        batch = {"prompts": prompts, "completions": completions, "records": records}
        batch["ids"] = completion_ids
        for part in self._parts:
            part.submit(batch)
        columns, first = [], None
        # Every part is collected even after one fails, so no worker keeps a stale answer.
        for part in self._parts:
            try:
                columns.append(part.collect())
            except RewardError as e:
                first = first or e
                columns.append([None] * n)
        if first is not None:
            raise first
        return _tensor(columns, n, self.names)

    def metrics(self, per_func: torch.Tensor) -> dict[str, float]:
        """Each reward's mean and spread (sample std) over ``per_func``'s rows, NaNs left out,
        named as TRL's GRPOTrainer logs them: rewards/<name>/mean, rewards/<name>/std.
        Gather ``per_func`` over the ranks first for the whole step's numbers."""
        out = {}
        for i, name in enumerate(self.names):
            column = per_func[:, i].double()
            kept = column[~torch.isnan(column)]
            mean = kept.mean().item() if kept.numel() else math.nan
            std = kept.std().item() if kept.numel() > 1 else math.nan
            out[f"rewards/{name}/mean"] = mean
            out[f"rewards/{name}/std"] = std
        return out

    def metric_names(self) -> list[str]:
        """The names :meth:`metrics` gives, in order, for declaring them before a step."""
        return metric_names(self.specs)

    def close(self) -> None:
        for part in self._parts:
            part.close()

    def __enter__(self) -> Rewards:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _tensor(columns: list[list[float | None]], n: int, names: list[str]) -> torch.Tensor:
    out = torch.full((n, len(columns)), math.nan, dtype=torch.float32)
    for f, column in enumerate(columns):
        for i, value in enumerate(column):
            if value is not None:
                if math.isinf(value):
                    raise RewardError(
                        f"reward {names[f]!r} gave {value} for completion {i}",
                        fix="return a finite float (or None to give that completion no reward)",
                    )
                out[i, f] = value
    return out
