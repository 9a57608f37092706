"""`ftjob run --profile-steps N`: the trainer profiles N steps after its warm-up, on rank 0, and
writes the summary and the Chrome trace into the job folder (ftjob.trainer.report.profile).

    python -m pytest tests/e2e/test_profile_run.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import hangs
import yaml
from trainer_outputs import job


def test_ftjob_run_with_profile_steps_writes_the_summary_and_the_trace(tmp_path):
    # The trainer contract's tiny job, 4 steps on 2 processes: only rank 0 profiles.
    doc = job(
        "profiled",
        training={"maxSteps": 4, "microBatchSize": 2, "logEvery": 1, "evalEvery": 0},
        resources={"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2},
    )
    del doc["spec"]["checkpoint"]
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    workdir = tmp_path / "job"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}
    env.pop("FTJOB_PROFILE_STEPS", None)
    done = subprocess.run(
        [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(workdir),
         "--profile-steps", "2"],
        capture_output=True, text=True, env=env, timeout=hangs.RUN,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = workdir / "logs" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["summary.json", "trace.json"]
    summary = json.loads((folder / "summary.json").read_text())
    # Steps 3 and 4: after the 2 warm-up steps, to the run's end.
    assert summary["steps"] == 2 and summary["warmupSteps"] == 2 and summary["device"] == "cpu"
    assert summary["busyFraction"] is None and summary["cpuOpFraction"] > 0
    assert summary["wallSeconds"] > 0 and 0 < len(summary["longest"]) <= 10
    times = [k["selfMs"] for k in summary["longest"]]
    assert times == sorted(times, reverse=True)
    assert not any(k["onDevice"] for k in summary["longest"])
    assert set(summary["hostSyncs"]) == {"streamSynchronize", "deviceSynchronize",
                                         "localScalarDense", "item", "copiesToHost"}  # fmt: skip
    assert json.loads((folder / "trace.json").read_text())["traceEvents"]
    assert "profile: 2 steps in " in done.stdout
