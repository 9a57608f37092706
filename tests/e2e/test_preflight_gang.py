"""The preflight with 2 real processes on CPU (gloo), through `ftjob run`: it measures the
all-reduce's bus bandwidth and the volume, reports them in progress and the job's status, and
refuses a gang under a forced floor with FabricMisconfigured and the numbers, before any
weight is read; an unhealthy node on rank 1 is named in both ranks' records.

    python -m pytest tests/e2e/test_preflight_gang.py -q
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

from test_trainer_run import injected, job, run

from ftjob.api import contract, manifest
from ftjob.api.jobspec import parse_resource
from ftjob.operator import lifecycle, render
from ftjob.operator import status as st


def test_preflight_measures_and_its_figures_reach_the_status(tmp_path):
    doc = job("preflight-ok", training={"maxSteps": 1}, preflight={"mode": "on"})
    code, out = run(doc, tmp_path / "ok")
    assert code == 0, out
    snapshot = json.loads((tmp_path / "ok" / "progress.json").read_text())
    figures = snapshot["preflight"]
    assert figures["busBandwidthGBps"] > 0 and figures["allReduceMiB"] == 8
    assert figures["transport"] == "gloo" and figures["volumeWriteMBps"] > 0
    assert figures["matmulTflops"] is None and "no GPU" in figures["note"]
    log = (tmp_path / "ok" / "logs" / "node-0.log").read_text()
    assert f"preflight: all-reduce bus bandwidth {figures['busBandwidthGBps']:.3g} GB/s" in log
    # The operator copies rank 0's real snapshot into the job's status.
    name, spec = parse_resource(manifest.load(tmp_path / "ok.yaml")[0])
    d = lifecycle.decide(spec, name, 1, None, [], datetime.now(timezone.utc), snapshot)
    assert d.status["preflight"]["busBandwidthGBps"] == figures["busBandwidthGBps"]
    assert d.status["preflight"]["transport"] == "gloo"


def test_a_bus_bandwidth_under_the_floor_fails_the_gang_before_loading(tmp_path):
    doc = job("preflight-slow", preflight={"mode": "on", "minBusBandwidthGBps": 1000})
    code, out = run(doc, tmp_path / "slow")
    assert code != 0
    assert "FabricMisconfigured" in out, out
    records = [
        contract.parse((tmp_path / "slow" / "logs" / f"node-{n}.termination").read_text())
        for n in (0, 1)
    ]
    for record in records:  # every rank reaches the same verdict, with the numbers
        assert record["reason"] == contract.FABRIC_MISCONFIGURED
        measured = re.search(r"bus bandwidth of ([0-9.e+-]+) GB/s", record["message"])
        assert measured and 0 < float(measured[1]) < 1000, record
        assert "under the floor of 1000 GB/s" in record["message"]
        assert "minBusBandwidthGBps" in record["fix"]
    # Nothing was loaded: the run never got past the preflight.
    log = (tmp_path / "slow" / "logs" / "node-0.log").read_text()
    assert "parameters (" not in log and not (tmp_path / "slow" / "checkpoints").exists()
    # The operator restarts the gang for it (a fabric may come right) and blames no node.
    name, spec = parse_resource(manifest.load(tmp_path / "slow.yaml")[0])
    pod = render.pod(name, "ns", spec, 0, 0, "uid")
    term = {"exitCode": 1, "reason": "Error", "message": contract.dumps(records[0])}
    trainer = {"name": "trainer", "state": {"terminated": term}}
    pod["status"] = {"phase": "Failed", "containerStatuses": [trainer]}
    failure = st.diagnose(pod)
    assert failure["reason"] == contract.FABRIC_MISCONFIGURED and "nodeFault" not in failure
    assert measured[1] in failure["message"]


def test_an_unhealthy_node_on_rank_1_is_named_in_both_ranks_records(tmp_path, monkeypatch):
    """Rank 1's node fails its GPU check (injected: no GPU here); rank 0, whose checks pass on
    another node, fails with it and names the node at fault, not its own."""
    injected(monkeypatch, "unhealthy:1:sick-node")
    code, out = run(job("preflight-sick", preflight={"mode": "on"}), tmp_path / "sick")
    assert code != 0
    assert "NodeUnhealthy" in out, out
    records = [
        contract.parse((tmp_path / "sick" / "logs" / f"node-{n}.termination").read_text())
        for n in (0, 1)
    ]
    assert [r["rank"] for r in records] == [0, 1]
    for record in records:
        assert record["reason"] == contract.NODE_UNHEALTHY, record
        assert record["node"] == "sick-node", record
        assert "GPU 0 of node sick-node failed a matmul" in record["message"]
    log = (tmp_path / "sick" / "logs" / "node-0.log").read_text()
    assert "parameters (" not in log  # nothing was loaded
    # The operator, reading rank 0's record, keeps the sick node away from the next gang.
    name, spec = parse_resource(manifest.load(tmp_path / "sick.yaml")[0])
    pod = render.pod(name, "ns", spec, 0, 0, "uid")
    term = {"exitCode": 1, "reason": "Error", "message": contract.dumps(records[0])}
    pod["status"] = {
        "phase": "Failed",
        "containerStatuses": [{"name": "trainer", "state": {"terminated": term}}],
    }
    failure = st.diagnose(pod)
    assert failure["reason"] == contract.NODE_UNHEALTHY and failure["nodeFault"]
    assert failure["node"] == "sick-node"
