"""PLACEHOLDER (grpo-core): the rewards engineer's ftjob/api/rewards.py replaces this file at
merge. Only the interface the GRPO objective imports is here: :class:`RewardSpec`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ftjob.api.schema import api_field


@dataclass(kw_only=True)
class RewardSpec:
    """A reward of GRPO's completions (training.grpo.rewards)."""

    name: str | None = api_field(
        "name of the reward in metrics (default: its type).", None, min_length=1, max_length=64
    )
    type: Literal["exactMatch", "numeric", "regex", "length", "function"] = api_field(
        "type of the reward."
    )
    field: str | None = api_field(
        "field of the record that holds the answer.", None, min_length=1, max_length=64
    )
    pattern: str | None = api_field("pattern (regex).", None, min_length=1, max_length=1024)
    function: str | None = api_field(
        "function: path.py:func (a user's reward).", None, min_length=1, max_length=512
    )
    timeout_seconds: float = api_field(
        "timeoutSeconds of one call of a function reward.",
        60.0,
        minimum=0,
        exclusive_minimum=True,
    )
    weight: float = api_field("weight of the reward in the sum.", 1.0)
