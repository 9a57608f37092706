"""Suite: time to the first step of the tiny job, ftjob (`ftjob run`, 2 processes) against TRL
SFTTrainer under torchrun (2 processes) on the same model and data.

Both are timed from the launch of their command to the end of their first optimizer step, on
the wall clock: ftjob's progress keeps when its first step ended (``startup.endedAt``), TRL's
worker prints it (``firstStepAt``). Everything a user waits through counts: the launcher, the
interpreters, imports, rendezvous, the data, the model, the first step. ftjob's own phases
(``startup.phases``) say where its share went.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench import common
from bench.report import row

STEPS = 2  # the first step, and one more so that neither side stops inside its first


def _ftjob(model: Path, work: Path, i: int) -> tuple[float, dict]:
    doc = common.job(f"startup-tiny-{i}", model, steps=STEPS)
    launched = time.time()
    run = common.ftjob_run(doc, work)
    startup = run.progress["startup"]
    return startup["endedAt"] - launched, startup["phases"]


def _trl(model: Path, work: Path) -> float:
    args = ["--model", str(model), "--data", str(common.CHAT_DATA), "--steps", str(STEPS)]
    launched = time.time()
    _, out = common.torchrun("bench.trl_worker", args, 2, work)
    return common.last_json(out, "TRL")["firstStepAt"] - launched


def run(work: Path, quick: bool) -> dict:
    """ftjob and TRL alternately, best of each (others' work only ever slows a start)."""
    model = common.model_dir("tiny", work)
    ours, theirs = [], []
    for i in range(1 if quick else 3):
        ours.append(_ftjob(model, work, i))
        theirs.append(_trl(model, work))
    mine, phases = min(ours, key=lambda x: x[0])
    best = min(theirs)
    ratio = mine / best
    rows = [
        row(
            f"seconds from launch to the end of the first step, tiny, 2 procs, best of "
            f"{len(ours)} (ratio: ftjob / TRL, lower is faster)",
            mine,
            best,
            "TRL SFTTrainer (torchrun)",
            ratio,
            "<= 0.5x",
            ratio <= 0.5,
        )
    ]
    return {"ftjob": [x[0] for x in ours], "phases": phases, "baseline": theirs, "rows": rows}
