"""The operator's side of the recovery ladder, as pure functions: restarts in place counted
from rank 0's real progress snapshot, failures blamed on nodes, and the next gang's pods kept
off those nodes (validated against Kubernetes' schema and the API server's rules)."""

from datetime import timedelta
from pathlib import Path

import kubernetes_validate
import pytest
from test_status import T0, decide, pod, run_to

from ftjob.api import contract, kubevalidation, manifest
from ftjob.api.jobspec import parse_resource
from ftjob.operator import lifecycle, render
from ftjob.operator import status as st
from ftjob.trainer.gang import preflight
from ftjob.trainer.gang.stragglers import CONSECUTIVE, Stragglers
from ftjob.trainer.report.progress import Progress

ROOT = Path(__file__).resolve().parents[2]


def tiny(**scheduling):
    doc = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
    if scheduling:
        doc["spec"]["scheduling"] = scheduling
    return parse_resource(doc)


def rank0(tmp_path) -> Progress:
    """Rank 0's real progress writer (what /progress serves), not a dict typed here."""
    report = Progress(tmp_path, True, 60, 2, writes_files=False)
    report.begin(0)
    return report


def snapshot(report: Progress) -> dict:
    return dict(report.snapshot)


# ------------------------------------------------------------------- restarts in place


def restarted_rank0(tmp_path, monkeypatch, restarts: int) -> Progress:
    """Rank 0 of a gang whose workers the node agent restarted ``restarts`` times in place:
    it reads the count from the agent's environment, as the trainer does."""
    monkeypatch.setenv("FTJOB_RESTARTS_IN_PLACE", str(restarts))
    return rank0(tmp_path)


def test_restarts_in_place_are_counted_across_gangs_with_an_event(tmp_path, monkeypatch):
    running = run_to([pod(0), pod(1)])
    assert running.status["restartsInPlace"] == 0
    # torchrun restarted the workers once: the restarted rank 0 reports it.
    report = restarted_rank0(tmp_path, monkeypatch, 1)
    d = decide(running.status, [pod(0), pod(1)], snapshot=snapshot(report))
    assert d.status["restartsInPlace"] == 1 and d.status["attemptRestartsInPlace"] == 1
    assert [e[1] for e in d.events].count("RestartedInPlace") == 1
    assert d.status["restarts"] == 0 and d.create == [] and d.delete == []  # the pods stay
    # The same snapshot again changes nothing (level-triggered).
    again = decide(d.status, [pod(0), pod(1)], snapshot=snapshot(report))
    assert again.status["restartsInPlace"] == 1
    assert "RestartedInPlace" not in [e[1] for e in again.events]
    # The in-place budget is spent and a pod fails: a new gang, whose count starts at 0.
    report = restarted_rank0(tmp_path, monkeypatch, 3)
    failed = pod(1, phase="Failed", exit_code=1)
    r = decide(again.status, [pod(0), failed], snapshot=snapshot(report))
    assert r.phase == "Restarting" and r.status["restarts"] == 1
    assert r.status["restartsInPlace"] == 3 and r.status["attemptRestartsInPlace"] == 0
    # The new gang's rank 0 restarts once in place: the job's total goes on from 3.
    new_gang = restarted_rank0(tmp_path, monkeypatch, 1)
    n = decide(r.status, [pod(0, attempt=1), pod(1, attempt=1)], snapshot=snapshot(new_gang))
    assert n.status["restartsInPlace"] == 4 and n.status["attemptRestartsInPlace"] == 1


def test_a_late_snapshot_of_the_previous_gang_is_not_counted_again(tmp_path, monkeypatch):
    """The operator fetched the old rank 0's /progress and the answer came after the new gang
    started: held with the old attempt, it does not reach the decision."""
    old_rank0 = snapshot(restarted_rank0(tmp_path, monkeypatch, 2))
    running = run_to([pod(0), pod(1)])
    held = (0, old_rank0)  # (attempt of the pod that served it, snapshot)
    d = decide(
        running.status, [pod(0), pod(1)], snapshot=lifecycle.gang_snapshot(held, running.status)
    )
    assert d.status["restartsInPlace"] == 2
    r = decide(d.status, [pod(0), pod(1, phase="Failed", exit_code=1)])
    assert r.status["attempt"] == 1 and r.status["attemptRestartsInPlace"] == 0
    assert lifecycle.gang_snapshot(held, r.status) is None
    late = decide(r.status, [], snapshot=lifecycle.gang_snapshot(held, r.status))
    assert late.status["restartsInPlace"] == 2
    assert "RestartedInPlace" not in [e[1] for e in late.events]
    # Decided with, it would be counted a second time: what the rule prevents.
    assert decide(r.status, [], snapshot=old_rank0).status["restartsInPlace"] == 4
    # The new gang's own snapshot is used.
    new_rank0 = snapshot(restarted_rank0(tmp_path, monkeypatch, 1))
    assert lifecycle.gang_snapshot((1, new_rank0), r.status) == new_rank0


def test_preflight_and_stragglers_from_the_snapshot_reach_the_status(tmp_path):
    report = rank0(tmp_path)
    # The preflight's own figures (ftjob.trainer.gang.preflight.run): its summary of what each
    # rank measured (a real volume check here), then the all-reduce's bus bandwidth.
    measured = [
        {"node": "a", "rank": 0, **preflight.check_volume(tmp_path, "a", 0)},
        {"node": "b", "rank": 1},
    ]
    figures = preflight.summary(measured)
    figures["busBandwidthGBps"] = round(preflight.bus_bandwidth(64 << 20, 0.15, 2), 3)
    figures |= {"transport": "gloo", "seconds": 0.1}
    # Rank 1 slower than the margin on CONSECUTIVE log steps (ftjob.trainer.gang.stragglers).
    slow = Stragglers(margin=0.25, nodes=["a", "b"])
    for _ in range(CONSECUTIVE):
        slow.observe([1.0, 2.0])
    report.update(preflight=figures)
    report.stragglers(slow.named, slow.describe())
    d = decide(run_to([pod(0), pod(1)]).status, [pod(0), pod(1)], snapshot=snapshot(report))
    kept = {"busBandwidthGBps": figures["busBandwidthGBps"], "transport": "gloo",
            "volumeWriteMBps": figures["volumeWriteMBps"], "note": figures["note"]}  # fmt: skip
    assert d.status["preflight"] == kept | {"seconds": 0.1, "nodes": 2}
    assert d.status["stragglers"] == [
        {"rank": 1, "node": "b", "stepSeconds": 2.0, "medianSeconds": 1.5}
    ]
    slow.observe([1.0, 1.0])  # back within the margin
    report.stragglers(slow.named, slow.describe())
    assert decide(d.status, [pod(0), pod(1)], snapshot=snapshot(report)).status["stragglers"] == []


# ------------------------------------------------------------------------- bad nodes


def evicted(rank, attempt=0, message="The node was low on resource: memory. "):
    """Evicted by the kubelet; by default for the node's pressure (the kubelet's words)."""
    extra = {"reason": "Evicted", "message": message}
    return pod(rank, attempt, phase="Failed", extra=extra)


def test_a_node_blamed_for_a_failure_is_avoided_by_the_next_gang():
    d = run_to([pod(0), pod(1)])
    r = decide(d.status, [pod(0), evicted(1)])
    assert r.phase == "Restarting" and r.status["failure"]["nodeFault"] is True
    (bad,) = r.status["badNodes"]
    assert bad["node"] == "node-1" and bad["reason"] == "Evicted" and bad["count"] == 1
    events = {e[1]: e[2] for e in r.events}
    assert "node-1" in events["BadNode"] and "Evicted" in events["BadNode"]
    assert "avoiding node(s) node-1" in events["Evicted"]
    # The next gang's pods, as the handlers render them from that status.
    _, spec = tiny()
    p = render.pod("tiny", "ns", spec, 0, 1, "uid", avoid=lifecycle.bad_nodes(r.status))
    terms = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-1"]}]}
    ]
    kubernetes_validate.validate(p, "1.37", strict=True)
    assert kubevalidation.errors([p]) == []


def test_a_node_fault_that_ends_the_job_keeps_no_node_away():
    """No next gang: the failure says it was the node's, but nothing is kept away."""
    d = run_to([pod(0), pod(1)], backoffLimit=0)
    f = decide(d.status, [pod(0), evicted(1)], backoffLimit=0)
    assert f.phase == "Failed" and f.status["failure"]["nodeFault"] is True
    assert "badNodes" not in f.status and "BadNode" not in [e[1] for e in f.events]


def test_an_eviction_for_the_pod_s_own_limits_blames_no_node():
    d = run_to([pod(0), pod(1)])
    own = "Pod ephemeral local storage usage exceeds the total limit of containers 1Gi. "
    r = decide(d.status, [pod(0), evicted(1, message=own)])
    assert r.phase == "Restarting" and r.status["failure"]["reason"] == "Evicted"
    assert "nodeFault" not in r.status["failure"] and "badNodes" not in r.status
    assert own.strip() in r.status["failure"]["message"]


def test_the_same_node_again_counts_up_and_the_list_is_bounded():
    bad: list = []
    for i in range(st.BAD_NODES_KEPT + 3):
        failure = {"reason": "Evicted", "node": f"n{i}", "nodeFault": True}
        bad, _ = st.note_bad_node(bad, failure, T0 + timedelta(minutes=i))
    assert len(bad) == st.BAD_NODES_KEPT and bad[0]["node"] == "n3"  # the oldest went
    again = {"reason": contract.NODE_UNHEALTHY, "node": "n3", "nodeFault": True}
    bad, entry = st.note_bad_node(bad, again, T0 + timedelta(hours=1))
    assert entry == {"node": "n3", "reason": "NodeUnhealthy", "count": 2,
                     "lastSeen": "2026-01-01T13:00:00Z"}  # fmt: skip
    assert bad[-1]["node"] == "n3" and len(bad) == st.BAD_NODES_KEPT


@pytest.mark.parametrize(
    "scenario", ["host-oom", "disk-full", "checkpoint-unreadable", "volume-unusable"]
)
def test_failures_of_the_job_not_the_node_blame_no_node(trainer_runs, scenario):
    run = trainer_runs.get(scenario)
    d = run_to([pod(0), pod(1)], backoffLimit=5)
    r = decide(d.status, [pod(0), pod(1, real=run)], backoffLimit=5)
    assert r.phase == "Restarting" and "badNodes" not in r.status
    assert "nodeFault" not in r.status["failure"]
    # The record names the node the trainer ran on (FTJOB_NODE_NAME, the downward API's).
    assert contract.parse(run.record)["node"] == r.status["failure"]["node"] == "node-a"


def test_a_pod_deleted_by_someone_blames_no_node_but_a_lost_node_does():
    d = run_to([pod(0), pod(1)])
    deleted = pod(1)
    deleted["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    assert "badNodes" not in decide(d.status, [pod(0), deleted]).status
    lost = decide(d.status, [pod(0), pod(1, phase="Unknown")])
    assert lifecycle.bad_nodes(lost.status) == ["node-1"]


def test_anti_affinity_joins_every_term_of_the_spec_s_own_affinity():
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    pool = {"key": "pool", "operator": "In", "values": ["gpu"]}
    given = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchExpressions": [pool]}]
            }
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    name, spec = tiny(affinity=given)
    p = render.pod(name, "ns", spec, 0, 2, "uid", avoid=["b", "a", "b"])
    got = p["spec"]["affinity"]
    terms = got["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    away = [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("a", "b")]
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [zone], "matchFields": away},
        {"matchExpressions": [pool], "matchFields": away},
    ]
    # The spec's own pod anti-affinity is kept; the gang's one pod per node joins it.
    kept = got["podAntiAffinity"]
    assert kept["preferredDuringSchedulingIgnoredDuringExecution"] == []
    assert len(kept["requiredDuringSchedulingIgnoredDuringExecution"]) == 1
    assert spec.scheduling.affinity == given  # the spec itself is not changed
    kubernetes_validate.validate(p, "1.37", strict=True)
    assert kubevalidation.errors([p]) == []
    # Without bad nodes the spec's node affinity is rendered as it is.
    plain = render.pod(name, "ns", spec, 0, 0, "uid")["spec"]["affinity"]
    assert plain["nodeAffinity"] == given["nodeAffinity"]


def test_the_api_server_s_node_selector_rules_are_checked():
    """What the schema lets through and the API server refuses (so ftjob validate says so
    for a spec's own affinity too)."""
    _, spec = tiny()
    p = render.pod("tiny", "ns", spec, 0, 0, "uid", avoid=["x"])
    term = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    term["nodeSelectorTerms"][0]["matchFields"][0]["values"] = ["x", "y"]
    term["nodeSelectorTerms"][0]["matchExpressions"] = [{"key": "zone", "operator": "In"}]
    found = {e.path.rsplit(".", 1)[-1]: e.message for e in kubevalidation.errors([p])}
    assert "only one value" in found["values"]
    assert any("must be specified" in e.message for e in kubevalidation.errors([p]))


def test_the_trainer_names_the_node_it_runs_on_from_the_downward_api():
    _, spec = tiny()
    env = render.pod("tiny", "ns", spec, 0, 0, "uid")["spec"]["containers"][0]["env"]
    (node,) = [e for e in env if e["name"] == contract.NODE_NAME_ENV]
    assert node["valueFrom"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}
