"""PLACEHOLDER (grpo-core): the rewards engineer's ftjob/trainer/rewards/ replaces this file at
merge. The interface GRPO calls, with only exactMatch and function rewards, enough for the
objective's tests and the tiny example."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from ftjob.api.contract import BAD_SPEC, TrainerError
from ftjob.api.rewards import RewardSpec


class RewardError(TrainerError):
    """A reward cannot be computed; the message names the file, the line and the fix."""

    reason = BAD_SPEC


class Rewards:
    """The job's rewards: ``score`` gives each completion's reward per function, (N, F)."""

    def __init__(self, specs: list[RewardSpec], root: Path):
        self.specs, self.root = list(specs), Path(root)
        self.names = [s.name or s.type for s in self.specs]
        self.weights = torch.tensor([s.weight for s in self.specs], dtype=torch.float32)
        self._calls = [self._load(s) for s in self.specs]

    def _load(self, s: RewardSpec):
        if s.type == "exactMatch":
            field = s.field or "answer"
            return lambda prompts, completions, records: [
                float(c.strip() == str(r.get(field, "")).strip())
                for c, r in zip(completions, records, strict=True)
            ]
        if s.type == "function":
            path, _, name = s.function.rpartition(":")
            file = Path(path) if Path(path).is_absolute() else self.root / path
            spec = importlib.util.spec_from_file_location(file.stem, file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return getattr(module, name)
        raise RewardError(f"placeholder rewards: type {s.type} is not here")

    def score(self, prompts: list, completions: list[str], records: list[dict]) -> torch.Tensor:
        out = torch.full((len(completions), len(self._calls)), math.nan)
        for j, call in enumerate(self._calls):
            values = call(prompts=prompts, completions=completions, records=records)
            out[:, j] = torch.tensor([math.nan if v is None else float(v) for v in values])
        return out
