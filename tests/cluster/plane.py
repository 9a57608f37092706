"""A real control plane for the cluster tests: scripts/k8s.sh's etcd, kube-apiserver,
controller-manager, scheduler and kwok, driven by kubectl."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import envs
import hangs
import prebuilds

from ftjob.api import manifest
from ftjob.operator import render

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "manifests" / "install.yaml"
CRDS = ("finetunejobs.ftjob.dev", "finetuneprofiles.ftjob.dev")
SHARED = "/srv/ftjob-shared"  # the shared volume's host folder, where no test names one
K8S_SH = ROOT / "scripts" / "k8s.sh"
KUBECTL = prebuilds.KUBECTL


def build() -> None:
    """The plane's and Kueue's binaries, built (or found cached) by the session's prebuild
    (tests/prebuilds.py), started at collection. Where they cannot be built, CI fails (a skip
    there would hide the missing component); a developer without Go gets a skip."""
    if not shutil.which("go"):
        envs.unavailable("the control plane cannot be built: go is not installed")
    code, out, err = prebuilds.PLANE.result()
    if code:
        argv = " ".join(prebuilds.PLANE.argv[1:])
        envs.unavailable(f"the control plane cannot be built: {argv} failed (exit {code}):\n"
                         + (out + err)[-3000:])  # fmt: skip


class Plane:
    """``scripts/k8s.sh up DIR``'s plane: admin kubectl, objects as dicts, waiting."""

    def __init__(self, workdir: Path, *options: str):
        self.dir = workdir
        self.options = options  # of `up`: --kueue, --gpu-nodes N
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.cache = workdir / "kubecache"
        self.running = False

    def up(self) -> Plane:
        assert KUBECTL, "kubectl is not installed: pip install -e '.[test]'"
        env = dict(os.environ, KUBECTL=KUBECTL)
        argv = ["bash", str(K8S_SH), "up", str(self.dir), *self.options]
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        self.running = True
        return self

    def install(self) -> Plane:
        """manifests/install.yaml (the chart as the real Helm engine renders it, kept equal by
        scripts/manifests.py --check) applied server-side, and waited for until a job is
        admitted: the CRDs Established (both: a group's discovery changes again when its
        second kind is served), then the profiles' ValidatingAdmissionPolicy, which refuses
        every job ("failed to find resource referenced by paramKind") for seconds after its
        FineTuneProfile CRD is Established, until the API server's view of the kind catches
        up. A user who applies a job right after installing sees the same (docs/platform.md)."""
        self.kubectl("apply", "--server-side", "-f", str(INSTALL))
        crds = [f"crd/{name}" for name in CRDS]
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
        probe = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
        probe["metadata"] = {"name": "admission-probe", "namespace": "default"}
        self.wait(
            lambda: self.apply(probe, "--dry-run=server", ok=False).returncode == 0,
            hangs.FLOOR,
            "a job admitted (the profiles' admission policy ready)",
        )
        return self

    def namespace(self, name: str, *labels: str, volume: str | None = SHARED) -> None:
        """A namespace for jobs: created (with ``labels``, k=v), its default ServiceAccount
        waited for (pods need it: the real ServiceAccount controller makes it), and, unless
        ``volume`` is None, the shared claim over that host folder (:func:`shared_volume`)."""
        self.kubectl("create", "namespace", name)
        if labels:
            self.kubectl("label", "namespace", name, *labels)
        self.wait(lambda: self.get("sa", "default", name), hangs.FLOOR, f"{name}'s default SA")
        if volume is not None:
            self.apply(shared_volume(name, volume))

    def example_volume(self, namespace: str, shared: Path) -> Path:
        """A namespace whose shared claim is the host folder ``shared`` holding the example's
        model and data, writable by the pods' user (a kubelet applies no fsGroup to a
        hostPath volume): what the real nodes mount."""
        import sys

        sys.path.append(str(ROOT / "tests" / "images"))
        from podrun import fs_group

        from ftjob.operator import render

        shutil.copytree(ROOT / "examples" / "tiny-model", shared / "tiny-model")
        shutil.copytree(ROOT / "examples" / "data", shared / "data")
        fs_group(shared, render.RUN_AS)
        self.namespace(namespace, volume=str(shared))
        return shared

    def down(self) -> None:
        """Once: a test that checks what `down` leaves (test_real_nodes.py) takes a shared
        plane down before the session's teardown would."""
        if self.running:
            subprocess.run(["bash", str(K8S_SH), "down", str(self.dir)], check=True)
            self.running = False

    def kubectl(self, *args: str, ok: bool = True, input: str | None = None, kubeconfig=None):
        env = dict(os.environ, KUBECONFIG=str(kubeconfig or self.kubeconfig))
        env["KUBECACHEDIR"] = str(self.cache)
        result = subprocess.run(
            [KUBECTL, *args], capture_output=True, text=True, env=env, input=input, timeout=120
        )
        if ok:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    def get(self, kind: str, name: str = "", namespace: str = "default", **kw) -> dict | None:
        """One object (None when absent), or with no name the list's items."""
        result = self.kubectl(
            "get",
            kind,
            *([name] if name else []),
            "-n",
            namespace,
            "-o",
            "json",
            "--ignore-not-found",
            **kw,
        )
        if not result.stdout.strip():
            return None
        out = json.loads(result.stdout)
        return out if name else out["items"]

    def job_pods(self, name: str, namespace: str) -> list[dict]:
        """The pods of FineTuneJob ``name`` (its job-name label), every attempt's."""
        pods = self.get("pods", namespace=namespace, ok=False) or []
        return [p for p in pods if p["metadata"]["labels"].get(render.LABEL_JOB) == name]

    def job_status(self, name: str, namespace: str) -> dict:
        return (self.get("ftj", name, namespace) or {}).get("status") or {}

    def events(self, name: str, reason: str, namespace: str) -> list[dict]:
        """The Events of object ``name`` with ``reason``."""
        found = json.loads(self.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
        return [e for e in found["items"]
                if e["involvedObject"].get("name") == name and e["reason"] == reason]  # fmt: skip

    def apply(self, doc: dict | str, *args: str, ok: bool = True):
        text = doc if isinstance(doc, str) else json.dumps(doc)
        return self.kubectl("apply", "-f", "-", *args, input=text, ok=ok)

    def describe(self, namespace: str) -> str:
        """What a wait that timed out shows: the namespace's pods and latest events, each
        node's conditions, and the free disk under the plane's folder (the real nodes' images
        and volumes live there)."""
        conditions = "CONDITION:.status.conditions[*].type,IS:.status.conditions[*].status"
        reads = [
            ("get", "pods", "-n", namespace, "-o", "wide"),
            ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
            ("get", "nodes", "-o", f"custom-columns=NODE:.metadata.name,{conditions}"),
        ]
        parts = [self.kubectl(*read, ok=False).stdout[-3000:] for read in reads]
        df = subprocess.run(["df", "-h", str(self.dir)], capture_output=True, text=True)
        return "\n".join([*parts, df.stdout])

    def delete_every_job(self) -> None:
        """Every FineTuneJob deleted, and waited for until none of their pods is left."""
        self.kubectl("delete", "ftj", "--all", "-A", "--wait=false")

        def no_pods():
            found = self.kubectl("get", "pods", "-A", "-l", "ftjob.dev/job-name", "-o", "name")
            return not found.stdout.strip()

        self.wait(no_pods, hangs.FLOOR, "every job's pods to go")

    def stop(self, name: str) -> list[str]:
        """Stop one of the plane's processes (``kube-apiserver``, ``etcd``, ...) as k8s.sh
        down does (SIGTERM, SIGKILL after 10 s) and wait until it is gone; returns its
        command line, for start."""
        pid = self._pid(name)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        os.kill(pid, signal.SIGTERM)
        try:  # not a hang guard: k8s.sh down's grace before SIGKILL (a draining apiserver)
            hangs.poll(lambda: _ended(pid), 10, f"{name} ({pid}) to stop")
        except AssertionError:
            os.kill(pid, signal.SIGKILL)
            hangs.poll(lambda: _ended(pid), hangs.FLOOR, f"{name} ({pid}) to stop")
        return argv

    def start(self, name: str, argv: list[str]) -> None:
        """Start a stopped process again as k8s.sh does (its own session, its log appended,
        its pid recorded for down), and wait until the API server is ready again."""
        with open(self.dir / "logs" / f"{name}.log", "a") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        with open(self.dir / "pids", "a") as pids:
            pids.write(f"{name} {proc.pid}\n")
        self.wait(lambda: self.kubectl("get", "--raw=/readyz", ok=False).returncode == 0,
                  hangs.FLOOR, f"the API server to be ready after {name} started")  # fmt: skip

    def _pid(self, name: str) -> int:
        """The latest pid k8s.sh (or start) recorded for ``name``."""
        found = [line.split() for line in (self.dir / "pids").read_text().splitlines()]
        return int([pid for n, pid in found if n == name][-1])

    # The emulator tests' Operator helper calls cluster.wait.
    @staticmethod
    def wait(predicate, timeout: float = hangs.FLOOR, what: str = "condition"):
        """Poll ``predicate()`` (an API read: every 0.2 s) until it returns something truthy."""
        return hangs.poll(predicate, timeout, what, every=0.2)


def _ended(pid: int) -> bool:
    """Gone, or a zombie (its parent, if it is this process, reaps it later)."""
    try:
        return not Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return True


def token_kubeconfig(plane: Plane, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig holding only ``account``'s token (TokenRequest, as a pod would get it)."""
    token = plane.kubectl(
        "create", "token", account, "-n", namespace, "--duration=2h"
    ).stdout.strip()
    admin = json.loads(plane.kubectl("config", "view", "--raw", "-o", "json").stdout)
    cluster = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "plane", "cluster": cluster}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "plane", "user": account}}],
        "current-context": "sa",
    }
    path.write_text(json.dumps(config))
    return path


def shared_volume(namespace: str, path: str = SHARED) -> str:
    """The ReadWriteMany claim examples/tiny.yaml names, bound to a PersistentVolume up
    front: the real scheduler does not place a pod whose claim is missing or unbound.
    ``path``: the host folder behind it (what a real node mounts; kwok's pods never do)."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"ftjob-shared-{namespace}"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "manual",
            "hostPath": {"path": path},
            "claimRef": {"namespace": namespace, "name": "ftjob-shared"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "ftjob-shared", "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "manual",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]})
