"""The losses a job on a cluster logged, against `ftjob run`'s of the same job file: what the
tests of real pods (on real nodes) compare bit for bit after every fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import hangs
from plane import Plane


def reference(job: dict, volume: Path, work: Path) -> SimpleNamespace:
    """`ftjob run` of ``job`` written as a file on the volume's host folder (where its relative
    model and data sources are), one thread a process as in a one-core pod: its losses, its
    time and the file."""
    job_file = volume / f"{job['metadata']['name']}.yaml"
    job_file.write_text(json.dumps(job))
    argv = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(work)]
    env = dict(os.environ, TERM="dumb", OMP_NUM_THREADS="1")
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=hangs.RUN, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return SimpleNamespace(seconds=time.monotonic() - start, losses=losses(work), file=job_file)


def losses(job_dir: Path) -> list[tuple[int, float]]:
    """Every logged step's loss, in step order. A gang that resumes from a checkpoint older
    than the last logged step (a SIGKILL lands a few steps after the save) logs those steps
    again: each such step must log the very loss it logged before (asserted here)."""
    rows = [json.loads(x) for x in (job_dir / "progress.jsonl").read_text().splitlines()]
    logged: dict[int, float] = {}
    for r in (r for r in rows if r["event"] == "step"):
        first = logged.setdefault(r["step"], r["loss"])
        assert first == r["loss"], f"step {r['step']} logged {first}, then {r['loss']}"
    return sorted(logged.items())


def host_dir(volume: Path, plane: Plane, namespace: str, name: str) -> Path:
    """Job ``name``'s folder on the volume's host side."""
    uid = plane.get("ftj", name, namespace)["metadata"]["uid"]
    return volume / f"{name}-{uid[:8]}"
