"""Loading is not stalling: the real trainer, slowed while it loads the model, against the
real lifecycle decisions.

    python -m pytest tests/e2e/test_startup.py -q
"""

from __future__ import annotations

import json
import os
import urllib.request
from datetime import timedelta

import hangs
import pytest
from trainer_outputs import Runs, job, wait_for_phase

from ftjob.api.jobspec import parse_resource
from ftjob.operator import lifecycle, render
from ftjob.operator import status as st

pytestmark = pytest.mark.timeout(300)

# The test double of a slow source: model loading sleeps first (a large download or a slow
# volume), imported by the trainer process at start-up (sitecustomize on PYTHONPATH).
SLOW_LOAD = """
import os, time
from ftjob.trainer.model import load as model
_build = model.build
def build(*args, **kwargs):
    time.sleep(float(os.environ["SLOW_LOAD_SECONDS"]))
    return _build(*args, **kwargs)
model.build = build
"""


def running_pod(name: str, spec) -> dict:
    p = render.pod(name, "ns", spec, 0, 0, "uid")
    trainer = {"name": "trainer", "state": {"running": {}}}
    p["status"] = {"phase": "Running", "containerStatuses": [trainer]}
    return p


def test_a_slow_load_is_not_restarted_as_a_stall(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_LOAD)
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "SLOW_LOAD_SECONDS": "15",
    }
    policy = {"stallTimeoutSeconds": 60, "startupTimeoutSeconds": 600}
    doc = job("slow-load", runPolicy=policy, network={"collectiveTimeoutSeconds": 30})
    runs = Runs(tmp_path / "runs")
    started = runs.start("slow-load", doc, env=env)
    proc, _, job_dir, _ = started
    try:
        snap = wait_for_phase(job_dir, ("loading",), proc)
        # Rank 0 serves its progress while it loads, as the operator polls it.
        url = f"http://127.0.0.1:{snap['port']}/progress"
        served = json.loads(urllib.request.urlopen(url, timeout=hangs.FLOOR).read())
        assert served["phase"] == "loading" and served["step"] == 0
    finally:
        outcome = runs.finish(started)
    assert outcome.exit_code == 0, outcome.log[-3000:]

    # The operator's decisions with that real report, the clock moved past the stall timeout.
    name, spec = parse_resource(doc)
    pods = [running_pod(name, spec)]
    since = st.parse_time(served["startedAt"])
    created = lifecycle.decide(spec, name, 1, None, [], since)
    running = lifecycle.decide(spec, name, 1, created.status, pods, since)
    assert running.phase == "Running"
    later = since + timedelta(seconds=policy["stallTimeoutSeconds"] + 30)
    slow = lifecycle.decide(spec, name, 1, running.status, pods, later, served)
    assert slow.phase == "Running" and not slow.delete, slow.status.get("failure")
    assert slow.status["progress"]["phase"] == "loading"
    # The startup limit still holds: a load that never ends is restarted, and says why.
    never = since + timedelta(seconds=policy["startupTimeoutSeconds"])
    stuck = lifecycle.decide(spec, name, 1, slow.status, pods, never, served)
    assert stuck.phase == "Restarting" and stuck.status["failure"]["reason"] == "StartupTimeout"
    assert "rank 0 is loading" in stuck.status["failure"]["message"]
