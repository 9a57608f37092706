"""The recovery ladder's operator side, with `ftjob operator` as a real process against the
API emulator and real kubectl: restarts in place counted from rank 0's real progress reporter
over HTTP, and a node blamed for a failure kept away from the next gang."""

import json

import kubernetes_validate
import pytest
from hangs import FLOOR
from support import (
    events_of,
    gang_running,
    job_pods,
    job_status,
    rank0_progress,
    tiny_job,
    wait_phase,
)

from ftjob.api import kubevalidation

pytestmark = pytest.mark.timeout(90)


def event_messages(cluster, name: str, reason: str) -> list[str]:
    return [
        e.get("message", "")
        for e in cluster.list("events")
        if e.get("involvedObject", {}).get("name") == name and e.get("reason") == reason
    ]


def node_exclusions(pod: dict) -> list:
    affinity = pod["spec"].get("affinity", {}).get("nodeAffinity", {})
    terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return [t.get("matchFields") for t in terms.get("nodeSelectorTerms", [])]


def test_a_failure_on_a_node_keeps_the_next_gang_off_it(cluster, operator, kubectl):
    cluster.create_job(tiny_job("badnode", runPolicy={"backoffLimit": 3}))
    first = gang_running(cluster, "badnode", 0)
    assert all(node_exclusions(p) == [] for p in first)
    on = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in first}
    bad = on["badnode-node-1"]
    evicted = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "The node was low on resource: memory.",
    }
    cluster.call(lambda: cluster.api.write_status("pods", "default", "badnode-node-1", evicted))

    second = gang_running(cluster, "badnode", 1)
    away = [{"key": "metadata.name", "operator": "NotIn", "values": [bad]}]
    for pod in second:  # as the API server stored them
        assert node_exclusions(pod) == [away]
        kubernetes_validate.validate(pod, "1.37", strict=True)
        assert kubevalidation.errors([pod]) == []
    status = job_status(cluster, "badnode")
    (entry,) = status["badNodes"]
    assert entry["node"] == bad and entry["reason"] == "Evicted" and entry["count"] == 1
    assert status["restarts"] == 1 and status["failure"]["nodeFault"] is True
    cluster.wait(lambda: event_messages(cluster, "badnode", "BadNode"), FLOOR, "a BadNode event")
    (message,) = event_messages(cluster, "badnode", "BadNode")
    assert f"node {bad} is kept away" in message and "Evicted" in message

    # What a user sees: the list in the status kubectl prints.
    shown = kubectl("get", "finetunejob", "badnode", "-o", "jsonpath={.status.badNodes}").stdout
    assert json.loads(shown)[0]["node"] == bad

    # Cleared (docs/operator.md): the gang after next may use the node again.
    kubectl("patch", "finetunejob", "badnode", "--subresource=status", "--type=merge",
            "-p", '{"status": {"badNodes": null}}')  # fmt: skip
    cluster.wait(
        lambda: "badNodes" not in job_status(cluster, "badnode"), FLOOR, "the list cleared"
    )
    cluster.terminate("badnode-node-0", 1)  # a failure that is not the node's
    third = gang_running(cluster, "badnode", 2)
    assert all(node_exclusions(p) == [] for p in third)
    assert "badNodes" not in job_status(cluster, "badnode")


def test_restarts_in_place_are_counted_from_rank_0_s_progress(
    cluster, operator, kubectl, monkeypatch
):
    doc = tiny_job("inplace")
    port = doc["spec"]["network"]["progressPort"]
    report = rank0_progress(port, 60)
    report.begin(0)
    try:
        cluster.create_job(doc)
        gang_running(cluster, "inplace", 0)
        wait_phase(cluster, "inplace", "Running")
        # The node agent restarted the workers twice in place: the new rank 0 reads the count
        # from the environment the agent gives it, and serves it on the same port.
        report.close()
        monkeypatch.setenv("FTJOB_RESTARTS_IN_PLACE", "2")
        report = rank0_progress(port, 60)
        report.begin(0)
        cluster.wait(
            lambda: job_status(cluster, "inplace").get("restartsInPlace") == 2,
            FLOOR,
            "restartsInPlace in status",
        )
        cluster.wait(
            lambda: "RestartedInPlace" in events_of(cluster, "inplace"), FLOOR, "the Event"
        )
        (message,) = event_messages(cluster, "inplace", "RestartedInPlace")
        assert "2 in this gang" in message
        status = job_status(cluster, "inplace")
        assert status["restarts"] == 0 and status["phase"] == "Running"
        assert {
            p["metadata"]["labels"]["ftjob.dev/attempt"] for p in job_pods(cluster, "inplace")
        } == {"0"}
        wide = kubectl("get", "finetunejob", "inplace", "-o", "wide").stdout.splitlines()
        header = wide[0].split()
        assert wide[1].split()[header.index("IN-PLACE")] == "2"
        assert operator.metric("ftjob_restarts_in_place_total") >= 2
    finally:
        report.close()
