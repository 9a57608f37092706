"""Kueue on the session's real control plane (``scripts/k8s.sh up DIR --kueue``: every
tests/cluster module that asks for ``plane`` shares it), ftjob installed from
manifests/install.yaml and its operator running as the chart's ServiceAccount, and a team's
namespace set up as docs/install.md's "Queues with Kueue" says."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import hangs
import yaml
from plane import KUBECTL, ROOT, Plane, shared_volume, token_kubeconfig

from ftjob.api import manifest

TEAM = "team-a"
GPU_PRODUCT = "NVIDIA-A100-SXM4-80GB"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]


class Operator:
    """``ftjob operator`` as a process, authenticated as the chart's ServiceAccount."""

    def __init__(self, plane: Plane, log: Path):
        self.plane, self.log = plane, log
        self.health = _free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> Operator:
        path = self.plane.dir / "ftjob.kubeconfig"
        kubeconfig = token_kubeconfig(self.plane, "ftjob-system", "ftjob", path)
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), FTJOB_RESYNC_SECONDS="1")
        argv = [sys.executable, "-m", "ftjob", "operator", "--all-namespaces", "--standalone"]
        argv += ["--liveness", f"http://127.0.0.1:{self.health}/healthz"]
        argv += ["--metrics-port", str(_free_port())]
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.plane.wait(self.healthy, 60, "the operator's liveness endpoint")
        return self

    def healthy(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.health}/healthz"
            with urllib.request.urlopen(url, timeout=1) as r:  # not a hang guard: one try of a poll
                return r.status == 200
        except OSError:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(hangs.FLOOR)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(hangs.FLOOR)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def docs_kueue_yaml() -> str:
    """The first yaml block of docs/install.md's "Queues with Kueue" section (the objects a
    platform team applies); the second is Kueue's Configuration."""
    text = (ROOT / "docs" / "install.md").read_text()
    section = text.split("## Queues with Kueue", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)[0]


def docs_kueue_topology_yaml() -> str:
    """The third block: a Topology of racks and the queue whose flavor names it."""
    text = (ROOT / "docs" / "install.md").read_text()
    section = text.split("## Queues with Kueue", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)[2]


def docs_kueue_configuration() -> dict:
    text = (ROOT / "docs" / "install.md").read_text()
    section = text.split("## Queues with Kueue", 1)[1].split("\n## ", 1)[0]
    return yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)[1])


def setup_team(plane: Plane) -> None:
    """What a platform team has before its users submit jobs: the team's namespace, GPU nodes
    labelled with their product (as GPU feature discovery labels them), a shared volume for
    checkpoints (a PersistentVolume bound to the claim the jobs name) and the docs' queues."""
    plane.kubectl("create", "namespace", TEAM)
    plane.kubectl("label", "node", "--all", f"nvidia.com/gpu.product={GPU_PRODUCT}")
    plane.apply(shared_volume(TEAM))  # the claim examples/tiny.yaml names
    plane.kubectl("apply", "-f", "-", input=docs_kueue_yaml())


def gpu_job(name: str, queue: str = "research", **spec_changes) -> dict:
    """examples/tiny.yaml on 2 nodes of 8 GPUs, on the LocalQueue ``queue``."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": TEAM}
    doc["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 8}
    doc["spec"]["scheduling"] = {"queue": queue}
    for key, value in spec_changes.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    return doc


class PodWatch:
    """Every version of a job's pods, in order, from a watch started before the job: what was
    true of each pod at each change, not only at the end."""

    def __init__(self, plane: Plane, job: str, path: Path):
        self.path = path
        env = dict(os.environ, KUBECONFIG=str(plane.kubeconfig))
        argv = [
            KUBECTL,
            "get",
            "pods",
            "-n",
            TEAM,
            "-l",
            f"ftjob.dev/job-name={job}",
            "-w",
            "--output-watch-events",
            "-o",
            "json",
        ]
        with open(path, "w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        time.sleep(1)  # the watch is established before the job exists

    def versions(self) -> list[dict]:
        """The pods as the watch delivered them (ADDED, MODIFIED, DELETED), oldest first."""
        text, decoder, out, i = self.path.read_text(), json.JSONDecoder(), [], 0
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            if i >= len(text):
                return out
            event, i = decoder.raw_decode(text, i)
            out.append(event["object"])

    def stop(self) -> list[dict]:
        self.proc.terminate()
        self.proc.wait(hangs.FLOOR)
        return self.versions()


def gates(pod: dict) -> list[str]:
    return [g["name"] for g in pod["spec"].get("schedulingGates") or []]


def job_pods(plane: Plane, job: str) -> list[dict]:
    pods = plane.get("pods", namespace=TEAM, ok=False) or []
    return [p for p in pods if p["metadata"]["labels"].get("ftjob.dev/job-name") == job]


def workload(plane: Plane, name: str) -> dict | None:
    return plane.get("workloads.kueue.x-k8s.io", name, TEAM, ok=False)


def condition(obj: dict | None, kind: str) -> dict:
    return next(
        (c for c in (obj or {}).get("status", {}).get("conditions", []) if c["type"] == kind), {}
    )


def admitted(plane: Plane, name: str) -> dict | None:
    w = workload(plane, name)
    return w if condition(w, "Admitted").get("status") == "True" else None


def placed(plane: Plane, job: str, attempt: int = 0, nodes: int = 2) -> list[dict]:
    """The job's pods of ``attempt`` once all ``nodes`` of them are ungated and on a node."""
    pods = [
        p
        for p in job_pods(plane, job)
        if p["metadata"]["labels"]["ftjob.dev/attempt"] == str(attempt)
    ]
    ok = len(pods) == nodes and all(p["spec"].get("nodeName") and not gates(p) for p in pods)
    return pods if ok else []


def delete_job(plane: Plane, job: str) -> None:
    """Delete the job and wait until nothing of it is left: pods (Kueue's finalizers released),
    Workloads, the ConfigMap and Service."""
    plane.kubectl("delete", "ftj", job, "-n", TEAM, "--ignore-not-found", "--wait=false")
    try:
        plane.wait(lambda: not leftovers(plane, job), 60, f"nothing left of {job}")
    except AssertionError as e:
        state = [
            (
                p["metadata"]["name"],
                p["metadata"].get("finalizers"),
                p["status"].get("phase"),
                p["metadata"].get("deletionTimestamp"),
            )
            for p in job_pods(plane, job)
        ]
        raise AssertionError(f"{e}: {leftovers(plane, job)} {state}") from None


def leftovers(plane: Plane, job: str) -> list[str]:
    out = [f"pod/{p['metadata']['name']}" for p in job_pods(plane, job)]
    out += [
        f"workload/{w['metadata']['name']}"
        for w in plane.get("workloads.kueue.x-k8s.io", namespace=TEAM) or []
        if w["metadata"]["name"].startswith(f"{job}-a")
    ]
    for kind, name in (("configmap", f"{job}-spec"), ("service", job), ("ftj", job)):
        if plane.get(kind, name, TEAM, ok=False):
            out.append(f"{kind}/{name}")
    return out
