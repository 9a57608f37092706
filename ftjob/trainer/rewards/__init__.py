"""GRPO's rewards: the built-in verifiable ones and a user's functions, scored per completion.

``Rewards(specs, root).score(prompts, completions, records)`` gives an (N, F) float32 tensor, one
column per reward and NaN where a reward gives none, as TRL's GRPOTrainer builds
``rewards_per_func``; the caller sums ``(per_func * weights).nansum(1)``.

Modules: builtins (exact match, numeric answer, regex format, length penalty; no torch),
functions (a user's ``module:function`` in a worker process with a time limit), worker (that
process's side), combiner (:class:`Rewards`), errors (:class:`RewardError`). This package's
``__init__`` imports nothing eagerly: the worker process imports ``builtins`` through it and
must not pay for torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RewardError", "Rewards"]


def __getattr__(name: str) -> Any:
    if name == "Rewards":
        from ftjob.trainer.rewards.combiner import Rewards

        return Rewards
    if name == "RewardError":
        from ftjob.trainer.rewards.errors import RewardError

        return RewardError
    raise AttributeError(name)
