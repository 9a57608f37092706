"""Faults a cluster will produce, on `ftjob run` with 2 real processes: damaged checkpoints, a
full volume, two writers on one job folder, a gang killed after its export; and a checkpoint
another method wrote, named by the trainer in this process (a gang of one).

    python -m pytest tests/e2e/test_faults.py -q

Every rerun is compared with one uninterrupted reference run: same losses, step by step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import in_process
import pytest
from test_trainer_run import RUN_TIMEOUT, job, losses, rank_pid, run, start

STEPS = 20
# Checkpoints at 4, 8, 12 and 16, all kept: room to damage three and resume from the fourth.
# No restarts in place: a full volume fails each restart alike (test_recovery.py has those).
SPEC = {
    "training": {"maxSteps": STEPS},
    "checkpoint": {"every": 4, "keep": 4},
    "runPolicy": {"inPlaceRestarts": 0},
}


def faults_job(**changes) -> dict:
    doc = job("faults", **SPEC)
    for section, values in changes.items():
        doc["spec"].setdefault(section, {}).update(values)
    return doc


# Session-wide: the slow tier runs last, after this module, and reuses it (tests/deadline.py).
@pytest.fixture(scope="session")
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


def test_a_checkpoint_that_does_not_fit_the_job_is_named_not_a_traceback(
    reference, tmp_path, monkeypatch
):
    """Whether a checkpoint fits is each rank's own load: the trainer runs here as a gang of
    one (tests/in_process.py). Its record names the checkpoint, which is what `ftjob run` and
    the operator show (a named error shown without a traceback: the full volume's test)."""
    old = rerun_copy(reference, tmp_path / "full")
    # A LoRA job told to start from a full fine-tune's checkpoints, by a path relative to the
    # volume (FTJOB_SOURCE_ROOT, as a pod reads it).
    lora = {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}}
    doc = faults_job(method=lora, checkpoint={"resumeFrom": "full"})
    doc["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 0}
    monkeypatch.setenv("FTJOB_SOURCE_ROOT", str(tmp_path))
    monkeypatch.setenv("FTJOB_TERMINATION_LOG", str(tmp_path / "termination-log"))
    failed = in_process.fails(doc, tmp_path / "lora", monkeypatch)
    record = json.loads((tmp_path / "termination-log").read_text())
    assert failed.reason == record["reason"] == "CheckpointUnreadable", record
    said = f"checkpoint {old / 'checkpoints'}/step-00000016 is intact but cannot"
    assert said in str(failed) and said in record["message"], record
    assert "Traceback" not in record["message"]


@pytest.fixture
def tmpfs():
    """mount(path, size): a small tmpfs volume at ``path``, unmounted after the test."""
    mounted = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True)
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)  # fmt: skip
        if made.returncode != 0:
            pytest.skip(f"a full volume needs `mount -t tmpfs` (root): {made.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def grow(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=64m", str(path)], check=True)


def test_a_full_volume_is_named_and_the_run_resumes_exactly_with_room_again(
    reference, tmpfs, tmp_path
):
    # 5 MiB: the first checkpoint (about 2.9 MiB) fits, the second does not.
    volume = tmpfs(tmp_path / "volume" / "checkpoints", "5m")
    workdir = volume.parent
    code, out = run(faults_job(), workdir)
    assert code == 1, out
    error = next(x for x in out.splitlines() if x.startswith("ftjob run: node"))
    assert "DiskFull: checkpoint step-00000008" in error
    assert f"no space left on the volume holding {volume}" in error
    assert "it needs about 2." in error  # the size of the checkpoint before it, in MiB
    assert "Traceback" not in out
    # The temporary folder is gone (it held the room the next attempt needs); step 4 stays,
    # and the failed run gave the job folder up.
    assert sorted(p.name for p in volume.iterdir()) == ["step-00000004"]
    assert not (workdir / "owner").exists()

    grow(volume)
    code, out = run(faults_job(), workdir)
    assert code == 0, out
    assert f"resuming from checkpoint {volume}/step-00000004 (step 4)" in out
    assert_same_losses(workdir, reference, first=1)


@pytest.mark.slow  # tests/deadline.py: a full volume named and rerun is the checkpoint's test
def test_a_full_volume_during_the_export_is_named_and_the_rerun_exports(reference, tmpfs, tmp_path):
    workdir = tmp_path / "exporting"
    export = tmpfs(workdir / "export", "256k")  # the tiny model's export takes about 1 MiB
    doc = faults_job(output={"path": "export/model"})
    code, out = run(doc, workdir)
    assert code == 1, out
    error = next(x for x in out.splitlines() if x.startswith("ftjob run: node"))
    assert f"DiskFull: export: no space left on the volume holding {export}" in error
    assert list(export.iterdir()) == []  # its temporary folder is gone
    assert "step-00000016" in {p.name for p in (workdir / "checkpoints").iterdir()}

    grow(export)
    code, out = run(doc, workdir)
    assert code == 0, out
    assert f"resuming from checkpoint {workdir / 'checkpoints'}/step-00000016" in out
    assert (export / "model" / "model.safetensors").is_file()
    assert_same_losses(workdir, reference, first=1)


def test_a_second_run_on_the_same_job_folder_refuses_and_the_first_is_intact(reference, tmp_path):
    workdir = tmp_path / "shared"
    first = start(faults_job(), workdir)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (workdir / "owner").exists():
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    owner = json.loads((workdir / "owner").read_text())  # `ftjob run` takes it before its nodes
    ranks = [rank_pid(workdir, rank) for rank in (0, 1)]
    while None in ranks or not (workdir / "progress.json").exists():  # rank 0 owns it too
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.05)
        ranks = [rank_pid(workdir, rank) for rank in (0, 1)]
    spec_written = (workdir / "spec.json").read_bytes()
    # The first run holds still while the others start (each would take ~10 s here).
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        # `ftjob run` asks before it writes anything into the folder...
        code, out = run(faults_job(training={"seed": 7}), workdir)
        # ...and the trainer itself refuses, on every rank, whoever launched it (a pod).
        env = {**os.environ, "FTJOB_JOB_DIR": str(workdir), "OMP_NUM_THREADS": "1",
               "FTJOB_PROGRESS_PORT": "0", "TMPDIR": str(tmp_path)}  # fmt: skip
        torchrun = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", "-m", "ftjob.trainer",
             "--spec", str(workdir.parent / "shared.yaml")],
            env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
        )  # fmt: skip
        # Read while the first run is still stopped (it records trainedSteps once exported).
        spec_after_refusals = (workdir / "spec.json").read_bytes()
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    first_out, _ = first.communicate(timeout=RUN_TIMEOUT)

    busy = f"job folder {workdir} is in use by run {owner['run']} (host {owner['host']}, "
    assert code == 1 and f"ftjob run: {busy}" in out, out
    assert f"pid {owner['pid']})" in out and f"delete {workdir / 'owner'}" in out
    assert spec_after_refusals == spec_written  # nothing was written
    assert torchrun.returncode != 0
    # Every rank refuses; the first to do so ends the gang (torchrun stops the others).
    said = [x for x in torchrun.stderr.splitlines() if x.startswith("error: rank ")]
    assert said and all(f"JobFolderBusy: {busy}" in x for x in said), torchrun.stderr
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
