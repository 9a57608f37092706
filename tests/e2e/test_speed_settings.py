"""The speed settings change how a step runs, never what it computes.

    python -m pytest tests/e2e/test_speed_settings.py -q

`ftjob run` with 2 real processes: activation checkpointing of no layer, of every other layer
and of every layer, and each decoder layer compiled (torch.compile with inductor, on CPU),
train to the same losses; the progress document says which setting ran. The compiled run
leaves its compiled graphs in the job folder's compile cache, and the same run resumed for a
step more loads them.
"""

from __future__ import annotations

import json
import re

import hangs
import pytest

from tests.e2e.test_trainer_run import job, losses, run

STEPS = 3

# The slow tier (tests/deadline.py): compile and recomputation on CPU, each setting's run the
# default's again.
pytestmark = pytest.mark.slow

COMPILED = "every-2nd-compiled"


def settings_job(name: str, steps: int = STEPS, **training) -> dict:
    # The compiled run keeps a checkpoint (step 2) for its resumed run; no setting saves more.
    every = 2 if training.get("compile") else 4
    return job(name, training={"maxSteps": steps, **training}, dataset={"evalFraction": None},
               checkpoint={"every": every})  # fmt: skip


def settings_run(tmp_path, name: str, **training) -> tuple[dict, dict]:
    workdir = tmp_path / name
    code, out = run(settings_job(name, **training), workdir)
    assert code == 0, out[-3000:]
    return losses(workdir), json.loads((workdir / "progress.json").read_text())


def compile_notes(workdir) -> list[str]:
    """The trainer's line after each run's first compiled step (rank 0's log)."""
    log = (workdir / "logs" / "node-0.log").read_text()
    return [line for line in log.splitlines() if line.startswith("compiled layers:")]


# The outer hang guard of four runs (each guarded by hangs.RUN): pyproject's 1800 s is below
# four runs' guards, and would end the test before a run's own guard could name the hang.
@pytest.mark.timeout(4 * hangs.RUN)
def test_the_settings_train_alike_and_the_compiled_run_resumes_from_its_compile_cache(tmp_path):
    reference, snap = settings_run(tmp_path, "every-layer", activationCheckpointing="all")
    assert snap["activationCheckpointing"] == 1 and snap["compiled"] is False
    assert sorted(reference) == list(range(1, STEPS + 1))
    cases = {
        "no-layer": ({"activationCheckpointing": "none"}, 0, False),
        COMPILED: ({"activationCheckpointing": "every-2", "compile": True}, 2, True),
    }
    for name, (training, every, compiled) in cases.items():
        curve, snap = settings_run(tmp_path, name, **training)
        assert (snap["activationCheckpointing"], snap["compiled"]) == (every, compiled), name
        for step, loss in reference.items():
            # inductor fuses and reorders fp32 arithmetic: equal to rounding, not bit for bit
            assert curve[step] == pytest.approx(loss, rel=1e-4), (name, step)
    resumes_from_the_compile_cache(tmp_path / COMPILED, cases[COMPILED][0])


def resumes_from_the_compile_cache(workdir, training: dict) -> None:
    """The compiled run saved its graphs in the job folder's compile cache; resumed from its
    checkpoint for a step more, it loads every graph from there and compiles none."""
    # On the job's volume (shared by the gang's nodes, kept across restarts), not in /tmp.
    cache = workdir / "compile-cache"
    assert [p for p in cache.rglob("*") if p.is_file()], f"nothing cached in {cache}"
    (first,) = compile_notes(workdir)
    assert "compiled now and saved there for a restart" in first, first
    assert str(cache) in first

    code, out = run(settings_job(workdir.name, STEPS + 1, **training), workdir)
    assert code == 0, out[-3000:]
    assert "resuming from checkpoint" in (workdir / "logs" / "node-0.log").read_text()
    assert max(losses(workdir)) == STEPS + 1
    second = compile_notes(workdir)[-1]
    hits, graphs = re.search(r"(\d+) of (\d+) graphs from the compile cache", second).groups()
    assert int(graphs) > 0 and hits == graphs, second
    assert "compiled now" not in second
