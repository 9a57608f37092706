"""The operator converges through API errors: it never duplicates pods, never counts one
failure twice and never loses status. An operator killed mid-job or restarted with nothing
to do, a hand-over between peering replicas and a watch that expired are the real control
plane's to show (tests/cluster/test_real_operator.py, tests/cluster/test_real_handover.py,
tests/cluster/test_real_watch.py)."""

import time

import pytest
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
