"""The operator converges through restarts and API errors: it never duplicates pods, never
counts one failure twice and never loses status. An operator killed mid-job and a watch
that expired are the real control plane's to show (tests/cluster/test_real_operator.py,
tests/cluster/test_real_watch.py)."""

import time

import pytest
from apiserver import CRD_RESOURCE
from cluster import Cluster
from hangs import FLOOR
from support import Operator, gang_running, job_pods, job_status, tiny_job, wait_phase

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def fresh(tmp_path):
    """A cluster of its own and an operator that the test may kill."""
    with Cluster(tmp_path) as cluster:
        op = Operator(cluster, tmp_path / "operator.log")
        yield cluster, op
        op.stop()


def test_restarting_the_operator_changes_nothing_that_is_right(fresh):
    cluster, op = fresh
    op.start()
    cluster.create_job(tiny_job("steady"))
    pods = {p["metadata"]["uid"] for p in gang_running(cluster, "steady", 0)}
    before = wait_phase(cluster, "steady", "Running")
    op.stop()
    op.start()
    time.sleep(2.5)
    assert {p["metadata"]["uid"] for p in job_pods(cluster, "steady")} == pods
    after = job_status(cluster, "steady")
    # The cost alone may move on (a gang's first running seconds are written at the next
    # look, whichever daemon makes it): the same attempts, none counted less.
    spent, was = after.pop("cost"), before.pop("cost")
    assert after == before
    pairs = list(zip(spent["attempts"], was["attempts"], strict=True))
    assert all(a["attempt"] == b["attempt"] and a["nodeSeconds"] >= b["nodeSeconds"]
               for a, b in pairs)  # fmt: skip


def test_api_server_errors_are_retried(fresh):
    """Server errors on a create and on a status write, injected (the real apiserver gives them
    only when it is failing). A stale write is the real plane's to show: the real apiserver
    answers the operator's stale finalizer patch 422, never 409 on its status write
    (tests/cluster/test_real_watch.py)."""
    cluster, op = fresh
    cluster.call(lambda: cluster.api.fail("POST", "pods", 500, times=2))
    cluster.call(lambda: cluster.api.fail("PATCH", "finetunejobs", 500, subresource="status"))
    op.start()
    cluster.create_job(tiny_job("flaky"))
    gang_running(cluster, "flaky", 0)
    wait_phase(cluster, "flaky", "Running")
    assert op.metric("ftjob_reconcile_errors_total") >= 2
    assert all(f.times == 0 for f in cluster.api.faults)


# kopf's peering resource (as in kopf's docs/peering.yaml): peers write their liveness into
# the object's status, which therefore is not a subresource here.
PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterkopfpeerings.kopf.dev"},
    "spec": {
        "group": "kopf.dev",
        "scope": "Cluster",
        "names": {
            "kind": "ClusterKopfPeering",
            "plural": "clusterkopfpeerings",
            "singular": "clusterkopfpeering",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def test_two_replicas_peer_and_only_the_leader_acts(fresh, tmp_path):
    cluster, _ = fresh
    peering = {
        "apiVersion": "kopf.dev/v1",
        "kind": "ClusterKopfPeering",
        "metadata": {"name": "ftjob"},
    }
    cluster.call(lambda: cluster.api.create_object(CRD_RESOURCE, None, PEERING_CRD))
    gvp = ("kopf.dev", "v1", "clusterkopfpeerings")
    cluster.call(lambda: cluster.api.create_object(gvp, None, peering))
    peered = ("--peering", "ftjob")
    leader = Operator(
        cluster, tmp_path / "leader.log", *peered, "--priority", "20", standalone=False
    ).start()
    backup = Operator(
        cluster, tmp_path / "backup.log", *peered, "--priority", "10", standalone=False
    ).start()
    try:
        # The backup starts paused and stays so while a higher priority peer is alive.
        cluster.create_job(tiny_job("peer"))
        gang_running(cluster, "peer", 0)
        wait_phase(cluster, "peer", "Running")
        assert leader.metric("ftjob_reconcile_seconds_count") > 0
        assert backup.metric("ftjob_reconcile_seconds_count") == 0
        leader.stop()  # a clean exit takes it out of the peering at once
        cluster.wait(lambda: backup.logged("Resuming operations"), FLOOR, "the backup to resume")
        cluster.terminate("peer-node-0", 137, "OOMKilled")
        gang_running(cluster, "peer", 1)
        assert backup.metric("ftjob_gang_restarts_total") == 1
    finally:
        leader.stop()
        backup.stop()


def test_an_operator_for_some_namespaces_leaves_the_others_alone(fresh):
    cluster, _ = fresh
    op = Operator(cluster, cluster.workdir / "scoped.log", "--namespace", "team-a").start()
    try:
        cluster.create_job(tiny_job("mine"), namespace="team-a")
        cluster.create_job(tiny_job("other"), namespace="default")
        cluster.wait(lambda: len(job_pods(cluster, "mine", "team-a")) == 2, FLOOR, "team-a's pods")
        time.sleep(1.5)  # more than a resync
        assert not job_pods(cluster, "other") and job_status(cluster, "other") == {}
    finally:
        op.stop()
