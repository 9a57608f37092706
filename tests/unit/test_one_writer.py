"""Two replicas, one writer (issue 71, item 6): a status write carries the resourceVersion its
decision read, a write over a job that moved on is refused with :class:`Conflict` (not
:class:`Gone`), and a reconcile that met one writes and creates nothing more from its stale
copy; its next look reads the job from the API server and decides from the write that won.

    python -m pytest tests/unit/test_one_writer.py -q

The real apiserver's side (409 for a stale resourceVersion, the newer status kept):
tests/cluster/test_real_handover.py; a stale write and its retry in the audit log:
tests/cluster/test_real_watch.py.
"""

from __future__ import annotations

import asyncio
import copy
import http.server
import json

import hangs
import kopf
import local_api
import pytest
from test_status import ROOT

from ftjob.api import manifest
from ftjob.operator import handlers, watched
from ftjob.operator.kube import Conflict, Gone

UID = "u-1"


@pytest.fixture
def server():
    """A server answering every PATCH with ``.code`` (and the job, on 200); ``.bodies``: the
    patches it was sent."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_PATCH(self):
            srv = self.server
            srv.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            job = {"metadata": {"uid": UID, "resourceVersion": "8"}}
            local_api.answer(
                self, srv.code, job if srv.code == 200 else {"kind": "Status", "code": srv.code}
            )

        def log_message(self, *args):
            pass

    with local_api.serving(Handler, bodies=[], code=200) as srv:
        yield srv


def test_a_status_write_is_conditional_on_what_was_read_and_a_conflict_is_not_gone(server):
    kube = local_api.kube_at(server)
    written = kube.patch_status("ns", "j", UID, "7", {"phase": "Running"})
    assert written["metadata"]["resourceVersion"] == "8"
    # The UID tested (422 if another object), the resourceVersion set: the apiserver's
    # precondition (409 if the job moved on), then the status.
    assert server.bodies[0] == [
        {"op": "test", "path": "/metadata/uid", "value": UID},
        {"op": "replace", "path": "/metadata/resourceVersion", "value": "7"},
        {"op": "add", "path": "/status", "value": {"phase": "Running"}},
    ]
    server.code = 409
    with pytest.raises(Conflict, match="changed after resourceVersion 7"):
        kube.patch_status("ns", "j", UID, "7", {"phase": "Running"})
    for code in (404, 422):
        server.code = code
        with pytest.raises(Gone):
            kube.patch_status("ns", "j", UID, "7", {"phase": "Running"})


class Api:
    """The API server's side of one job and its pods, as kube.Kube's callers see it: the job's
    resourceVersion moves on with every write, and a status write that carries another one is
    refused with Conflict, as kube-apiserver does (tests/cluster/test_real_handover.py)."""

    def __init__(self, job: dict):
        self.doc = copy.deepcopy(job)
        self.made: dict[str, dict] = {}  # pod name -> {pod, by: the replica}
        self.writes: list[tuple[str, str]] = []  # (who, resourceVersion written over)
        self.who = ""

    def patch_status(self, namespace, name, uid, version, status):
        meta = self.doc["metadata"]
        if version != meta["resourceVersion"]:
            raise Conflict(f"{namespace}/{name} changed after resourceVersion {version}")
        self.writes.append((self.who, version))
        meta["resourceVersion"] = str(int(version) + 1)
        self.doc["status"] = copy.deepcopy(status)
        return copy.deepcopy(self.doc)

    def job(self, namespace, name):
        return copy.deepcopy(self.doc)

    def job_uid(self, namespace, name):
        return self.doc["metadata"]["uid"]

    def workload(self, namespace, name):
        return None

    def serves_pod_groups(self):
        return False  # an API server before Kubernetes 1.37's PodGroup

    def pods_of(self, who: str) -> list[str]:
        return sorted(n for n, p in self.made.items() if p["by"] == who)

    def pods(self, namespace, job):
        return [copy.deepcopy(p["pod"]) for p in self.made.values()]

    def create(self, obj):
        if obj["kind"] != "Pod":
            return True
        name = obj["metadata"]["name"]
        if name in self.made:
            return False
        pod = copy.deepcopy(obj)
        pod["metadata"]["uid"], pod["status"] = f"pod-{len(self.made)}", {"phase": "Pending"}
        self.made[name] = {"pod": pod, "by": self.who}
        return True

    def delete(self, *args, **kwargs):
        raise AssertionError(f"{self.who} deleted {args}")


def job() -> dict:
    doc = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
    doc["metadata"] = {"name": "tiny", "namespace": "ns", "uid": UID, "resourceVersion": "1",
                       "generation": 1}  # fmt: skip
    return doc


def watch_of(doc: dict) -> watched.Watch:
    return watched.Watch(UID, "ns", "tiny", watched.pack(doc), 1)


def test_a_replica_that_lost_the_race_writes_and_creates_nothing_then_decides_from_the_winner(
    monkeypatch,
):
    """Replica b acts on the new job (status, then a gang); replica a, whose watch still holds
    the job as it was before, decides to make a gang too: its status write is refused, and it
    creates no pod and says no Event. Its next look reads the job from the API server, sees
    b's status and b's pods, and makes nothing."""
    api, said = Api(job()), []
    monkeypatch.setattr(handlers, "_kube", api)
    monkeypatch.setattr(kopf, "event", lambda ref, **e: said.append((api.who, e["reason"])))
    monkeypatch.setattr(kopf, "warn", lambda ref, **e: pytest.fail(e["message"]))
    views = handlers.Indexes(pods={}, profiles={}, namespaces={})  # nothing watched yet
    a, b = watch_of(api.doc), watch_of(api.doc)  # both replicas' watches brought rv 1

    def reconcile(replica, who):
        api.who = who
        looked = handlers._reconcile_logged(replica, views)
        return asyncio.run(asyncio.wait_for(looked, hangs.FLOOR))

    reconcile(b, "b")
    assert api.pods_of("b") == ["tiny-node-0", "tiny-node-1"] and api.writes == [("b", "1")]
    b_status, b_said = copy.deepcopy(api.doc["status"]), list(said)
    assert b_said

    # a: rv 1 is stale. Its decision (a gang for a job it sees without one) stops at the write.
    assert reconcile(a, "a") == handlers.CONFLICT_RETRY_SECONDS
    assert api.pods_of("a") == [] and said == b_said and api.writes == [("b", "1")]
    assert a.state.reread and a.state.written is None
    assert api.doc["status"] == b_status  # b's write stands

    # a's next look: the job from the API server (b's status), b's pods: nothing to make.
    reconcile(a, "a")
    assert not a.state.reread and a.doc()["status"] == b_status
    assert api.pods_of("a") == [] and said == b_said
    assert api.writes == [("b", "1"), ("a", "2")]  # over b's: the pods it now sees Pending
    assert api.doc["status"]["attempt"] == b_status["attempt"] == 0
    assert not api.doc["status"].get("restarts")


def test_our_own_writes_not_yet_back_from_the_watch_are_not_taken_for_another_writers(
    monkeypatch,
):
    """The watch lags behind our writes: the next write carries the resourceVersion our last
    write made (JobState.written), not the watch's, and a watch copy at a version one of our
    writes went over is older than our last write, so the decision reads what we wrote last.
    Neither is refused as stale; only a job that moved on past our last write is."""
    api = Api(job())
    monkeypatch.setattr(handlers, "_kube", api)
    watch = watch_of(api.doc)  # rv 1

    def write(status: dict) -> None:
        seen = handlers._observe(watch, {})
        asyncio.run(handlers._write_status("ns", "tiny", seen, watch.state, status))

    write({"phase": "Pending"})  # 1 -> 2
    write({"phase": "Running"})  # 2 -> 3, the watch still at 1
    assert api.writes == [("", "1"), ("", "2")]
    assert watch.state.written == (frozenset({"1", "2"}), {"phase": "Running"}, "3")
    first = copy.deepcopy(api.doc) | {"status": {"phase": "Pending"}}
    first["metadata"]["resourceVersion"] = "2"
    watch.packed = watched.pack(first)  # the watch brings our first write, not our second
    assert handlers._observe(watch, {}).old_status == {"phase": "Running"}
    write({"phase": "Running", "restarts": 0})  # 3 -> 4
    watch.packed = watched.pack(api.job("ns", "tiny"))  # the watch catches up: rv 4
    seen = handlers._observe(watch, {})
    assert watch.state.written is None and seen.old_status == {"phase": "Running", "restarts": 0}
    api.doc["metadata"]["resourceVersion"] = "5"  # another writer, unseen
    with pytest.raises(Conflict):
        write({"phase": "Failed"})
    assert api.writes == [("", "1"), ("", "2"), ("", "3")]
