"""Helpers of the emulator tests: `ftjob operator` as a real process, jobs, waiting."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from cluster import Cluster
from hangs import FLOOR

from ftjob.api import manifest
from ftjob.trainer.report.progress import Progress

ROOT = Path(__file__).resolve().parents[2]
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_job(name: str, **spec_changes) -> dict:
    """examples/tiny.yaml renamed, with a fast collective timeout and ``spec_changes`` merged."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name}
    doc["spec"]["network"] = {"collectiveTimeoutSeconds": 30, "progressPort": free_port()}
    for key, value in spec_changes.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    return doc


class Operator:
    """``ftjob operator`` against the cluster's kubeconfig, with short resync periods."""

    def __init__(self, cluster: Cluster, log: Path, *extra: str, standalone: bool = True, env=None):
        self.cluster, self.log, self.extra = cluster, log, extra
        self.standalone, self.env = standalone, env or {}
        self.health, self.metrics = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> Operator:
        env = dict(
            os.environ,
            KUBECONFIG=str(self.cluster.kubeconfig),
            FTJOB_RESYNC_SECONDS="1",
            FTJOB_PROGRESS_SECONDS="0.2",
        )
        env.update(self.env)
        argv = [sys.executable, "-m", "ftjob", "operator"]
        if not any(a in ("-n", "--namespace") for a in self.extra):
            argv.append("--all-namespaces")
        argv += ["--standalone"] if self.standalone else []
        argv += ["--liveness", f"http://127.0.0.1:{self.health}/healthz"]
        argv += ["--metrics-port", str(self.metrics), *self.extra]
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.cluster.wait(self.healthy, FLOOR, "the operator's liveness endpoint")
        return self

    def healthy(self) -> bool:
        try:
            # not a hang guard: one try of a poll (cluster.wait)
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            return False

    def metric(self, name: str) -> float:
        line = next(x for x in self.get_metrics().splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    def logged(self, text: str) -> bool:
        return text in self.log.read_text()

    def get_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=FLOOR) as r:
            return r.read().decode()

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies under the operator."""
        self.proc.kill()
        self.proc.wait(FLOOR)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)  # not a hang guard: the grace before SIGKILL
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(FLOOR)


def job_status(cluster: Cluster, name: str) -> dict:
    return (cluster.get("finetunejobs", name) or {}).get("status") or {}


def wait_phase(cluster: Cluster, name: str, phase: str, timeout: float = FLOOR) -> dict:
    return cluster.wait(
        lambda: (s := job_status(cluster, name)).get("phase") == phase and s,
        timeout,
        f"{name} to be {phase} (now {job_status(cluster, name).get('phase')})",
    )


def job_pods(cluster: Cluster, name: str, namespace: str = "default") -> list[dict]:
    pods = cluster.list("pods", namespace)
    return [p for p in pods if p["metadata"]["labels"].get("ftjob.dev/job-name") == name]


def gang_running(cluster: Cluster, name: str, attempt: int, nodes: int = 2) -> list[dict]:
    """Wait until ``nodes`` pods of ``attempt`` run (and no others exist); return them."""

    def check():
        pods = job_pods(cluster, name)
        ok = len(pods) == nodes and all(
            p["metadata"]["labels"]["ftjob.dev/attempt"] == str(attempt)
            and p["status"].get("phase") == "Running"
            for p in pods
        )
        return ok and pods

    return cluster.wait(check, FLOOR, f"{nodes} running pods of {name} attempt {attempt}")


def events_of(cluster: Cluster, name: str) -> list[str]:
    return [
        e.get("reason")
        for e in cluster.list("events")
        if e.get("involvedObject", {}).get("name") == name
    ]


def rank0_progress(port: int, total: int) -> Progress:
    """Rank 0's real progress reporter (ftjob.trainer.report.progress) serving /progress on
    ``port``,
    as the trainer does; a test drives it with the calls train.py makes. close() it after."""
    report = Progress(Path(tempfile.mkdtemp()), True, total, 1, writes_files=False)
    report.serve(port)
    return report
