"""Suite fleet: one `ftjob operator` and N FineTuneJobs on the real control plane (issue 55).

scripts/k8s.sh's plane (kube-apiserver, etcd, the real scheduler, kwok's GPU nodes: enough
for every gang at once), the chart installed, and the operator with only the chart's
ServiceAccount token, with its default settings. N jobs of mixed sizes (1-16 nodes, one GPU
per node) are created at once by 8 threads, and a watch of pods in this process records when
each pod appears and when it is bound. It records:

* apply -> gang created (every pod of the job exists) p50 / p99, and apply -> all pods bound;
* the operator's RSS at 0 jobs, once 100 gangs exist, and once all N do; per extra job;
* the operator's requests per second at rest (every gang bound, nothing changing), counted
  from the apiserver's audit log for the operator's user (apiserver_request_total has no
  user label), and as requests per job per 5 minutes;
* the time to resync after a restart: the operator SIGKILLed, every pod deleted, the
  operator started again -> every gang back and bound.

    python -m bench --suite fleet --jobs 1000      # the issue's size (default)
    python -m bench --suite fleet --jobs 200       # what a 2-core machine runs in minutes
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from bench import common
from bench.report import row

CLUSTER = common.ROOT / "tests" / "cluster"
for _dir in (CLUSTER, common.ROOT / "tests"):  # plane.py imports tests/hangs.py and friends
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

NAMESPACE = "default"
OPERATOR = "system:serviceaccount:ftjob-system:ftjob"
SIZES = (1, 1, 1, 2, 2, 4, 8, 16)  # nodes per job, cycled: mostly small, some wide (avg 4.4)
# The window requests at rest are counted over.
REST_SECONDS = float(os.environ.get("FTJOB_BENCH_REST_SECONDS", 120))
# A folder: run the operator under tracemalloc (bench/traced_operator.py) and say which lines
# hold the memory the jobs past the first 100 add. Its latencies are then not the suite's.
TRACE = os.environ.get("FTJOB_BENCH_TRACE")
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "Metadata", "users": [OPERATOR]}, {"level": "None"}],
}


class PodClock:
    """When each pod of the namespace was first seen, and first seen bound (a watch)."""

    def __init__(self, kubeconfig: Path):
        from kubernetes import client, config, watch

        self.api = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
        self.watch = watch.Watch()
        self.seen: dict[str, tuple[str, float]] = {}  # pod -> (job, time)
        self.bound: dict[str, float] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        # The server ends a watch now and then (and all of them when the plane goes down):
        # watch again; a pod seen before keeps its first times.
        while True:
            try:
                self._follow()
            except Exception:  # noqa: BLE001, S112 - a broken stream is watched again
                time.sleep(1)

    def _follow(self) -> None:
        stream = self.watch.stream(self.api.list_namespaced_pod, NAMESPACE,
                                   label_selector="ftjob.dev/job-name")  # fmt: skip
        for event in stream:
            pod, now = event["object"], time.monotonic()
            name, job = pod.metadata.name, pod.metadata.labels["ftjob.dev/job-name"]
            with self.lock:
                if event["type"] == "DELETED":
                    self.seen.pop(name, None)
                    self.bound.pop(name, None)
                    continue
                self.seen.setdefault(name, (job, now))
                if pod.spec.node_name:
                    self.bound.setdefault(name, now)

    def gangs(self) -> dict[str, list[float]]:
        """Each job's pods' first-seen times."""
        out: dict[str, list[float]] = {}
        with self.lock:
            for job, t in self.seen.values():
                out.setdefault(job, []).append(t)
        return out

    def forget(self) -> None:
        with self.lock:
            self.seen.clear()
            self.bound.clear()


def job_doc(i: int, nodes: int) -> dict:
    from ftjob.api import manifest

    doc = copy.deepcopy(manifest.load(common.EXAMPLES / "tiny.yaml")[0])
    doc["metadata"] = {"name": f"fleet-{i:05d}", "namespace": NAMESPACE}
    doc["spec"]["resources"] = {"nodes": nodes, "gpusPerNode": 1}
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> float:
    return common.proc_mib(pid, ("VmRSS",))["VmRSS"] * 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> str:
    """Who used the machine's cores in a window: CPU seconds each, the most first."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    return ", ".join(f"{n} {s:.0f}" for n, s in sorted(spent.items(), key=lambda x: -x[1]))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def audited_between(audit: Path, start: datetime, end: datetime) -> list[dict]:
    """The operator's requests received in [start, end) (audit events, ResponseComplete)."""
    out = []
    for line in audit.read_text().splitlines():
        event = json.loads(line)
        received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if start <= received < end:
            out.append(event)
    return out


class Fleet:
    """The plane, the operator and the clock of one run."""

    def __init__(self, work: Path, jobs: int):
        from plane import Plane

        self.work, self.jobs = work, jobs
        self.sizes = [SIZES[i % len(SIZES)] for i in range(jobs)]
        # Room for every gang at once: one GPU per pod, 8 per node, a gang's pods on nodes of
        # their own (its anti-affinity). Twice the GPUs: with less, the scheduler's spreading
        # left a late 16-node gang too few nodes with a free GPU (24 jobs on 17 nodes).
        nodes = max(32, math.ceil(sum(self.sizes) / 8 * 2))
        policy, self.audit = work / "audit-policy.json", work / "audit.log"
        work.mkdir(parents=True, exist_ok=True)
        policy.write_text(json.dumps(AUDIT_POLICY))
        args = [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit}"]
        args = [x for a in args for x in ("--apiserver-arg", a)]
        self.plane = Plane(work / "k8s", "--gpu-nodes", str(nodes), *args)
        self.nodes, self.proc, self.log = nodes, None, None
        self.snapshots = 0  # taken so far; only the burst takes them, from the first operator

    def up(self) -> None:
        from plane import shared_volume, token_kubeconfig

        self.plane.up()
        self.plane.kubectl("apply", "--server-side", "-f",
                           str(common.ROOT / "manifests" / "install.yaml"))  # fmt: skip
        self.plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                           "crd/finetunejobs.ftjob.dev")  # fmt: skip
        self.plane.apply(shared_volume(NAMESPACE))
        self.kubeconfig = token_kubeconfig(self.plane, "ftjob-system", "ftjob",
                                           self.work / "sa.kubeconfig")  # fmt: skip
        self.clock = PodClock(self.plane.kubeconfig)

    def start_operator(self) -> None:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        self.metrics = free_port()
        argv = ["operator", "-A", "--standalone", "--liveness", "",
                "--metrics-port", str(self.metrics)]  # fmt: skip
        traced = ["bench.traced_operator", TRACE] if TRACE else ["ftjob"]
        argv = [sys.executable, "-m", *traced, *argv]
        self.log = open(self.work / "operator.log", "a")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def reconciles(self) -> float:
        """The operator's ftjob_reconcile_seconds_count (0 until it serves /metrics)."""
        import urllib.request

        try:
            url = f"http://127.0.0.1:{self.metrics}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return 0.0
        line = next(
            (x for x in text.splitlines() if x.startswith("ftjob_reconcile_seconds_count")), ""
        )
        return float(line.split()[1]) if line else 0.0

    def snapshot(self) -> Path | None:
        """The traced operator's live allocations now (None when not traced)."""
        if not TRACE:
            return None
        self.snapshots += 1
        done = Path(TRACE) / f"{self.snapshots}.done"
        self.proc.send_signal(signal.SIGUSR1)
        self.plane.wait(done.exists, 600, "the operator's tracemalloc snapshot")
        return Path(TRACE) / f"{self.snapshots}.snap"

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the operator, this suite and each of the plane's processes
        (its pids file: the latest of each name): on 2 cores they share, who spends them sets
        the pace."""
        names = {}
        for line in (self.plane.dir / "pids").read_text().splitlines():
            name, pid = line.split()
            names[name] = int(pid)
        names["operator"] = self.proc.pid
        names["bench"] = os.getpid()  # its creates and its watch of every pod
        out = {}
        for name, pid in names.items():
            with contextlib.suppress(OSError):  # a process of the plane that ended
                out[name] = cpu_seconds(pid)
        return out

    def stop_operator(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # seen with the traced operator: the rows stay
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()

    def down(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.stop_operator()
        self.plane.down()

    def wait_gangs(self, count: int, bound: bool, timeout: float) -> float:
        """Until ``count`` jobs have every pod (bound to a node when ``bound``); the time."""

        def done():
            with self.clock.lock:
                pods = dict(self.clock.bound) if bound else {p: 0 for p in self.clock.seen}
                jobs = [j for p, (j, _) in self.clock.seen.items() if p in pods]
            per_job: dict[str, int] = {}
            for j in jobs:
                per_job[j] = per_job.get(j, 0) + 1
            full = sum(1 for j, n in per_job.items() if n == self.sizes[int(j.split("-")[1])])
            return full >= count

        self.plane.wait(done, timeout, f"{count} gangs {'bound' if bound else 'created'}")
        return time.monotonic()


def burst(fleet: Fleet) -> dict:
    """All N jobs created at once; latencies and RSS along the way."""
    from kubernetes import client, config

    api = client.CustomObjectsApi(config.new_client_from_config(str(fleet.plane.kubeconfig)))
    applied: dict[str, float] = {}

    def create(i: int) -> None:
        doc = job_doc(i, fleet.sizes[i])
        applied[doc["metadata"]["name"]] = time.monotonic()
        api.create_namespaced_custom_object("ftjob.dev", "v1alpha1", NAMESPACE,
                                            "finetunejobs", doc)  # fmt: skip

    rss = {0: rss_kib(fleet.proc.pid)}
    cpu = fleet.cpu()
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(fleet.jobs)))
    created = time.monotonic() - start
    first = min(100, fleet.jobs)
    fleet.wait_gangs(first, bound=False, timeout=600)
    rss[first] = rss_kib(fleet.proc.pid)
    snaps = [fleet.snapshot()]
    fleet.wait_gangs(fleet.jobs, bound=False, timeout=1800)
    rss[fleet.jobs] = rss_kib(fleet.proc.pid)
    cpu = cpu_spent(cpu, fleet.cpu())
    snaps.append(fleet.snapshot())
    all_bound = fleet.wait_gangs(fleet.jobs, bound=True, timeout=1800) - start
    gangs = fleet.clock.gangs()
    latency = [max(gangs[j]) - t for j, t in applied.items()]
    return {"createSeconds": created, "p50": statistics.median(latency),
            "p99": percentile(latency, 0.99), "max": max(latency), "allBound": all_bound,
            "rssKiB": rss, "cpu": cpu, "snapshots": snaps}  # fmt: skip


def held_by(snapshots: list[Path], jobs: int, top: int = 25) -> list[str]:
    """The lines whose live allocations grew most between two snapshots, per extra job."""
    import tracemalloc

    first, last = (tracemalloc.Snapshot.load(str(p)) for p in snapshots)
    grown = last.compare_to(first, "traceback")
    total = sum(s.size_diff for s in grown)
    lines = [f"all live allocations: {total / 1024 / jobs:+.1f} KiB per extra job"]
    for stat in grown[:top]:  # a traceback runs from the oldest frame: the newest four
        frames = [f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback[-4:]]
        per_job = f"{stat.size_diff / 1024 / jobs:+7.2f} KiB/job {stat.count_diff:+7d}"
        lines.append(f"{per_job}  {' <- '.join(reversed(frames))}")
    return lines


def at_rest(fleet: Fleet, seconds: float) -> dict:
    """The operator's requests while nothing changes: every job said Running (at 1,000 jobs
    kwok ran the last pods minutes after they were bound, and a window that began at "every
    pod bound" counted the operator's Running writes and Events), then settled."""
    from kubernetes import client, config

    api = client.CustomObjectsApi(config.new_client_from_config(str(fleet.plane.kubeconfig)))

    def every_job_running() -> bool:
        jobs = api.list_namespaced_custom_object("ftjob.dev", "v1alpha1", NAMESPACE,
                                                 "finetunejobs")["items"]  # fmt: skip
        return sum((j.get("status") or {}).get("phase") == "Running" for j in jobs) == fleet.jobs

    import hangs  # tests/hangs.py (the path above)

    hangs.poll(every_job_running, 1800, "every job Running", every=5)  # a list of every job
    time.sleep(30)  # the last status writes and events
    start = datetime.now().astimezone()
    time.sleep(seconds)
    end = datetime.now().astimezone()
    time.sleep(2)  # the audit log's buffered lines
    events = audited_between(fleet.audit, start, end)
    by = {}
    for e in events:
        key = f"{e['verb']} {e['objectRef'].get('resource', '')}"
        key += f"/{e['objectRef']['subresource']}" if e["objectRef"].get("subresource") else ""
        by[key] = by.get(key, 0) + 1
    per_second = len(events) / seconds
    return {"requests": len(events), "seconds": seconds, "perSecond": per_second,
            "perJobPer5Min": per_second * 300 / fleet.jobs, "byVerb": by,
            "rssKiB": rss_kib(fleet.proc.pid)}  # fmt: skip


def restart(fleet: Fleet) -> dict:
    """SIGKILL the operator, delete every pod, start it again: until every gang is back."""
    from kubernetes import client, config

    fleet.stop_operator(signal.SIGKILL)
    api = client.CoreV1Api(config.new_client_from_config(str(fleet.plane.kubeconfig)))
    deadline = time.monotonic() + 900
    while fleet.clock.seen:  # asked again when a deletion stops short (2 minutes without end)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(fleet.clock.seen)} pods left after 900 s of deletes")
        _delete_pods(api)
        asked = time.monotonic()
        while fleet.clock.seen and time.monotonic() - asked < 120:
            time.sleep(1)
    start = time.monotonic()
    fleet.start_operator()
    cpu = fleet.cpu()
    # Every job reconciled once (the restarted operator's own count): the resync itself.
    fleet.plane.wait(lambda: fleet.reconciles() >= fleet.jobs, 1800, "every job reconciled")
    resynced = time.monotonic() - start
    cpu = cpu_spent(cpu, fleet.cpu())
    back = fleet.wait_gangs(fleet.jobs, bound=False, timeout=1800) - start
    bound = fleet.wait_gangs(fleet.jobs, bound=True, timeout=1800) - start
    return {"resynced": resynced, "gangsBack": back, "allBound": bound, "cpu": cpu}


def _delete_pods(api) -> None:
    """One deletecollection of every job's pods, not kubectl's delete per pod (4,375 deletes
    one after another outlasted kubectl's 120 s at 1,000 jobs). At that size the server may
    cut the call (seen: "Connection aborted", and a 5xx after which the deletion stopped with
    2,557 pods left): the caller repeats it until none are left."""
    try:
        api.delete_collection_namespaced_pod(NAMESPACE, label_selector="ftjob.dev/job-name",
                                             _request_timeout=600)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - whatever it deleted is gone; the rest is asked again
        print(f"fleet: deletecollection ended early ({type(e).__name__}); asking again")


def _restart_or_error(fleet: Fleet) -> dict:
    """restart(), or what stopped it: the burst's and rest's rows are kept either way."""
    try:
        return restart(fleet)
    except Exception as e:  # noqa: BLE001 - recorded in its rows
        return {"error": f"{type(e).__name__}: {e}"}


def _restart_rows(again: dict, jobs: int) -> list[dict]:
    if "error" in again:
        return [row(f"resync after SIGKILL + every pod deleted ({jobs} jobs): failed: "
                    f"{again['error']}", None)]  # fmt: skip
    return [
        row(
            f"resync after SIGKILL + every pod deleted: every job reconciled s ({jobs} jobs)",
            again["resynced"],
            goal="<= 60 s",
            met=again["resynced"] <= 60,
        ),
        row(f"resync: CPU seconds until every job reconciled: {again['cpu']}", None),
        row("resync: every gang back (a lost gang's next attempt) s", again["gangsBack"]),
        row("resync: every pod bound again s", again["allBound"]),
    ]


def run(work: Path, quick: bool, jobs: int | None = None) -> dict:
    jobs = jobs or (100 if quick else 1000)
    fleet = Fleet(work / "fleet", jobs)
    try:
        fleet.up()
        fleet.start_operator()
        time.sleep(10)  # start-up, the first lists and watches
        b = burst(fleet)
        rest = at_rest(fleet, REST_SECONDS)
        again = _restart_or_error(fleet)
    finally:
        fleet.down()
    rss, first = b["rssKiB"], min(100, jobs)
    slope = (rss[jobs] - rss[first]) / (jobs - first) if jobs > first else None
    snapshots = b.pop("snapshots")
    if TRACE and jobs > first:
        held = held_by(snapshots, jobs - first)
        (Path(TRACE) / "held.txt").write_text("\n".join(held) + "\n")
        print("\n".join(held))
    size = f"{jobs} jobs of 1-16 nodes ({sum(fleet.sizes)} pods, {fleet.nodes} kwok nodes)"
    rows = [
        row(f"{size}: apply -> gang created p50 s", b["p50"]),
        row(f"{size}: apply -> gang created p99 s", b["p99"], goal="<= 10 s",
            met=b["p99"] <= 10),
        row(f"{size}: first apply -> every pod bound s", b["allBound"]),
        row(f"CPU seconds from the first apply to every gang created: {b['cpu']}", None),
        row(f"operator RSS MiB at 0 / {first} / {jobs} jobs",
            [rss[0] / 1024, rss[first] / 1024, rss[jobs] / 1024]),
        row(f"operator RSS per extra job KiB ({first} -> {jobs} jobs)", slope,
            goal="<= 20 KiB", met=None if slope is None else slope <= 20),
        row(f"operator RSS MiB at rest ({jobs} jobs, the burst settled)",
            rest["rssKiB"] / 1024),
        row(f"operator requests/s at rest ({rest['seconds']:.0f} s window, audit log)",
            rest["perSecond"]),
        row("operator requests per job per 5 minutes at rest", rest["perJobPer5Min"],
            goal="<= 1", met=rest["perJobPer5Min"] <= 1),
        *_restart_rows(again, jobs),
    ]  # fmt: skip
    return {"jobs": jobs, "nodes": fleet.nodes, "burst": b, "rest": rest, "restart": again,
            "rows": rows}  # fmt: skip
