"""GRPO's rewards as a job declares them: built-in verifiable rewards and a user's function.

A list of :class:`RewardSpec` sits under ``training.grpo.rewards``; the trainer scores each
completion with every reward (ftjob/trainer/rewards/) and combines them by ``weight``, as
TRL's GRPOTrainer does with its ``reward_funcs`` and ``reward_weights``. This module is pure
(no torch): the API layer, ``ftjob validate`` and the metric declarations read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from ftjob.api.schema import Rule, api_field

TYPES = ("exactMatch", "numeric", "regex", "length", "function")  # spec.rewards[].type
DEFAULT_FIELD = "answer"
# A reward's name is a metric's middle (rewards/<name>/mean), so it stays a plain word.
NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]*$"
NAME_HINT = "be a name of letters, digits, '_' and '-', starting with a letter or '_'"
# path/to/file.py:function (beside the job file, or on the volume) or package.module:function.
FUNCTION_PATTERN = r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$"
FUNCTION_HINT = (
    "be path/to/file.py:function_name (a file on the job's volume or a mounted ConfigMap) or "
    "package.module:function_name"
)
MAX_REWARDS = 16


def _compiles(pattern: str | None) -> bool:
    if pattern is None:
        return True
    try:
        re.compile(pattern)
    except (re.error, TypeError, OverflowError, RecursionError):
        return False
    return True


@dataclass(kw_only=True)
class RewardSpec:
    """A reward: one number per completion, built in or a user's function."""

    name: str | None = api_field(
        "name of the reward in metrics (rewards/<name>/mean) and logs; unique among the "
        "rewards. Unset: the type (exactMatch, numeric, regex, length; with _<field> when "
        "field is not answer) or the function's name, with _2, _3 ... when taken.",
        None,
        pattern=NAME_PATTERN,
        pattern_hint=NAME_HINT,
        max_length=63,
    )
    type: Literal[TYPES] = api_field(  # type: ignore[valid-type]
        "type: exactMatch (1 if the completion's answer equals the record's field after "
        "normalising both, else 0), numeric (1 if the completion's answer number equals the "
        "field's within tolerance, else 0), regex (1 if pattern matches the completion, else "
        "0), length (0 up to maxLength - bufferLength, falling linearly to -1 at maxLength "
        "and beyond), function (a user's Python function)."
    )
    field: str = api_field(
        "field of the dataset record holding the reference answer (exactMatch and numeric). "
        "A list of answers matches if any one does. The completion's answer is the text of "
        "its last <answer>...</answer>, else its last \\boxed{...}, else what follows its "
        "last '####', else the whole completion (numeric: the last number in it); the "
        "field is read the same way, so GSM8K's '... #### 72' works as it is.",
        DEFAULT_FIELD,
        min_length=1,
        max_length=128,
    )
    pattern: str | None = api_field(
        "pattern (type regex): a Python regular expression searched for in the completion "
        "(re.search with re.DOTALL: '.' spans lines, ^ and $ anchor the whole completion "
        "unless (?m) is given). Reward 1.0 on a match, else 0.0.",
        None,
        min_length=1,
        max_length=1024,
        example="^<think>.*</think>\\s*<answer>.*</answer>$",
    )
    function: str | None = api_field(
        "function (type function): path/to/file.py:function_name, a file read beside the "
        "job file (ftjob run) or on the job's volume or a mounted ConfigMap (an absolute "
        "path), or package.module:function_name from the trainer image. Called as TRL calls "
        "its reward functions: fn(prompts=..., completions=..., completion_ids=..., "
        "records=..., **record_fields), each a list with one entry per completion; returns "
        "one float (or None: no reward for that completion) per completion.",
        None,
        pattern=FUNCTION_PATTERN,
        pattern_hint=FUNCTION_HINT,
        max_length=512,
        example="rewards/math.py:score",
    )
    timeout_seconds: int = api_field(
        "timeoutSeconds: the longest one call of the reward may take (function and regex, "
        "which run in a separate process); past it the process is killed and the step "
        "fails naming the reward.",
        30,
        minimum=1,
        maximum=3600,
    )
    weight: float = api_field(
        "weight of the reward in the sum that the advantages are computed from (0: logged only).",
        1.0,
        minimum=-1000,
        maximum=1000,
    )
    tolerance: float = api_field(
        "tolerance of numeric: the answers match when they differ by at most tolerance x "
        "max(1, |reference|).",
        1e-6,
        minimum=0,
        maximum=1,
    )
    max_length: int | None = api_field(
        "maxLength (type length, required): completions this long or longer get -1.",
        None,
        minimum=1,
        maximum=1_000_000,
    )
    buffer_length: int | None = api_field(
        "bufferLength (type length): the penalty falls linearly from 0 to -1 over the last "
        "bufferLength units before maxLength (DAPO's soft overlong punishment). Unset: a "
        "quarter of maxLength.",
        None,
        minimum=1,
        maximum=1_000_000,
    )
    unit: Literal["tokens", "characters"] = api_field(
        "unit of maxLength and bufferLength (type length): tokens of the completion, or its "
        "characters.",
        "tokens",
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.type != 'regex' || has(self.pattern)",
            "type regex needs pattern, the regular expression a completion must match (e.g. "
            "'<answer>.*</answer>'); add it",
            ".pattern",
        ),
        Rule(
            "!has(self.pattern) || self.type == 'regex'",
            "pattern is for type regex; remove it, or set type: regex",
            ".pattern",
        ),
        # CEL cannot tell a valid Python regular expression (its own are RE2's, which refuse
        # some Python accepts), so the API server lets every pattern in and ftjob validate,
        # the operator and the trainer refuse one that Python's re cannot compile.
        Rule(
            "true",
            "pattern is not a valid Python regular expression; check it with python -c "
            "\"import re; re.compile(r'...')\", which names the position of the mistake",
            ".pattern",
            beyond_cel=lambda r: _compiles(r.pattern),
        ),
        Rule(
            "self.type != 'function' || has(self.function)",
            "type function needs function: path/to/file.py:function_name or "
            "package.module:function_name; add it",
            ".function",
        ),
        Rule(
            "!has(self.function) || self.type == 'function'",
            "function is for type function; remove it, or set type: function",
            ".function",
        ),
        Rule(
            "self.type != 'length' || has(self.maxLength)",
            "type length needs maxLength, the length (in unit, tokens by default) that gets "
            "the full penalty; add it",
            ".maxLength",
        ),
        Rule(
            "!has(self.maxLength) || self.type == 'length'",
            "maxLength is for type length; remove it, or set type: length",
            ".maxLength",
        ),
        Rule(
            "!has(self.bufferLength) || self.type == 'length'",
            "bufferLength is for type length; remove it, or set type: length",
            ".bufferLength",
        ),
        Rule(
            "!has(self.bufferLength) || !has(self.maxLength) || "
            "self.bufferLength <= self.maxLength",
            "bufferLength may not exceed maxLength (the penalty starts at maxLength - "
            "bufferLength); lower it",
            ".bufferLength",
        ),
    )


def _derived(spec: RewardSpec) -> str:
    """A reward's name when the job gives none."""
    if spec.type == "function" and spec.function:
        return spec.function.rsplit(":", 1)[1]
    if spec.type in ("exactMatch", "numeric") and spec.field != DEFAULT_FIELD:
        return f"{spec.type}_{re.sub(r'[^A-Za-z0-9_]', '_', spec.field)}"
    return spec.type


def reward_names(specs: list[RewardSpec]) -> list[str]:
    """Each reward's name, in order: its own, else derived from its type, field or function
    (:attr:`RewardSpec.name`), with _2, _3 ... where a name is taken."""
    taken = {s.name for s in specs if s.name}
    out = []
    for spec in specs:
        if spec.name:
            out.append(spec.name)
            continue
        base = name = _derived(spec)
        n = 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        out.append(name)
    return out


def metric_names(specs: list[RewardSpec]) -> list[str]:
    """The trackers' names of each reward's mean and spread over a step's completions, as
    TRL's GRPOTrainer logs them."""
    return [f"rewards/{n}/{what}" for n in reward_names(specs) for what in ("mean", "std")]


# For the object holding ``rewards: list[RewardSpec]`` (training.grpo): put it in that
# class's __rules__. Only names the job gives can clash; derived ones step aside.
UNIQUE_NAMES = Rule(
    "self.rewards.all(r, !has(r.name) || "
    "self.rewards.filter(s, has(s.name) && s.name == r.name).size() == 1)",
    "every reward's name must be unique among rewards (it names the reward's metrics); rename one",
    ".rewards",
)
