"""The control plane restarts under a running ``ftjob operator`` (issue 55, point 3): the real
kube-apiserver stopped for 30 s and started again, then etcd likewise, while gangs run on kwok's
nodes and pods change. The operator rides it out as the same process, every job converges to
what its pods say, no gang that did not fail is made again, and its log names the outage a
bounded number of times (not a line per job per second). A watch refused for longer than the
operator retries (FTJOB_API_RETRY_SECONDS) ends it, saying why."""

from __future__ import annotations

import copy
import json
import sys
import time
from types import SimpleNamespace

import hangs
import pytest
from plane import ROOT, Plane, token_kubeconfig

sys.path.append(str(ROOT / "tests" / "emulator"))
from support import Operator  # noqa: E402  (the emulator tests' launcher, reused)

from ftjob.api import manifest  # noqa: E402

NAMESPACE = "outage"
OUTAGE = 15  # seconds each component stays down: not a wait, the outage itself (past
# kopf's first retries, well short of FTJOB_API_RETRY_SECONDS' 300)
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
# The log may name an outage this often in all: a few lines each (kopf's watch retries, a
# reconcile that failed), never a line per job per second (~15 s x 3 jobs here).
LINES_PER_OUTAGE = 12
pytestmark = pytest.mark.timeout(2 * OUTAGE + 6 * hangs.FLOOR + 300)


@pytest.fixture(scope="module")
def operator(tmp_path_factory):
    """A plane of its own: the outages leave kwok's scheduler cache behind the API server
    (it may keep a new pod Pending), which no later test on the session's plane should meet."""
    work = tmp_path_factory.mktemp("outage")
    plane = Plane(work / "k8s").up()
    try:
        plane.install()
        plane.namespace(NAMESPACE)
        kubeconfig = token_kubeconfig(plane, "ftjob-system", "ftjob", work / "sa.kubeconfig")
        op = Operator(SimpleNamespace(kubeconfig=kubeconfig, wait=Plane.wait), work / "op.log")
        op.plane = plane
        yield op.start()
        op.stop()
    finally:
        plane.down()


def tiny_job(name: str) -> dict:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    doc["spec"]["runPolicy"] = {"backoffLimit": 2}
    return doc


def pods_of(plane: Plane, name: str) -> list[dict]:
    pods = plane.get("pods", namespace=NAMESPACE) or []
    return [p for p in pods if p["metadata"]["labels"].get("ftjob.dev/job-name") == name]


def gang(plane: Plane, name: str, attempt: int, phase: str | None = "Running") -> dict:
    """Waits until the job's 2 pods are of ``attempt`` and in ``phase`` (None: one phase,
    whichever: a restarted plane's kwok may leave new pods Pending), and its status says the
    phase the pods call for; returns {pod name: uid}."""
    says = {"Running": "Running", "Pending": "Pending", "Succeeded": "Failed"}  # exit 0, no model

    def check():
        pods = pods_of(plane, name)
        status = (plane.get("ftj", name, NAMESPACE) or {}).get("status") or {}
        phases = {p["status"].get("phase") for p in pods}
        ok = len(pods) == 2 and len(phases) == 1 and phases <= ({phase} if phase else set(says))
        ok = ok and {p["metadata"]["labels"]["ftjob.dev/attempt"] for p in pods} == {str(attempt)}
        ok = ok and status.get("phase") == says[phases.pop()] and status.get("attempt") == attempt
        return ok and {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}

    try:
        return plane.wait(check, hangs.FLOOR, f"{name}: attempt {attempt}, pods {phase}")
    except AssertionError as e:
        status = (plane.get("ftj", name, NAMESPACE) or {}).get("status")
        pods = [(p["metadata"]["name"], p["metadata"]["labels"], p["status"].get("phase"))
                for p in pods_of(plane, name)]  # fmt: skip
        raise AssertionError(f"{e}: status {status}, pods {pods}") from None


def terminate(plane: Plane, pod: str, exit_code: int, reason: str) -> None:
    """What a kubelet writes when the trainer container ends: the pod's status subresource."""
    term = {"exitCode": exit_code, "reason": reason, "startedAt": None, "finishedAt": None}
    container = {"name": "trainer", "ready": False, "restartCount": 0, "image": "trainer:test",
                 "imageID": "sha256:0", "state": {"terminated": term}}  # fmt: skip
    phase = "Failed" if exit_code else "Succeeded"
    patch = {"status": {"phase": phase, "containerStatuses": [container]}}
    plane.kubectl("patch", "pod", pod, "-n", NAMESPACE, "--subresource=status",
                  "--type=merge", "-p", json.dumps(patch))  # fmt: skip


def outage(plane: Plane, op: Operator, component: str) -> int:
    """``component`` stopped for OUTAGE seconds and started again; returns the operator's
    log's length in lines when it was stopped."""
    before = len(op.log.read_text().splitlines())
    argv = plane.stop(component)
    time.sleep(OUTAGE)
    assert op.proc.poll() is None, op.log.read_text()[-3000:]
    plane.start(component, argv)
    return before


def test_the_operator_rides_out_an_apiserver_and_an_etcd_restart(operator):
    plane, op = operator.plane, operator
    pid = op.proc.pid
    for name in ("steady", "oom", "done"):
        plane.apply(tiny_job(name))
    steady = gang(plane, "steady", 0)
    first_oom = gang(plane, "oom", 0)
    done = gang(plane, "done", 0)

    api_down = outage(plane, op, "kube-apiserver")
    terminate(plane, "oom-node-1", 137, "OOMKilled")  # a gang that fails: replaced once
    second_oom = gang(plane, "oom", 1, None)
    etcd_down = outage(plane, op, "etcd")
    for rank in (0, 1):  # a gang that ends: its status follows, no new gang
        terminate(plane, f"done-node-{rank}", 0, "Completed")
    assert gang(plane, "done", 0, "Succeeded") == done
    assert gang(plane, "oom", 1, None) == second_oom and not set(first_oom.values()) & set(
        second_oom.values()
    )
    assert gang(plane, "steady", 0) == steady  # the same pods (UIDs): never made again
    status = (plane.get("ftj", "oom", NAMESPACE) or {}).get("status") or {}
    assert status["restarts"] == 1 and status["failure"]["reason"] == "OOMKilled", status
    # The same process throughout, healthy.
    assert op.proc.pid == pid and op.proc.poll() is None and op.healthy()
    # What the log says of each outage: from its stop to the next one, and to the end.
    log = op.log.read_text().splitlines()
    said = {"kube-apiserver": log[api_down:etcd_down], "etcd": log[etcd_down:]}
    assert any("the API server did not answer" in line for line in said["kube-apiserver"])
    for component, lines in said.items():
        noise = [line for line in lines if "ftjob.operator: outage/" not in line]  # decisions
        print(f"{component} outage: {len(noise)} log lines besides the jobs' decisions")
        assert len(noise) <= LINES_PER_OUTAGE, "\n".join(noise[-40:])
        assert not [line for line in noise if "Traceback" in line], "\n".join(noise[-40:])


def test_a_watch_refused_past_the_retries_ends_the_operator_saying_why(operator, tmp_path):
    """A request of kopf's watches that keeps failing (a 403 while RBAC is edited, a 503 of a
    load balancer in front of restarting API servers) is retried for FTJOB_API_RETRY_SECONDS
    (10 s here, 300 by default; kopf's own span is 54 s). Past that the operator ends, so that
    its pod restarts and lists everything afresh, and its last line says why: not a
    traceback. Here the ClusterRole loses the pods' list and watch and the API server
    restarts, so every watch lists again and the pods' is refused."""
    plane = operator.plane
    operator.stop()  # the other test's: one operator on the plane at a time
    cluster = SimpleNamespace(kubeconfig=operator.cluster.kubeconfig, wait=Plane.wait)
    short = Operator(cluster, tmp_path / "op.log", env={"FTJOB_API_RETRY_SECONDS": "10"}).start()
    role = plane.get("clusterrole", "ftjob")
    edited = copy.deepcopy(role)
    for rule in edited["rules"]:
        if "pods" in rule.get("resources", []):
            rule["verbs"] = [v for v in rule["verbs"] if v not in ("list", "watch")]
    plane.apply(edited)
    plane.start("kube-apiserver", plane.stop("kube-apiserver"))
    refused = time.monotonic()
    try:
        hangs.poll(lambda: short.proc.poll() is not None, hangs.FLOOR, "the operator to end")
        took = time.monotonic() - refused
    finally:
        short.stop()
        plane.apply(role | {"metadata": {"name": "ftjob", "labels": role["metadata"]["labels"]}})
    last = short.log.read_text().strip().splitlines()[-1]
    print(f"the operator ended {took:.1f} s after the API server came back, exit "
          f"{short.proc.returncode}: {last}")  # fmt: skip
    assert short.proc.returncode == 1, last
    assert last.startswith("ftjob operator: a watch failed past FTJOB_API_RETRY_SECONDS"), last
    assert "HTTP 403" in last and 'cannot watch resource "pods"' in last, last
