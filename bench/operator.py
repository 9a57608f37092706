"""Suite d: the real `ftjob operator` process against tests/emulator's API server (kmock) and
its test kubelet, all on 127.0.0.1:

* apply -> pods: `kubectl apply` of a 16-node job until all 16 pods exist (and run);
* API requests per job lifecycle (create -> Running -> Succeeded -> deleted), counted by a
  subclass of the emulator that tallies every HTTP request it serves;
* the same 16-node apply on the real control plane (scripts/k8s.sh: kube-apiserver, the real
  scheduler, kwok's 16 GPU nodes): until all 16 pods are bound to a node, then Running;
* N concurrent jobs (2 nodes each): wall time until every job is Running with its pods, and
  the operator's RSS before and after, each N against a fresh cluster and operator.
"""

from __future__ import annotations

import collections
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

from bench import common
from bench.report import row

EMULATOR = common.ROOT / "tests" / "emulator"
for _dir in (EMULATOR, common.ROOT / "tests"):  # cluster.py imports tests/hangs.py
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))  # cluster.py / support.py import each other by name

from apiserver import ApiServer  # noqa: E402
from cluster import Cluster, Kubelet  # noqa: E402
from support import free_port, job_status, tiny_job  # noqa: E402

JOBS = "finetunejobs"


def request_key(method: str, path: str, watch: bool) -> str:
    """'VERB plural[/subresource]' of one API request; discovery paths count as 'discovery'."""
    parts = [p for p in path.strip("/").split("/") if p]
    if not parts or parts[0] not in ("api", "apis"):
        return f"{method} other"
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]
    if not rest:
        return f"{method} discovery"
    what = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    return f"{'WATCH' if watch else method} {what}"


class CountingApiServer(ApiServer):
    """The emulator, counting requests (attrs slots: the tally lives on the class)."""

    tally: collections.Counter = collections.Counter()

    async def __call__(self, raw_request):
        watch = raw_request.query.get("watch") in ("true", "1")
        key = request_key(raw_request.method, raw_request.path, watch)
        CountingApiServer.tally[key] += 1
        response = await super().__call__(raw_request)
        if response.status >= 400:  # e.g. 409: a create the operator repeated
            CountingApiServer.tally[f"{key} -> {response.status}"] += 1
        return response


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (where the operator's wall time goes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """This process's CPU time: the emulator and its kubelet run in a thread of it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Env:
    """A fresh emulator + kubelet + `ftjob operator` (the product's resync settings)."""

    def __init__(self, work: Path):
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        self.cluster = Cluster(work)
        self.cluster.api = CountingApiServer()
        self.cluster.kubelet = Kubelet(self.cluster.api)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Env:
        self.cluster.__enter__()
        health = free_port()
        env = dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig))
        argv = [sys.executable, "-m", "ftjob", "operator", "--all-namespaces", "--standalone",
                "--liveness", f"http://127.0.0.1:{health}/healthz"]  # fmt: skip
        self.log = open(self.work / "operator.log", "a")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.cluster.wait(lambda: self._healthy(health), 60, "the operator's liveness endpoint")
        time.sleep(1.0)  # let the initial lists and watches settle before measuring
        return self

    def _healthy(self, port: int) -> bool:
        import urllib.request

        assert self.proc.poll() is None, (self.work / "operator.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()
        self.cluster.__exit__(*exc)

    def count(self, plural: str, pred=lambda o: True) -> int:
        api = self.cluster.api
        return self.cluster.call(lambda: sum(1 for o in api.objects(plural) if pred(o)))


def running(o: dict) -> bool:
    return o.get("status", {}).get("phase") == "Running"


def apply_to_pods(env: Env, nodes: int = 16) -> dict:
    doc = tiny_job("wide", resources={"nodes": nodes})
    path = env.work / "wide.yaml"
    path.write_text(yaml.safe_dump(doc))
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or "kubectl"
    kenv = dict(os.environ, KUBECONFIG=str(env.cluster.kubeconfig),
                KUBECACHEDIR=str(env.work / "kubecache"))  # fmt: skip
    # A warm discovery cache, as on a user's machine after the first command.
    subprocess.run([kubectl, "get", JOBS], env=kenv, capture_output=True, check=True)
    mine = lambda o: o["metadata"]["labels"].get("ftjob.dev/job-name") == "wide"  # noqa: E731
    start = time.monotonic()
    subprocess.run([kubectl, "apply", "--validate=false", "-f", str(path)], env=kenv,
                   capture_output=True, check=True)  # fmt: skip
    applied = time.monotonic() - start
    env.cluster.wait(lambda: env.count("pods", mine) == nodes, 60, "16 pods")
    created = time.monotonic() - start
    env.cluster.wait(lambda: env.count("pods", lambda o: mine(o) and running(o)) == nodes, 60)
    ran = time.monotonic() - start
    return {"kubectlApply": applied, "podsCreated": created, "podsRunning": ran}


def real_plane_apply(work: Path, nodes: int = 16) -> dict:
    """`kubectl apply` of a 16-node GPU job -> every pod bound by the real scheduler to one of
    kwok's GPU nodes (and Running), `ftjob operator` with the admin kubeconfig."""
    if str(common.ROOT / "tests" / "cluster") not in sys.path:
        sys.path.insert(0, str(common.ROOT / "tests" / "cluster"))
    import copy

    from plane import Plane, shared_volume

    from ftjob.api import manifest

    plane = Plane(work / "k8s", "--gpu-nodes", str(nodes)).up()
    proc = None
    try:
        plane.kubectl("apply", "--server-side", "-f", str(common.ROOT / "manifests/install.yaml"))
        plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                      "crd/finetunejobs.ftjob.dev")  # fmt: skip
        plane.apply(shared_volume("default"))
        health = free_port()
        env = dict(os.environ, KUBECONFIG=str(plane.kubeconfig))
        argv = [sys.executable, "-m", "ftjob", "operator", "--all-namespaces", "--standalone",
                "--liveness", f"http://127.0.0.1:{health}/healthz"]  # fmt: skip
        log = open(work / "operator.log", "a")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        plane.wait(lambda: Env._healthy(SimpleNamespace(proc=proc, work=work), health), 60)
        time.sleep(1.0)  # let the initial lists and watches settle before measuring
        doc = copy.deepcopy(manifest.load(common.ROOT / "examples" / "tiny.yaml")[0])
        doc["metadata"] = {"name": "wide", "namespace": "default"}
        doc["spec"]["resources"] = {"nodes": nodes, "gpusPerNode": 8}
        plane.kubectl("get", JOBS)  # a warm discovery cache
        pods = lambda: plane.get("pods", ok=False) or []  # noqa: E731
        start = time.monotonic()
        plane.apply(doc)
        plane.wait(lambda: sum(1 for p in pods() if p["spec"].get("nodeName")) == nodes, 120)
        bound = time.monotonic() - start
        plane.wait(lambda: sum(1 for p in pods() if running(p)) == nodes, 120)
        ran = time.monotonic() - start
    finally:
        if proc:
            proc.terminate()
            proc.wait(20)
            log.close()
        plane.down()
    return {"podsBound": bound, "podsRunning": ran}


def lifecycle_requests(env: Env) -> dict:
    """Requests served from the job's creation to its deletion (operator only: the job is
    created and the pods are ended inside the emulator, as the API server and kubelet would)."""
    name, c = "life", env.cluster
    CountingApiServer.tally.clear()
    c.create_job(tiny_job(name))
    c.wait(lambda: env.count("pods", lambda o: o["metadata"]["name"].startswith(name) and
                             running(o)) == 2, 30, "2 running pods")  # fmt: skip
    c.wait(lambda: job_status(c, name).get("phase") == "Running", 30, "Running")
    c.terminate(f"{name}-node-1", 0)
    c.terminate(f"{name}-node-0", 0, message='{"exportPath": "/ftjob/life/model"}')
    c.wait(lambda: job_status(c, name).get("phase") == "Succeeded", 60, "Succeeded")
    key = next(k for k in c.api.store if k[2] == JOBS and k[4] == name)
    c.call(lambda: c.api.begin_delete(key))
    c.wait(lambda: c.get(JOBS, name) is None, 60, "the job to be gone")
    time.sleep(1.0)  # stragglers (finalizer removal, events)
    tally = dict(CountingApiServer.tally)
    watches = sum(v for k, v in tally.items() if k.startswith("WATCH"))
    errors = sum(v for k, v in tally.items() if " -> " in k)
    total = sum(tally.values()) - watches - errors
    return {"total": total, "watches": watches, "refused": errors, "byKind": tally}


def concurrent(work: Path, jobs: int, deadline: float) -> dict:
    with Env(work) as env:
        before = common.proc_mib(env.proc.pid, ("VmRSS", "VmHWM"))
        cpu0, own0 = cpu_seconds(env.proc.pid), own_cpu()
        start = time.monotonic()
        for i in range(jobs):
            env.cluster.create_job(tiny_job(f"c{i:04d}"))
        created = time.monotonic() - start
        done, pods = 0, 0
        while time.monotonic() - start < deadline:
            done, pods = env.count(JOBS, running), env.count("pods", running)
            if done == jobs and pods == 2 * jobs:
                break
            time.sleep(0.5)
        wall = time.monotonic() - start
        after = common.proc_mib(env.proc.pid, ("VmRSS", "VmHWM"))
        operator_cpu, emulator_cpu = cpu_seconds(env.proc.pid) - cpu0, own_cpu() - own0
    return {"jobs": jobs, "running": done, "podsRunning": pods, "wall": wall,
            "createSeconds": created, "complete": done == jobs and pods == 2 * jobs,
            "rssBeforeMiB": before["VmRSS"], "rssAfterMiB": after["VmRSS"],
            "peakMiB": after["VmHWM"], "operatorCpu": operator_cpu,
            "emulatorCpu": emulator_cpu}  # fmt: skip


def run(work: Path, quick: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="op-", dir=work))
    with Env(root / "single") as env:
        latency = apply_to_pods(env)
        requests = lifecycle_requests(env)
    real = real_plane_apply(root / "real")
    sizes = (20, 100) if quick else (100, 500)
    batches = [concurrent(root / f"n{n}", n, 120 if n <= 100 else 240) for n in sizes]
    rows = [
        row("kubectl apply -> all 16 pods created s (16-node job)", latency["podsCreated"],
            goal="<= 1 s", met=latency["podsCreated"] <= 1.0),
        row("kubectl apply -> all 16 pods running s (test kubelet ticks every 50 ms)",
            latency["podsRunning"]),
        row("real plane: kubectl apply -> all 16 pods bound to kwok GPU nodes s (16-node job)",
            real["podsBound"], goal="<= 5 s", met=real["podsBound"] <= 5.0),
        row("real plane: kubectl apply -> all 16 pods Running s (kwok)", real["podsRunning"]),
        row(f"API requests per job lifecycle, 2 nodes ({requests['refused']} of them refused; "
            "watch streams opened at start-up not counted)", requests["total"]),
    ]  # fmt: skip
    for b in batches:
        state = "all Running" if b["complete"] else f"{b['running']} Running at the deadline"
        grew = b["rssAfterMiB"] - b["rssBeforeMiB"]
        rows.append(row(f"{b['jobs']} concurrent jobs: wall s to Running ({state})", b["wall"]))
        rows.append(row(f"{b['jobs']} concurrent jobs: operator RSS MiB (before "
                        f"{b['rssBeforeMiB']:.0f}; {grew * 1024 / b['jobs']:.0f} KiB/job)",
                        b["rssAfterMiB"]))  # fmt: skip
    if len(batches) == 2:
        a, b = batches
        # Marginal memory of a job, between the two sizes (start-up and warm-up cancel out).
        slope = (b["rssAfterMiB"] - a["rssAfterMiB"]) * 1024 / (b["jobs"] - a["jobs"])
        rows.append(row(f"operator RSS per extra job KiB, {a['jobs']} -> {b['jobs']} jobs",
                        slope, goal="flat (~0 KiB/job)", met=slope < 10))  # fmt: skip
        rows.append(row(f"operator / emulator CPU s for {b['jobs']} jobs (2 cores shared)",
                        b["operatorCpu"], b["emulatorCpu"], "emulator + bench"))  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)
    out = {"latency": latency, "real": real, "requests": requests, "batches": batches}
    return {**out, "rows": rows}
