"""The trainer in this test's own process, as a gang of one.

``python -m ftjob.trainer`` without torchrun is a world of one over gloo: this runs the same
``train.run`` in pytest's process, so a test can watch the real loop from inside (patch a
function, count what a step does, look at the model it trains). A process group is made
and destroyed by the run itself.

What a method restores from a checkpoint is one rank's state: :func:`resumed_in_process`
trains a job here, then again from a copy of its folder stopped at a checkpoint, for a test
to compare the two runs' losses (a killed gang's exact resume is tests/e2e/test_recovery's).
"""

from __future__ import annotations

import contextlib
import copy
import io
import shutil
from pathlib import Path

import pytest
import yaml

from ftjob.api.jobspec import parse_resource

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def train(doc: dict, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Train the FineTuneJob ``doc`` with ``folder`` as its job folder; the export's path."""
    from ftjob.trainer import train as trainer

    monkeypatch.setenv("FTJOB_JOB_DIR", str(folder))
    monkeypatch.setenv("FTJOB_PROGRESS_PORT", "0")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    name, spec = parse_resource(doc)
    try:
        return trainer.run(spec, name)
    finally:
        # A failed run leaves its process group to the process's exit, which here is
        # pytest's: destroyed here, so that the next run in this process can make its own.
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def fails(doc: dict, folder: Path, monkeypatch: pytest.MonkeyPatch):
    """Train ``doc`` as :func:`train` does; the TrainerError it must fail with."""
    from ftjob.api import contract

    with pytest.raises(contract.TrainerError) as failed:
        train(doc, folder, monkeypatch)
    return failed.value


def one_rank(doc: dict, every: int) -> dict:
    """``doc`` for a gang of one saving every ``every`` steps, keeping them all, read as
    `ftjob run` reads a job file (``5e-3`` a number)."""
    from ftjob.api import manifest

    doc = copy.deepcopy(doc)
    doc["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 0}
    steps = doc["spec"]["training"]["maxSteps"]
    doc["spec"]["checkpoint"].update(every=every, keep=steps // every)
    return manifest.loads(yaml.safe_dump(doc))[0]


def train_here(doc: dict, folder: Path, sources: Path = EXAMPLES) -> str:
    """Train ``doc`` in this process with ``folder`` as its job folder and relative sources
    under ``sources`` (the job file's folder): what it printed."""
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("FTJOB_SOURCE_ROOT", str(sources))
        train(doc, folder, patch)
    return printed.getvalue()


def stopped_after(folder: Path, copy_to: Path, step: int) -> None:
    """A copy of a finished job folder as a run stopped after ``step`` leaves it: that step's
    checkpoint and the earlier ones, the prepared data; no later checkpoint, log or export."""
    shutil.copytree(folder, copy_to, symlinks=True)
    for saved in (copy_to / "checkpoints").iterdir():
        if int(saved.name.removeprefix("step-")) > step:
            shutil.rmtree(saved)
    shutil.rmtree(copy_to / "model")
    for name in ("progress.json", "progress.jsonl", "completions.jsonl"):
        (copy_to / name).unlink(missing_ok=True)


def resumed_in_process(
    doc: dict, root: Path, at: int, sources: Path = EXAMPLES
) -> tuple[Path, Path, str]:
    """``doc`` trained in this process as a gang of one in ``root/uninterrupted``, saving
    every ``at`` steps, then run again to the end from a copy stopped after step ``at``: (the
    uninterrupted folder, the resumed one, what the rerun printed). What a method restores
    from a checkpoint is one rank's state; a killed gang's exact resume is
    test_trainer_run.py's and test_recovery.py's."""
    doc = one_rank(doc, at)
    first, again = root / "uninterrupted", root / "resumed"
    train_here(doc, first, sources)
    stopped_after(first, again, at)
    return first, again, train_here(doc, again, sources)
