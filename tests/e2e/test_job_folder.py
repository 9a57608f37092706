"""The job folder is one run's: downloads cached in it, a changed spec refused, restarts cheap.

    python -m pytest tests/e2e/test_job_folder.py -q

One short job whose model comes from hf:// (a local Hub mirror, tests/e2e/hubmirror.py) is
killed after its first checkpoint and run again, then run with a changed learning rate
(refused), with more steps (trains on, saying it will replace the export), run again as a
pod's trainer would (already trained, progress kept), and with --restart (starts over).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from hubmirror import HubMirror
from test_trainer_run import EXAMPLES, RUN_TIMEOUT, final, history, job, losses

REPO = "ftjob-test/tiny"


def doc(**training) -> dict:
    out = job("hub", training={"maxSteps": 12, **training}, checkpoint={"every": 4, "keep": 3})
    out["spec"]["model"]["source"] = f"hf://{REPO}"
    return out


def ftjob_run(d: dict, workdir: Path, mirror: HubMirror, *flags: str) -> subprocess.Popen:
    job_file = workdir.parent / f"{workdir.name}.yaml"
    job_file.write_text(yaml.safe_dump(d, sort_keys=False))
    cmd = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(workdir), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}
    env |= {"HF_ENDPOINT": mirror.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HOME", None)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    return proc.returncode, out


@pytest.fixture(scope="module")
def mirror():
    hub = HubMirror({REPO: EXAMPLES / "tiny-model"})
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def killed_and_rerun(tmp_path_factory, mirror):
    """Killed (the whole gang, SIGKILL) after its first checkpoint, then run again."""
    workdir = tmp_path_factory.mktemp("jobs") / "hub"
    proc = ftjob_run(doc(), workdir, mirror)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not list((workdir / "checkpoints").glob("step-*/COMMITTED")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    # The whole gang at once, as a lost node takes it: ftjob run and every node's processes
    # (each node runs in its own session, so the parent's process group is not enough).
    gang = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in gang:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    first = dict(mirror.requests)
    code, out = finish(ftjob_run(doc(), workdir, mirror))
    assert code == 0, out
    return workdir, first, dict(mirror.requests), out


def test_the_model_is_downloaded_once_into_the_job_folder(killed_and_rerun, mirror):
    workdir, first, after, out = killed_and_rerun
    assert first["GET file model.safetensors"] == 1
    # The restarted gang read the snapshot from the folder: not one more request to the Hub.
    assert after == first, (first, after)
    assert "resuming from checkpoint" in out
    cached = json.loads((workdir / "sources.json").read_text())
    assert Path(cached[f"hf://{REPO}@main"]).is_relative_to(workdir / "hub")
    assert sorted(losses(workdir)) == list(range(1, 13))


def test_a_changed_learning_rate_is_refused_naming_the_field(killed_and_rerun, mirror):
    workdir = killed_and_rerun[0]
    before = (workdir / "spec.json").read_text()
    code, out = finish(ftjob_run(doc(learningRate=1e-3), workdir, mirror))
    assert code == 1
    assert "spec.training.learningRate: 0.003 -> 0.001" in out, out
    assert "--restart" in out and "--workdir" in out
    assert (workdir / "spec.json").read_text() == before  # the record still tells the truth
    assert (workdir / "model").is_dir()


def test_more_steps_say_they_replace_the_export_which_stays_until_the_new_one_is_written(
    killed_and_rerun, mirror
):
    """maxSteps raised after the export (12 -> 16): before training the run says it continues
    a finished job and will replace the export (log line and progress field); while it
    trains the 12-step export is still there and loads; at the end the 16-step one is."""
    from transformers import AutoModelForCausalLM

    workdir = killed_and_rerun[0]
    export = workdir / "model"
    before = (export / "model.safetensors").read_bytes()
    proc = ftjob_run(doc(maxSteps=16), workdir, mirror)
    lines = []
    for line in proc.stdout:  # read as it runs: check the old export while training goes on
        lines.append(line)
        if "resuming from checkpoint" in line:
            assert (export / "model.safetensors").read_bytes() == before
            AutoModelForCausalLM.from_pretrained(export)  # whole and loadable
    code, out = finish(proc)
    out = "".join(lines) + out
    assert code == 0, out
    assert "already trained" not in out
    said = f"continues a finished job to 16 steps; the export at {export} (holds 12 steps) "
    assert said + "will be replaced when this run completes" in out, out
    assert out.index(said) < out.index("resuming from checkpoint")  # before training
    assert "resuming from checkpoint" in out and "(step 12)" not in out  # no step-12 checkpoint
    assert max(losses(workdir)) == 16
    # The progress field, there from the first step on (history rows are whole snapshots).
    resumed = [r for r in history(workdir) if r["step"] > 12]
    assert resumed and all(r["replacesExport"] == str(export) for r in resumed)
    assert all(r["exportedSteps"] == 12 for r in resumed)
    # ... and the operator shows it in status.progress, read from the trainer's real snapshot.
    from ftjob.operator import status

    assert status.progress(resumed[0])["replacesExport"] == str(export)
    assert json.loads((workdir / "spec.json").read_text())["trainedSteps"] == 16
    assert (export / "model.safetensors").read_bytes() != before  # the new export, in place
    assert not [p.name for p in workdir.iterdir() if p.name.endswith("-model")]  # no leftovers
    finished = final(workdir)

    code, out = finish(ftjob_run(doc(maxSteps=16), workdir, mirror))
    assert code == 0 and "already trained" in out, out
    assert "will be replaced" not in out
    again = final(workdir)
    assert again["phase"] == "succeeded"
    kept = ("step", "totalSteps", "loss", "evalLoss", "tokensSeen", "lastCheckpointStep")
    assert {k: again[k] for k in kept} == {k: finished[k] for k in kept}
    assert (again["step"], again["totalSteps"]) == (16, 16) and again["loss"] is not None


def test_a_pods_trainer_rerun_on_a_finished_folder_keeps_the_numbers(killed_and_rerun, mirror):
    """What a restarted pod runs (python -m ftjob.trainer, not ftjob run) on a folder whose
    export is written: it answers "already trained" and progress.json keeps the finished
    run's step, losses and tokens (not step 0, loss null) with phase succeeded."""
    workdir = killed_and_rerun[0]
    finished = final(workdir)
    job_file = workdir.parent / "pod.yaml"
    job_file.write_text(yaml.safe_dump(doc(), sort_keys=False))
    env = {**os.environ, "FTJOB_JOB_DIR": str(workdir), "FTJOB_PROGRESS_PORT": "0"}
    env |= {"HF_ENDPOINT": mirror.url, "FTJOB_SOURCE_ROOT": str(workdir.parent)}
    cmd = [sys.executable, "-m", "ftjob.trainer", "--spec", str(job_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "already trained" in proc.stdout
    again = final(workdir)
    assert again["phase"] == "succeeded" and again["exportPath"] == str(workdir / "model")
    for key in ("step", "totalSteps", "epoch", "loss", "evalLoss", "tokensSeen"):
        assert again[key] == finished[key], key
    assert again["step"] > 0 and again["loss"] is not None


def test_restart_moves_the_old_run_aside_and_starts_over(killed_and_rerun, mirror):
    workdir = killed_and_rerun[0]
    code, out = finish(ftjob_run(doc(learningRate=1e-3, maxSteps=4), workdir, mirror, "--restart"))
    assert code == 0, out
    aside = [p for p in workdir.parent.iterdir() if p.name.startswith("hub.old-")]
    assert len(aside) == 1 and (aside[0] / "model").is_dir()
    assert "no checkpoint in" in out and sorted(losses(workdir)) == [1, 2, 3, 4]
    assert json.loads((workdir / "spec.json").read_text())["training"][
        "training.learningRate"
    ] == pytest.approx(1e-3)
