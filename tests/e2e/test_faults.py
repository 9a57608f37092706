"""Faults a cluster will produce, on `ftjob run` with 2 real processes: damaged checkpoints, a
full volume, two writers on one job folder, a gang killed after its export.

    python -m pytest tests/e2e/test_faults.py -q

Every rerun is compared with one uninterrupted reference run: same losses, step by step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_trainer_run import RUN_TIMEOUT, job, losses, rank_pid, run, start

STEPS = 20
# Checkpoints at 4, 8, 12 and 16, all kept: room to damage three and resume from the fourth.
SPEC = {"training": {"maxSteps": STEPS}, "checkpoint": {"every": 4, "keep": 4}}


def faults_job(**changes) -> dict:
    doc = job("faults", **SPEC)
    for section, values in changes.items():
        doc["spec"].setdefault(section, {}).update(values)
    return doc


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("faults") / "reference"
    code, out = run(faults_job(), workdir)
    assert code == 0, out
    assert sorted(losses(workdir)) == list(range(1, STEPS + 1))
    return workdir


def rerun_copy(reference: Path, workdir: Path) -> Path:
    """The reference's job folder without its export and its history: a rerun trains again
    from the newest checkpoint it trusts."""
    shutil.copytree(reference, workdir, ignore=shutil.ignore_patterns("owner", "tmp"))
    shutil.rmtree(workdir / "model")
    (workdir / "progress.jsonl").unlink()
    return workdir


def assert_same_losses(workdir: Path, reference: Path, first: int) -> None:
    resumed, expected = losses(workdir), losses(reference)
    assert sorted(resumed) == list(range(first, STEPS + 1))
    assert max(abs(resumed[s] - expected[s]) for s in resumed) == 0.0


def test_damaged_checkpoints_are_moved_aside_and_the_newest_intact_one_resumed(reference, tmp_path):
    workdir = rerun_copy(reference, tmp_path / "damaged")
    ckpts = workdir / "checkpoints"
    # Three ways a checkpoint is damaged after its commit: a shard cut short (a node lost
    # mid-flush), a shard emptied, the metadata gone.
    with open(ckpts / "step-00000016" / "__1_0.distcp", "r+b") as f:
        f.truncate(1000)
    (ckpts / "step-00000012" / "__0_0.distcp").write_bytes(b"")
    (ckpts / "step-00000008" / ".metadata").unlink()

    code, out = run(faults_job(), workdir)
    assert code == 0, out
    for step, problem in [
        (16, "__1_0.distcp has 1000 bytes"),
        (12, "__0_0.distcp has 0 bytes"),
        (8, ".metadata is missing"),
    ]:
        line = next(x for x in out.splitlines() if f"checkpoint {ckpts}/step-{step:08d} is" in x)
        assert f"is damaged ({problem}" in line, line
        assert f"using {ckpts}/step-00000004 instead" in line, line
    assert f"resuming from checkpoint {ckpts}/step-00000004 (step 4)" in out
    # Kept for a post-mortem, out of the way of the next resume; the run's own saves follow.
    aside = sorted(p.name.rsplit("-", 1)[0] for p in (ckpts / "damaged").iterdir())
    assert aside == ["step-00000008", "step-00000012", "step-00000016"]
    assert_same_losses(workdir, reference, first=5)


def test_a_checkpoint_that_does_not_fit_the_job_is_named_not_a_traceback(reference, tmp_path):
    workdir = rerun_copy(reference, tmp_path / "changed")
    # The spec changed under the job folder: full fine-tune checkpoints, a LoRA job now.
    lora = {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}}
    code, out = run(faults_job(method=lora), workdir)
    assert code == 1
    error = next(x for x in out.splitlines() if x.startswith("  error: rank"))
    assert "CheckpointUnreadable" in error
    assert f"checkpoint {workdir / 'checkpoints'}/step-00000016 is intact but cannot" in error
    assert "Traceback" not in out.split("ftjob run: node", 1)[1]


@pytest.fixture
def tmpfs(tmp_path):
    """A 5 MiB volume: the first checkpoint (about 3 MiB) fits, the second does not."""
    mount = tmp_path / "volume" / "checkpoints"
    mount.mkdir(parents=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"a full volume needs `mount -t tmpfs` (root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_volume_is_named_and_the_run_resumes_exactly_with_room_again(reference, tmpfs):
    workdir = tmpfs.parent
    code, out = run(faults_job(), workdir)
    assert code == 1, out
    error = next(x for x in out.splitlines() if x.startswith("  error: rank"))
    assert "DiskFull: checkpoint step-00000008" in error
    assert f"no space left on the volume holding {tmpfs}" in error
    assert "it needs about 2." in error  # the size of the checkpoint before it, in MiB
    assert "Traceback" not in out
    # The temporary folder is gone (it held the room the next attempt needs); step 4 stays,
    # and the failed run gave the job folder up.
    assert sorted(p.name for p in tmpfs.iterdir()) == ["step-00000004"]
    assert not (workdir / "owner").exists()

    subprocess.run(["mount", "-o", "remount,size=64m", str(tmpfs)], check=True)
    code, out = run(faults_job(), workdir)
    assert code == 0, out
    assert f"resuming from checkpoint {tmpfs}/step-00000004 (step 4)" in out
    assert_same_losses(workdir, reference, first=1)


def test_a_second_run_on_the_same_job_folder_refuses_and_the_first_is_intact(reference, tmp_path):
    workdir = tmp_path / "shared"
    first = start(faults_job(), workdir)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (workdir / "owner").exists():
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    owner = json.loads((workdir / "owner").read_text())
    # The first run holds still while the second starts (both would take ~10 s here).
    ranks = [rank_pid(workdir, rank) for rank in (0, 1)]
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        code, out = run(faults_job(), workdir)
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    first_out, _ = first.communicate(timeout=RUN_TIMEOUT)

    assert code == 1, out
    error = next(x for x in out.splitlines() if x.startswith("  error: rank"))
    assert f"JobFolderBusy: job folder {workdir} is in use by run {owner['run']}" in error
    assert f"pid {owner['pid']}" in error and "delete" in error
    assert first.returncode == 0, first_out
    assert_same_losses(workdir, reference, first=1)
    assert not (workdir / "owner").exists()  # released when the first run finished


def test_a_gang_killed_after_its_export_reruns_as_done(reference, tmp_path):
    workdir = tmp_path / "exported"
    shutil.copytree(reference, workdir)
    # Killed between the export's rename and the last progress update.
    snapshot = json.loads((workdir / "progress.json").read_text())
    snapshot.update(phase="exporting", exportPath=None)
    (workdir / "progress.json").write_text(json.dumps(snapshot))

    code, out = run(faults_job(), workdir)
    assert code == 0, out
    assert "already trained" in out
    assert f"the exported model is in {workdir / 'model'}" in out
    final = json.loads((workdir / "progress.json").read_text())
    assert final["phase"] == "succeeded" and final["exportPath"] == str(workdir / "model")
