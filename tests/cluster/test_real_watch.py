"""Server semantics the shared plane cannot show, on a plane of this module's own: a watch
that expires (a real 410 Gone) resumes, and a write made from a stale view of a job is
refused by the real apiserver and retried.

The plane runs kube-apiserver with ``--watch-cache=false`` (watches are served by etcd, so a
compaction expires a watch's resourceVersion at once; the watch cache would keep serving it
for minutes) and an audit log of every FineTuneJob request (who, what, the answer's code).
The operator reaches the apiserver through a TCP relay this module controls: it can cut the
operator's connections, or hold back what the server sends on them, without touching the
operator's process or the apiserver.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import hangs
import pytest
from plane import ROOT, Plane, build, token_kubeconfig
from test_real_operator import NAMESPACE, gang_running, gpu_job, status_of, terminate

sys.path.append(str(ROOT / "tests" / "emulator"))
from support import Operator  # noqa: E402  (the emulator tests' launcher, reused)

pytestmark = pytest.mark.timeout(300)
OPERATOR = "system:serviceaccount:ftjob-system:ftjob"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "resources": [{"group": "ftjob.dev", "resources": ["*"]}]},
        {
            "level": "Metadata",
            "verbs": ["list"],
            "resources": [{"group": "", "resources": ["pods"]}],
        },
        {"level": "None"},
    ],
}


class Relay:
    """A TCP relay on 127.0.0.1 to ``upstream`` (TLS passes through untouched)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[tuple[socket.socket, socket.socket]] = []
        self.held: set[socket.socket] = set()  # clients the server's bytes are held back from
        self.down = 0  # bytes relayed from the server to the operator
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.conns.append((client, server))
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, client: socket.socket | None):
        try:
            while data := src.recv(65536):
                while client is not None and client in self.held:
                    time.sleep(0.01)  # not a hang guard: release() ends it
                dst.sendall(data)
                if client is not None:
                    self.down += len(data)
        except OSError:
            pass
        for s in (src, dst):
            with _quiet():
                s.shutdown(socket.SHUT_RDWR)

    def cut(self):
        """Close every connection open now, both ways (as a dropped network does)."""
        with self.lock:
            conns, self.conns = self.conns, []
        for pair in conns:
            for s in pair:
                with _quiet():
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def hold(self):
        """Hold back what the server sends on every connection open now."""
        with self.lock:
            self.held = {client for client, _ in self.conns}

    def release(self):
        self.held = set()

    def close(self):
        self.listener.close()
        self.cut()


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """This module's plane, the chart installed, the operator (with only the chart's token)
    behind a relay; yields (plane, operator, relay, audit log path, etcd URL)."""
    build()
    work = tmp_path_factory.mktemp("watchplane")
    policy, audit = work / "audit-policy.json", work / "audit.log"
    policy.write_text(json.dumps(AUDIT_POLICY))
    args = ["--watch-cache=false", f"--audit-policy-file={policy}", f"--audit-log-path={audit}"]
    plane = Plane(work / "k8s", *[x for a in args for x in ("--apiserver-arg", a)]).up()
    op = relay = None
    try:
        plane.install()
        plane.namespace(NAMESPACE)
        kubeconfig = token_kubeconfig(plane, "ftjob-system", "ftjob", work / "sa.kubeconfig")
        config = json.loads(kubeconfig.read_text())
        server = config["clusters"][0]["cluster"]["server"]
        relay = Relay(("127.0.0.1", int(server.rsplit(":", 1)[1])))
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
        kubeconfig.write_text(json.dumps(config))
        # --verbose: kopf's debug lines say when it restarts a watch or defers a patch.
        target = SimpleNamespace(kubeconfig=kubeconfig, wait=Plane.wait)
        op = Operator(target, work / "operator.log", "--verbose").start()
        yield plane, op, relay, audit, etcd_url(plane)
    finally:
        if op:
            os.kill(op.proc.pid, signal.SIGCONT)
            op.stop()
        if relay:
            relay.close()
        plane.down()


def etcd_url(plane: Plane) -> str:
    """The etcd the plane's apiserver was started with (its command line)."""
    pids = dict(line.split() for line in (plane.dir / "pids").read_text().splitlines())
    argv = Path(f"/proc/{pids['kube-apiserver']}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--etcd-servers") + 1].decode()


def etcd(url: str, method: str, body: dict) -> dict:
    """One call of etcd's v3 JSON gateway (etcd serves it on its client URL)."""
    request = urllib.request.Request(f"{url}/v3/{method}", json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=hangs.FLOOR) as r:
        return json.loads(r.read())


def compact(url: str) -> int:
    """Compact etcd at its current revision: every older resourceVersion is gone."""
    key = base64.b64encode(b"/").decode()
    revision = int(etcd(url, "kv/range", {"key": key})["header"]["revision"])
    etcd(url, "kv/compaction", {"revision": revision, "physical": True})
    return revision


def audited(audit: Path, name: str) -> list[dict]:
    """The operator's completed requests on the job ``name`` (oldest first)."""
    events = [json.loads(line) for line in audit.read_text().splitlines() if line]
    return [
        e
        for e in events
        if e["stage"] == "ResponseComplete"
        and e["user"]["username"] == OPERATOR
        and e.get("objectRef", {}).get("name") == name
    ]


def asked(audit: Path, name: str) -> list[dict]:
    """The operator's first requests for the job ``name``: a write to it, or the read of its
    pods from the API server that comes before any gang is made (handlers._pods_from_the_api)."""
    events = [json.loads(line) for line in audit.read_text().splitlines() if line]
    selector = f"job-name%3D{name}"
    return [e for e in audited(audit, name) if e["verb"] == "patch"] + [
        e
        for e in events
        if e["stage"] == "ResponseComplete"
        and e["user"]["username"] == OPERATOR
        and e["verb"] == "list"
        and selector in e["requestURI"]
    ]


def frozen(op: Operator):
    """SIGSTOP the operator: it neither reads what arrives nor sends (SIGCONT resumes it)."""
    os.kill(op.proc.pid, signal.SIGSTOP)


def test_a_watch_that_expired_resumes_and_every_job_converges(own):
    """The trigger: the operator is frozen (SIGSTOP), the relay cuts its connections, then a
    job is created, another's pod fails, and etcd is compacted at its current revision. When
    the operator resumes, its watches reconnect from the resourceVersions they last saw, which
    are compacted: the apiserver answers 410 Gone ("too old resource version"), kopf logs
    that it restarts the watch-stream and lists afresh, and both jobs converge."""
    plane, op, relay, _, etcd_at = own
    plane.apply(gpu_job("early"))
    gang_running(plane, "early", 0)
    frozen(op)
    try:
        relay.cut()
        plane.apply(gpu_job("late"))
        terminate(plane, "early-node-1", 137, "OOMKilled")
        compact(etcd_at)
        assert not op.logged("Restarting the watch-stream")
    finally:
        os.kill(op.proc.pid, signal.SIGCONT)
    gang_running(plane, "late", 0)
    gang_running(plane, "early", 1)
    assert status_of(plane, "early")["failure"]["reason"] == "OOMKilled"
    plane.wait(lambda: status_of(plane, "late").get("phase") == "Running", 60, "late Running")
    log = op.log.read_text()
    assert "Restarting the watch-stream for finetunejobs" in log, log[-3000:]
    plane.kubectl("delete", "ftj", "--all", "-n", NAMESPACE, "--timeout=120s")


def test_a_write_from_a_stale_view_clobbers_nothing(own):
    """The trigger, deterministic: the operator is frozen while a job is created, so the job's
    ADDED event waits in its socket; the relay then holds back what the server sends it, and
    another client changes the job (a new resourceVersion the operator cannot see). Resumed,
    the operator acts on the stale copy: it asks the API server for the job's pods before it
    makes a gang (an answer the relay holds back too, so the test lets everything through once
    that request is seen; the reconcile already decided from the stale job). It writes only
    the status subresource (no handler needs kopf's finalizer, which was a
    resourceVersion-tested patch of the job itself that the server refused with 422 here), as
    a JSON patch that tests the UID and carries the resourceVersion the decision read: the
    server refuses the write from the stale copy (409), the operator then makes no gang from
    it, reads the job again and writes from the fresh copy (200), and the other client's
    change stays. The job converges with one gang."""
    plane, op, relay, audit, _ = own
    frozen(op)
    try:
        before = relay.down
        plane.apply(gpu_job("stale"))
        # The ADDED event reached the operator's socket: bytes came, then none for a while.
        hangs.poll(lambda: relay.down > before, 60, "the ADDED event relayed", every=0.1)
        settled = {"n": -1}

        def quiet():
            done, settled["n"] = relay.down == settled["n"], relay.down
            return done

        hangs.poll(quiet, 60, "the relay to go quiet", every=0.5)
        relay.hold()
        plane.kubectl("annotate", "ftj", "stale", "-n", NAMESPACE, "example.com/touched=1")
    finally:
        os.kill(op.proc.pid, signal.SIGCONT)
    try:
        hangs.poll(lambda: asked(audit, "stale"), 60, "the operator's first request for the job")
        time.sleep(1)  # not a hang guard: lets a write sent beside the first reach the log too
    finally:
        relay.release()
    gang_running(plane, "stale", 0)
    plane.wait(lambda: status_of(plane, "stale").get("phase") == "Running", 60, "stale Running")
    job = plane.get("ftj", "stale", NAMESPACE)
    assert "finalizers" not in job["metadata"]
    assert job["metadata"]["annotations"]["example.com/touched"] == "1"
    requests = [
        (e["verb"], e["objectRef"].get("subresource", ""), e["responseStatus"]["code"])
        for e in audited(audit, "stale")
    ]
    writes = [r[1:] for r in requests if r[0] == "patch"]
    # The stale decision's write refused, then only accepted writes from fresh copies: the
    # job read again first (handlers._read_again), not the watch's copy that lost.
    assert writes[0] == ("status", 409), writes
    assert len(writes) > 1 and all(w == ("status", 200) for w in writes[1:]), writes
    refused = requests.index(("patch", "status", 409))
    assert requests[refused + 1 : refused + 3] == [("get", "", 200), ("patch", "status", 200)]
