"""The speed settings change how a step runs, never what it computes.

    python -m pytest tests/e2e/test_speed_settings.py -q

`ftjob run` with 2 real processes: activation checkpointing of no layer, of every other layer
and of every layer, and each decoder layer compiled (torch.compile with inductor, on CPU),
train to the same losses; the progress document says which setting ran.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_trainer_run import job, losses, run

STEPS = 3


def settings_run(tmp_path, name: str, **training) -> tuple[dict, dict]:
    doc = job(name, training={"maxSteps": STEPS, **training}, dataset={"evalFraction": None})
    workdir = tmp_path / name
    code, out = run(doc, workdir)
    assert code == 0, out[-3000:]
    return losses(workdir), json.loads((workdir / "progress.json").read_text())


def test_checkpointing_and_compile_settings_train_to_the_same_losses(tmp_path):
    reference, snap = settings_run(tmp_path, "every-layer", activationCheckpointing="all")
    assert snap["activationCheckpointing"] == 1 and snap["compiled"] is False
    assert sorted(reference) == list(range(1, STEPS + 1))
    cases = {
        "no-layer": ({"activationCheckpointing": "none"}, 0, False),
        "every-2nd-compiled": ({"activationCheckpointing": "every-2", "compile": True}, 2, True),
    }
    for name, (training, every, compiled) in cases.items():
        curve, snap = settings_run(tmp_path, name, **training)
        assert (snap["activationCheckpointing"], snap["compiled"]) == (every, compiled), name
        for step, loss in reference.items():
            # inductor fuses and reorders fp32 arithmetic: equal to rounding, not bit for bit
            assert curve[step] == pytest.approx(loss, rel=1e-4), (name, step)
