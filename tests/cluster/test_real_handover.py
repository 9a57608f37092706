"""Two replicas of ``ftjob operator`` with one peering name, as the chart runs them with
``replicaCount: 2`` and ``peering.enabled`` (its args, its ClusterRole, its ClusterKopfPeering,
each replica's POD_ID), against the real control plane, with the chart's ServiceAccount token:
the acting replica is killed in the middle of a burst of jobs and the other takes over, and no
job gets a second gang, a counted attempt or a lost status update (issue 55, point 2).

Which replica acts is the API's word: kopf's keep-alives in the ClusterKopfPeering's status carry
each replica's priority, and the highest live one acts (the other logs that it pauses)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import hangs
import pytest
import yaml
from plane import KUBECTL, ROOT, Plane, token_kubeconfig

sys.path.append(str(ROOT / "tests" / "emulator"))
from support import Operator  # noqa: E402  (the emulator tests' launcher, reused)

from ftjob.api import manifest  # noqa: E402

NAMESPACE = "handover"
RELEASE, SYSTEM = "fleet", "fleet-system"  # not the installed release: its ClusterRole stays
PEERING = "ftjob"
# The chart's peering.lifetime (kopf's keep-alive): the standby's wait for a killed replica
# (the default 60 s, all of it waiting, was this module's largest cost).
LIFETIME = 15
JOBS = 50
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
pytestmark = pytest.mark.timeout(hangs.after(LIFETIME) + 600)


def chart_with_peering() -> list[dict]:
    """The chart rendered by the real Helm engine with two peering replicas."""
    import helm_python as helm

    values = {
        "replicaCount": 2,
        "peering": {"enabled": True, "name": PEERING, "lifetime": LIFETIME},
    }
    with helm.Chart.load(str(ROOT / "charts" / "ftjob")) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=SYSTEM, is_install=True)
    docs = [d for p, t in rendered.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t)]
    return [d for d in docs if d]


class Replicas:
    """The chart's Deployment's replicas as processes: its args (the ports aside: they share
    this machine), each with its own POD_ID, as the Deployment's pods get theirs."""

    def __init__(self, plane: Plane, deployment: dict, kubeconfig: Path, work: Path):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = [a for a in container["args"] if not a.startswith(("--liveness", "--metrics"))]
        assert args[0] == "operator" and f"--peering={PEERING}" in args, args
        self.args, self.plane, self.work = args[1:], plane, work
        self.target = SimpleNamespace(kubeconfig=kubeconfig, wait=Plane.wait)
        self.running: dict[str, Operator] = {}

    def start(self, pod: str, *priority: str) -> Operator:
        log = self.work / f"{pod}.log"
        args = [*self.args, *priority]
        op = Operator(self.target, log, *args, standalone=False, env={"POD_ID": pod})
        self.running[pod] = op.start()
        return op

    def peers(self) -> dict[str, dict]:
        """The ClusterKopfPeering's status: each replica's keep-alive (priority, lastseen)."""
        return (self.plane.get("clusterkopfpeering", PEERING) or {}).get("status") or {}

    def acting(self) -> str:
        """The running replica that acts: the highest priority in the peering's status, once
        every running replica keeps its keep-alive there, and the only one whose latest
        peering decision in its log is to resume (kopf starts a replica of a named peering
        paused, and resumes it when no live peer has a higher priority)."""
        peers: dict = {}

        def settled():
            peers.update(self.peers())
            if set(self.running) - set(peers):
                return None
            top = max(self.running, key=lambda pod: peers[pod]["priority"])
            resumed = {pod for pod, op in self.running.items() if acts(op)}
            return resumed == {top} and top

        try:
            return self.plane.wait(settled, hangs.FLOOR, "the replicas to settle who acts")
        except AssertionError as e:
            logs = {pod: op.log.read_text()[-2000:] for pod, op in self.running.items()}
            raise AssertionError(f"{e}: peers {peers}, logs {logs}") from None

    def stop_all(self) -> None:
        for op in self.running.values():
            op.stop()


@pytest.fixture(scope="module")
def replicas(installed: Plane, tmp_path_factory):
    plane = installed
    docs = chart_with_peering()
    keep = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering")
    applied = [d for d in docs if d["kind"] in keep]
    plane.kubectl("create", "namespace", SYSTEM)
    plane.namespace(NAMESPACE)
    plane.apply({"apiVersion": "v1", "kind": "List", "items": applied})
    work = tmp_path_factory.mktemp("handover")
    kubeconfig = token_kubeconfig(plane, SYSTEM, f"{RELEASE}-ftjob", work / "sa.kubeconfig")
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pair = Replicas(plane, deployment, kubeconfig, work)
    yield pair
    plane.delete_every_job()  # while a replica acts: it removes the jobs' finalizer
    pair.stop_all()
    cluster_scoped = [d for d in applied if d["kind"] != "ServiceAccount"]
    listed = json.dumps({"apiVersion": "v1", "kind": "List", "items": cluster_scoped})
    plane.kubectl("delete", "-f", "-", "--wait=false", input=listed)
    plane.kubectl("delete", "namespace", SYSTEM, NAMESPACE, "--wait=false")


def acts(op: Operator) -> bool:
    """Whether kopf's latest peering decision in the replica's log was to resume."""
    said = [line for line in op.log.read_text().splitlines() if "operations" in line]
    return bool(said) and "Resuming operations" in said[-1]


def tiny_job(name: str) -> dict:
    """examples/tiny.yaml's shape (2 nodes) under a new name."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    return doc


def apply_jobs(plane: Plane, names: list[str]) -> None:
    listed = {"apiVersion": "v1", "kind": "List", "items": [tiny_job(n) for n in names]}
    plane.apply(listed)


class PodLog:
    """Every pod event of the namespace as the API server sends it (kubectl's watch): which
    pod names were created, and with which UIDs, for the whole test."""

    def __init__(self, plane: Plane, path: Path):
        self.path = path
        argv = [KUBECTL, "--kubeconfig", str(plane.kubeconfig), "get", "pods", "-n",
                NAMESPACE, "-l", "ftjob.dev/job-name", "-w", "--output-watch-events", "-o",
                "json"]  # fmt: skip
        with open(path, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def events(self) -> list[dict]:
        text, decoder, out, i = self.path.read_text(), json.JSONDecoder(), [], 0
        while i < len(text):
            if text[i].isspace():
                i += 1
                continue
            event, i = decoder.raw_decode(text, i)
            out.append(event)
        return out

    def uids(self) -> dict[str, set[str]]:
        """Each pod name -> every UID it was ever seen with."""
        seen: dict[str, set[str]] = {}
        for e in self.events():
            meta = e["object"]["metadata"]
            seen.setdefault(meta["name"], set()).add(meta["uid"])
        return seen

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(hangs.FLOOR)


def gangs(plane: Plane, names: list[str]) -> dict[str, list[dict]]:
    """The pods of the jobs ``names``, by job."""
    pods = plane.get("pods", namespace=NAMESPACE) or []
    out: dict[str, list[dict]] = {}
    for p in pods:
        job = p["metadata"]["labels"]["ftjob.dev/job-name"]
        if job in names:
            out.setdefault(job, []).append(p)
    return out


def finish(plane: Plane, pod: str) -> None:
    """The trainer container exits 0, as a kubelet writes it: the pod's status subresource."""
    term = {"exitCode": 0, "reason": "Completed", "startedAt": None, "finishedAt": None}
    container = {"name": "trainer", "ready": False, "restartCount": 0, "image": "trainer:test",
                 "imageID": "sha256:0", "state": {"terminated": term}}  # fmt: skip
    patch = {"status": {"phase": "Succeeded", "containerStatuses": [container]}}
    plane.kubectl("patch", "pod", pod, "-n", NAMESPACE, "--subresource=status",
                  "--type=merge", "-p", json.dumps(patch))  # fmt: skip


def test_the_standby_replica_takes_over_a_burst_without_a_second_gang(replicas, tmp_path):
    """SIGKILL (a node lost under the acting replica): the standby waits out the acting
    one's keep-alive (the peering lifetime) and then acts. The order of a rolling update,
    made certain by explicit priorities (the chart's are random): the old replica acts
    alone, then pauses for a new one of higher priority, which is killed. The old one's
    watches are then behind: it must not act on what they last said."""
    replicas.start("replica-a", "--priority", "1")
    assert replicas.acting() == "replica-a"
    replicas.start("replica-b", "--priority", "2")
    # Each keep-alive carries the chart's lifetime (the operator hands it to kopf).
    assert replicas.acting() == "replica-b"
    assert {p["lifetime"] for p in replicas.peers().values()} == {LIFETIME}
    names = [f"burst-{i:02d}" for i in range(JOBS)]
    complete = hand_over(replicas, tmp_path, names, Operator.kill)
    no_write_over_a_newer_status(replicas.plane, complete[0])


def test_a_drained_acting_replica_hands_over_at_once(replicas, tmp_path):
    """SIGTERM (what a node drain does to the acting replica's pod): kopf removes its
    keep-alive as it exits, so the other acts without waiting out the lifetime. Also carries
    what tests/emulator/test_resilience.py::test_two_replicas_peer_and_only_the_leader_acts
    showed: the standby decides nothing while the acting replica lives, resumes once it has
    gone, and then acts on the jobs' pods."""
    for pod in ("replica-c", "replica-d")[: 2 - len(replicas.running)]:
        replicas.start(pod)
    hand_over(replicas, tmp_path, [f"drain-{i:02d}" for i in range(JOBS // 2)], Operator.stop)


def hand_over(replicas: Replicas, tmp_path: Path, names: list[str], end) -> list[str]:
    """The jobs ``names`` applied in two halves, the acting replica ended by ``end`` between
    them, three finished gangs' pods changed while none acts; then every job has one gang
    and a status that says what its pods say, and only the acting replica ever decided.
    Returns the three finished jobs' names."""
    plane, acting = replicas.plane, replicas.acting()
    [standby] = [pod for pod in replicas.running if pod != acting]
    watch = PodLog(plane, tmp_path / "pods.json")
    try:
        apply_jobs(plane, names[: len(names) // 2])
        # Mid-burst: some gangs made, others not yet (the rest of the burst comes after).
        plane.wait(lambda: len(gangs(plane, names)) >= 5, hangs.FLOOR, "the first gangs")
        # What the standby decided while the acting replica lived (its log: one line each).
        meddled = [x for x in replicas.running[standby].log.read_text().splitlines()
                   if "ftjob.operator:" in x and any(f"/{n}:" in x for n in names)]  # fmt: skip
        end(replicas.running.pop(acting))
        ended = time.monotonic()
        before = {p["metadata"]["name"]: p["metadata"]["uid"]
                  for pods in gangs(plane, names).values() for p in pods}  # fmt: skip
        apply_jobs(plane, names[len(names) // 2 :])
        # While no replica acts: three whole gangs exit 0 (the pods' status changes; with no
        # trainer's record naming a model, the job fails, not retried: no budget spent).
        complete = sorted(n for n, pods in gangs(plane, names).items() if len(pods) == 2)[:3]
        for name in complete:
            for rank in (0, 1):
                finish(plane, f"{name}-node-{rank}")
        every = converged(plane, names, complete, hangs.after(LIFETIME))
        took, uids = time.monotonic() - ended, watch.uids()
    finally:
        watch.close()
    # Status writes refused for a job that moved on (kube.Conflict), then decided again.
    said = replicas.running[standby].log.read_text()
    refused = sum(said.count(f"{NAMESPACE}/{n} changed after resourceVersion") for n in names)
    print(f"hand-over: {acting} ended, {standby} converged {len(names)} jobs in {took:.0f} s "
          f"({refused} status writes refused as stale, each decided again)")  # fmt: skip
    assert replicas.acting() == standby
    assert not meddled, meddled[:5]  # two acting replicas both decide (and create) every job
    # No pod name was ever created twice, and every pod there at the end is the same pod.
    assert all(len(u) == 1 for u in uids.values()), {n: u for n, u in uids.items() if len(u) > 1}
    assert all(uids[name] == {uid} for name, uid in before.items())
    for name in names:
        status, pods = every[name]
        assert {p["metadata"]["labels"]["ftjob.dev/attempt"] for p in pods} == {"0"}, name
        assert status.get("attempt", 0) == 0 and status.get("restarts", 0) == 0, (name, status)
    for name in complete:
        assert "every node exited 0" in every[name][0]["failure"]["message"], every[name]
    # The survivor says it resumed (kopf's peering log).
    assert acts(replicas.running[standby])
    return complete


def no_write_over_a_newer_status(plane: Plane, name: str) -> None:
    """The operator's status write (kube.Kube.patch_status, as a replica that peering is
    pausing sends it) against the real apiserver: carrying the resourceVersion it read, it
    lands; carrying one the job has since left, it is refused with Conflict (409) and the
    newer status stays; for another object of the name it is Gone (422), never confused with
    a Conflict. A finished job, so the acting replica's own looks change no failure message."""
    from kubernetes import config

    from ftjob.operator.kube import Conflict, Gone, Kube

    kube = Kube(config.new_client_from_config(config_file=str(plane.kubeconfig)))
    job = plane.get("ftj", name, NAMESPACE)
    read, uid, status = job["metadata"]["resourceVersion"], job["metadata"]["uid"], job["status"]

    def saying(mark: str) -> dict:
        failure = {**status["failure"], "message": f"{status['failure']['message']} [{mark}]"}
        return {**status, "failure": failure}

    newer = kube.patch_status(NAMESPACE, name, uid, read, saying("newer"))
    assert newer["metadata"]["resourceVersion"] != read
    with pytest.raises(Conflict):  # a replica that read the job before the newer write
        kube.patch_status(NAMESPACE, name, uid, read, saying("stale"))
    with pytest.raises(Gone):
        kube.patch_status(NAMESPACE, name, "another-uid", newer["metadata"]["resourceVersion"],
                          saying("gone"))  # fmt: skip
    kept = plane.get("ftj", name, NAMESPACE)["status"]["failure"]["message"]
    assert kept.endswith("[newer]"), kept


def converged(plane: Plane, names: list[str], complete: list[str], timeout: float) -> dict:
    """Every job's status says what its pods say: one gang of 2 pods, Running, or for
    ``complete`` Succeeded pods and a Failed job (exit 0 with no record of a model); returns
    {job: (status, pods)}. A second attempt fails it at once."""
    behind: list[str] = []

    def check():
        pods = gangs(plane, names)
        jobs = {j["metadata"]["name"]: j for j in plane.get("ftj", namespace=NAMESPACE) or []}
        out, behind[:] = {}, []
        for name in names:
            status = (jobs.get(name) or {}).get("status") or {}
            assert not status.get("attempt") and not status.get("restarts"), (name, status)
            want, pods_want = ("Failed", "Succeeded") if name in complete else ("Running",) * 2
            phases = [p["status"].get("phase") for p in pods.get(name, [])]
            if status.get("phase") != want or phases != [pods_want] * 2:
                behind.append(f"{name}: {status.get('phase')}, pods {phases}")
            out[name] = (status, pods.get(name, []))
        return not behind and out

    try:
        return plane.wait(check, timeout, f"all {len(names)} jobs to say what their pods say")
    except AssertionError as e:
        raise AssertionError(f"{e}; not yet: {behind[:10]}") from None
