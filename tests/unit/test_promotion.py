"""output.promoteWhen: parsed, checked against the objective, decided with the numbers (pure);
the CRD's CEL and Python agree (the corpus holds the refusals at the door).

    python -m pytest tests/unit/test_promotion.py -q
"""

from __future__ import annotations

import pytest

from ftjob.api import promotion
from ftjob.api.jobspec import parse_spec
from ftjob.api.schema import SpecError


def spec(objective: str, when: str, **output):
    raw = {
        "model": {"source": "s3://models/llama"},
        "dataset": {"source": "s3://data/pairs.jsonl", "evalFraction": 0.05,
                    **({"format": "preference"} if objective == "dpo" else {})},
        "training": {"maxSteps": 10, "objective": objective},
        "output": {"push": ["s3://exports/x"], "promoteWhen": when, **output},
    }  # fmt: skip
    return parse_spec(raw)


@pytest.mark.parametrize(
    ("when", "final", "held", "words"),
    [
        ("evalLoss < 1.8", {"evalLoss": 1.62}, True, "evalLoss 1.62 < 1.8"),
        ("evalLoss < 1.8", {"evalLoss": 2.01}, False, "evalLoss 2.01 < 1.8 does not hold"),
        ("evalLoss <= 2", {"evalLoss": 2.0}, True, "evalLoss 2 <= 2"),
        (
            "evalRewardAccuracy >= 0.7 and evalLoss < 0.6",
            {"evalRewardAccuracy": 0.75, "evalLoss": 0.65},
            False,
            "evalRewardAccuracy 0.75 >= 0.7; evalLoss 0.65 < 0.6 does not hold",
        ),
        ("evalLoss < 1.8", {}, False, "evalLoss absent < 1.8 does not hold"),
    ],
)
def test_decided_with_the_numbers(when, final, held, words):
    assert promotion.decide(when, final) == (held, words)


def test_each_objective_may_name_only_what_it_evaluates():
    assert spec("sft", "evalLoss < 1.8").output.promote_when == "evalLoss < 1.8"
    assert spec("dpo", "evalRewardAccuracy >= 0.7 and evalLoss < 0.6")
    with pytest.raises(SpecError) as e:
        spec("sft", "evalRewardAccuracy >= 0.7")
    assert "spec.output.promoteWhen" in str(e.value) and "sft: evalLoss" in str(e.value)
    for bad in ("loss < 1.8", "evalLoss ~ 1.8", "evalLoss < 1.8 or evalLoss > 3", "evalLoss <"):
        with pytest.raises(SpecError):
            spec("sft", bad)


def test_a_condition_needs_a_push_and_an_evaluation():
    with pytest.raises(SpecError) as e:
        parse_spec({"model": {"source": "m"}, "dataset": {"source": "d.jsonl"},
                    "training": {"maxSteps": 1},
                    "output": {"promoteWhen": "evalLoss < 1"}})  # fmt: skip
    assert "set output.push and dataset.evalFraction" in str(e.value)
