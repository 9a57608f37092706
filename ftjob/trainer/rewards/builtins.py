"""The built-in rewards: exact match, numeric answer, regex format and length penalty.

Small and dependency-free on purpose: TRL's accuracy_reward needs math_verify (not a
dependency here), and what GSM8K-style data needs is the final answer pulled out of the
completion and compared as text or as a number, as open-r1's and verl's gsm8k scorers do.
No torch: the regex reward runs in a worker process (functions.py), which imports this module.

Each reward takes the completions (text) and what it reads, and returns one float, or None
where the record gives it nothing to compare with (NaN in the tensor, as TRL skips it).
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Any

from ftjob.trainer.rewards.errors import RewardError

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]*)")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
# A number: 1,234.5 or 10 000 (thousands commas or spaces), -3, 0.25, .5, 1e-3, 3/4, 5 1/2 (a
# whole and a fraction). A minus counts as a sign only where it cannot be a hyphen or an
# operator between terms: "x = -4" is -4, "3-4" is 3 and 4; a currency sign may follow it
# ("-$5" is -5).
_CURRENCY = "$€£¥"
_NUMBER = re.compile(
    rf"(?:(?<![\w)\]])-[{_CURRENCY}]?)?(?<![\d.])"
    r"(?:\d+[ \u00a0]+\d+\s*/\s*\d+"  # a whole and a fraction
    r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d{1,3}(?:[ \u00a0\u202f]\d{3})+(?![\d/])(?:\.\d+)?"
    r"|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)"
    r"(?:\s*/\s*\d+(?:\.\d+)?)?"
)
# What exact match drops from the end of an answer: a sentence's closing punctuation.
TRAILING_PUNCTUATION = ".,;:!?"


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces inside it balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]  # cut off mid-answer: what there is


def answer_text(text: str) -> str:
    """The part of a completion that holds its final answer, narrowed step by step: the last
    <answer>...</answer>, then the last \\boxed{...} in that, then what follows the last '####'
    in that (GSM8K's marker, up to the line's end); the whole text where none is found."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        text = tags[-1]
    boxed = _last_boxed(text)
    if boxed is not None:
        text = boxed
    hashes = _HASHES.findall(text)
    if hashes:
        text = hashes[-1]
    return text


def normalise(text: str) -> str:
    """Exact match's normal form: Unicode NFKC, case-folded, whitespace runs as one space, no
    leading or trailing whitespace, no trailing . , ; : ! ?"""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text.rstrip(TRAILING_PUNCTUATION).rstrip()


def _as_number(token: str) -> float | None:
    sign = -1.0 if token.startswith("-") else 1.0
    token = token.lstrip("-" + _CURRENCY).replace(",", "")
    whole = 0.0
    if "/" in token and re.match(r"\d+[ \u00a0]+\d", token):  # 5 1/2
        first, token = token.split(maxsplit=1)
        whole = float(first)
    token = re.sub(r"\s+", "", token)
    if "/" in token:
        top, bottom = token.split("/", 1)
        return sign * (whole + float(top) / float(bottom)) if float(bottom) != 0 else None
    return sign * float(token)


def number(value: Any) -> float | None:
    """The answer of ``value`` as a number: the last number of its answer text
    (:func:`answer_text`), \\frac{a}{b} and a/b as fractions; None when it has none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else None
    text = answer_text(str(value)).replace("\u2212", "-")  # a typeset minus sign
    text = _FRAC.sub(r"\1/\2", text)
    found = _NUMBER.findall(text)
    for token in reversed(found):
        try:
            result = _as_number(token)
        except (ValueError, OverflowError, ZeroDivisionError):
            continue
        if result is not None and math.isfinite(result):
            return result
    return None


def _references(value: Any) -> list[Any]:
    """A record field's reference answers: a list holds several, anything else one."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def field_values(records: list[dict], field: str, reward: str) -> list[Any]:
    """Each record's ``field``; a record without it is a data error, named with its place."""
    out = []
    for i, record in enumerate(records):
        if field not in record:
            keys = ", ".join(sorted(map(str, record))) or "none"
            raise RewardError(
                f"reward {reward!r}: record {i} of the batch has no field {field!r} (its "
                f"fields: {keys})",
                fix=f"set the reward's field to the record field that holds the answer, or add "
                f"{field!r} to every record of the data set",
            )
        out.append(record[field])
    return out


def _texts(value: Any) -> set[str]:
    """A reference's normal forms: its answer text, and a number field (JSON's 72.0 for a
    gold answer of 72) as the numeral a completion writes ("72", "72.0")."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        numeral = float(value)
        return {f"{int(numeral)}", f"{numeral}"} if numeral.is_integer() else {f"{numeral}"}
    return {normalise(answer_text(str(value)))}


def exact_match(completions: list[str], references: list[Any]) -> list[float | None]:
    """1.0 where the completion's answer text (:func:`answer_text`) equals a reference's after
    :func:`normalise` (a number field as its numeral), else 0.0; None where the record has no
    reference."""
    out: list[float | None] = []
    for completion, value in zip(completions, references, strict=True):
        wanted = {text for v in _references(value) for text in _texts(v)}
        if not wanted:
            out.append(None)
            continue
        out.append(1.0 if normalise(answer_text(completion)) in wanted else 0.0)
    return out


def numeric(completions: list[str], references: list[Any], tolerance: float) -> list[float | None]:
    """1.0 where the completion's answer number equals a reference's within ``tolerance`` x
    max(1, |reference|), else 0.0 (also when the completion has no number); None where no
    reference holds a number (TRL's accuracy reward skips an unparseable gold answer too)."""
    out: list[float | None] = []
    for completion, value in zip(completions, references, strict=True):
        wanted = [n for v in _references(value) if (n := number(v)) is not None]
        if not wanted:
            out.append(None)
            continue
        got = number(completion)
        hit = got is not None and any(abs(got - w) <= tolerance * max(1.0, abs(w)) for w in wanted)
        out.append(1.0 if hit else 0.0)
    return out


def regex_reward(completions: list[str], pattern: str, **_: Any) -> list[float]:
    """1.0 where ``pattern`` is found in the completion (re.search, re.DOTALL), else 0.0. Runs
    in a worker process: a pattern that backtracks for ever is stopped at timeoutSeconds."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.search(c) else 0.0 for c in completions]


def length_penalty(lengths: list[int], max_length: int, buffer_length: int) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer_length``, then falling
    linearly to -1 at ``max_length``, and -1 beyond."""
    soft = max_length - buffer_length
    out = []
    for n in lengths:
        if n <= soft:
            out.append(0.0)
        elif n < max_length:
            out.append((soft - n) / buffer_length)
        else:
            out.append(-1.0)
    return out
