"""The real trainer's termination records and logs, for the tests of whoever reads them.

Each scenario runs ``python -m ftjob.trainer`` (world size 1) into one way of ending -- bad
data, a missing model folder, a full disk, host memory running out, a checkpoint that does
not fit the model, success, a restart after the export, a kill, a SIGTERM -- and keeps what
a kubelet would show: the termination file, else the log tail (FallbackToLogsOnError). The
status and lifecycle tests feed these to the operator's code; none of them types a trainer
line by hand.

The scenarios start together on first use (three at a time), once per test session.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import hangs
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = hangs.RUN  # one tiny run (tests/hangs.py)

BASE = {
    "apiVersion": "ftjob.dev/v1alpha1",
    "kind": "FineTuneJob",
    "metadata": {"name": "contract"},
    "spec": {
        "model": {"source": str(EXAMPLES / "tiny-model")},
        "dataset": {
            "source": str(EXAMPLES / "data" / "tiny-text.jsonl"),
            "format": "text",
            "maxSeqLength": 64,
        },
        "method": {"type": "full"},
        "training": {"maxSteps": 2, "microBatchSize": 2, "logEvery": 1, "evalEvery": 0},
        "resources": {"nodes": 1, "gpusPerNode": 0},
        "checkpoint": {"every": 1, "keep": 2},
    },
}


@dataclass
class Outcome:
    """How one real trainer process ended."""

    exit_code: int
    record: str  # what it wrote to FTJOB_TERMINATION_LOG ("" if nothing)
    log: str  # stdout and stderr together
    job_dir: Path
    # What rank 0 served while it ran, by path (/metrics, /progress); scenario "scraped".
    served: dict[str, str] = field(default_factory=dict)

    @property
    def message(self) -> str:
        """The pod's termination message as the kubelet fills it in: the file, else (on
        failure, FallbackToLogsOnError) the last 80 lines / 2048 bytes of the log."""
        if self.record:
            return self.record[:4096]
        return "\n".join(self.log.splitlines()[-80:])[-2048:] if self.exit_code else ""

    def terminated(self) -> dict:
        """The container's ``state.terminated`` the kubelet reports for it."""
        reason = "Completed" if self.exit_code == 0 else "Error"
        term = {"exitCode": self.exit_code, "reason": reason}
        return term | ({"message": self.message} if self.message else {})


def job(name: str, **changes) -> dict:
    doc = copy.deepcopy(BASE)
    doc["metadata"]["name"] = name
    for section, values in changes.items():
        doc["spec"].setdefault(section, {}).update(values)
    return doc


class Runs:
    """Scenario name -> :class:`Outcome`, each run once, all started on first use."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._pool = ThreadPoolExecutor(max_workers=3)
        self._futures: dict[str, tuple[Future, int]] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Outcome:
        with self._lock:
            if not self._futures:
                for names, scenario in SCENARIOS.items():
                    future = self._pool.submit(scenario, self)
                    self._futures |= {n: (future, i) for i, n in enumerate(names)}
        future, index = self._futures[name]
        result = future.result()
        return result[index] if isinstance(result, tuple) else result

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)

    # ------------------------------------------------------------------ running the trainer

    def start(self, name: str, doc: dict, job_dir: Path | None = None, wrap=(), env=None):
        folder = self.workdir / name
        folder.mkdir(parents=True, exist_ok=True)
        spec = folder / "job.yaml"
        spec.write_text(yaml.safe_dump(doc, sort_keys=False))
        job_dir = job_dir or folder / "job"
        record = folder / "termination-log"
        record.unlink(missing_ok=True)  # a container's file starts empty
        env = {
            **os.environ,
            "FTJOB_JOB_DIR": str(job_dir),
            "FTJOB_TERMINATION_LOG": str(record),
            "FTJOB_PROGRESS_PORT": "0",
            "OMP_NUM_THREADS": "1",
            "FTJOB_NODE_NAME": "node-a",
            **(env or {}),
        }
        argv = [*wrap, sys.executable, "-m", "ftjob.trainer", "--spec", str(spec)]
        log = open(folder / "log.txt", "w")  # noqa: SIM115 - closed in finish()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
        return proc, folder, job_dir, log

    def finish(self, started) -> Outcome:
        proc, folder, job_dir, log = started
        try:
            code = proc.wait(timeout=TIMEOUT)
        finally:
            proc.kill()
            log.close()
        record = folder / "termination-log"
        text = record.read_text() if record.is_file() else ""
        return Outcome(code, text, (folder / "log.txt").read_text(), job_dir)

    def run(self, name: str, doc: dict, **kw) -> Outcome:
        """Run the trainer on ``doc`` to its end."""
        return self.finish(self.start(name, doc, **kw))


def wait_for_phase(job_dir: Path, phases: tuple[str, ...], proc) -> dict:
    """Rank 0's progress.json once it reports one of ``phases``."""
    return wait_for(job_dir, lambda snap: snap.get("phase") in phases, proc, str(phases))


def wait_for(job_dir: Path, reached, proc, what: str) -> dict:
    """Rank 0's progress.json once ``reached(snapshot)``."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            snap = json.loads((job_dir / "progress.json").read_text())
        except (OSError, ValueError):
            snap = {}
        if reached(snap):
            return snap
        time.sleep(0.05)
    raise AssertionError(f"the trainer never reached {what} (exit {proc.poll()})")


# ---------------------------------------------------------------------------- scenarios


def bad_data(runs: Runs) -> Outcome:
    data = runs.workdir / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    return runs.run("bad-data", job("bad-data", dataset={"source": str(data)}))


def bad_model(runs: Runs) -> Outcome:
    missing = runs.workdir / "no-such-model"
    return runs.run("bad-model", job("bad-model", model={"source": str(missing)}))


def bad_spec(runs: Runs) -> Outcome:
    return runs.run("bad-spec", job("bad-spec", method={"type": "sideways"}))


def will_not_fit(runs: Runs) -> Outcome:
    """resources.memory far below the plan's peak: refused before the data or the model."""
    return runs.run("will-not-fit", job("will-not-fit", resources={"memory": "300Mi"}))


def trained_then_restarted(runs: Runs) -> tuple[Outcome, Outcome, Outcome]:
    """A run that succeeds; the same job started again (already trained); then a LoRA job
    told to start from the full fine-tune's checkpoints (checkpoint.resumeFrom), which cannot
    hold LoRA. (The same folder would refuse the changed method before any checkpoint.)"""
    done = runs.run("succeeded", job("trained"))
    again = runs.run("already-trained", job("trained"), job_dir=done.job_dir)
    seeded = {"resumeFrom": str(done.job_dir.relative_to(runs.workdir))}
    lora = job("misfit", method={"type": "lora"}, checkpoint=seeded)
    root = {"FTJOB_SOURCE_ROOT": str(runs.workdir)}  # where relative paths are read, as on a volume
    misfit = runs.run("checkpoint-unreadable", lora, env=root)
    return done, again, misfit


def disk_full(runs: Runs) -> Outcome:
    """The job folder on a 256 KiB tmpfs (a private mount namespace): the exported model
    (900 KB) does not fit."""
    mount = runs.workdir / "disk-full" / "small-volume"
    mount.mkdir(parents=True, exist_ok=True)
    wrap = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
            f'mount -t tmpfs -o size=256k tmpfs "{mount}" && exec "$0" "$@"']  # fmt: skip
    doc = job("disk-full", checkpoint={"every": 1000})
    return runs.run("disk-full", doc, job_dir=mount / "job", wrap=wrap)


def host_oom(runs: Runs) -> Outcome:
    """Address space capped (RLIMIT_AS, as a container memory limit would) just above what
    the trainer holds once training starts: the next step's activations do not fit."""
    doc = job("host-oom", training={"maxSteps": 1000, "microBatchSize": 32},
              dataset={"maxSeqLength": 256}, checkpoint={"every": 1000})  # fmt: skip
    started = runs.start("host-oom", doc)
    proc, _, job_dir, _ = started
    wait_for_phase(job_dir, ("training",), proc)
    with open(f"/proc/{proc.pid}/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = size + (8 << 20)
    resource.prlimit(proc.pid, resource.RLIMIT_AS, (limit, limit))
    return runs.finish(started)


def killed(runs: Runs) -> Outcome:
    """SIGKILL while training (a kill, a segfault): no record, only the log."""
    doc = job("killed", training={"maxSteps": 100000}, checkpoint={"every": 100000})
    started = runs.start("killed", doc)
    proc = started[0]
    wait_for_phase(started[2], ("training",), proc)
    proc.send_signal(signal.SIGKILL)
    return runs.finish(started)


def sigterm(runs: Runs) -> Outcome:
    """SIGTERM after a few steps (its pod deleted, evicted, preempted): it saves the step it
    reached, though no checkpoint was due, and ends with a "preempted" record."""
    doc = job("sigterm", training={"maxSteps": 100000}, checkpoint={"every": 100000})
    started = runs.start("sigterm", doc)
    proc = started[0]
    wait_for(started[2], lambda s: s.get("phase") == "training" and s.get("step", 0) >= 2, proc,
             "step 2")  # fmt: skip
    proc.send_signal(signal.SIGTERM)
    return runs.finish(started)


def volume_unusable(runs: Runs) -> Outcome:
    """The preflight's volume check on a job folder that cannot be made (its parent is a
    file: refused even to root, which the tests may run as)."""
    blocker = runs.workdir / "volume-unusable" / "not-a-folder"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the volume's folder should be\n")
    doc = job("volume-unusable", preflight={"mode": "on"})
    return runs.run("volume-unusable", doc, job_dir=blocker / "job")


def scraped(runs: Runs) -> Outcome:
    """A run read as Prometheus and the operator read rank 0 while it trains: its /metrics
    and /progress once a step has been logged and an evaluation made. Every step is made
    0.4 s slower (tests/e2e/inject) so that the run is still there to be read."""
    doc = job("scraped", training={"maxSteps": 8, "evalEvery": 2}, dataset={"evalFraction": 0.1},
              checkpoint={"every": 1000})  # fmt: skip
    inject = str(ROOT / "tests" / "e2e" / "inject")
    path = os.pathsep.join(p for p in (inject, os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "FTJOB_TEST_INJECT": "slow:0:0.4", "RANK": "0"}
    started = runs.start("scraped", doc, env=env)
    proc, _, job_dir, _ = started
    served = {}
    try:
        snap = wait_for(job_dir, lambda s: s.get("evalLoss") is not None, proc, "an eval loss")
        for route in ("/metrics", "/progress"):
            url = f"http://127.0.0.1:{snap['port']}{route}"
            with urllib.request.urlopen(url, timeout=hangs.FLOOR) as reply:
                served[route] = reply.read().decode()
    finally:
        outcome = runs.finish(started)
    outcome.served = served
    return outcome


# Each scenario runs once and may end several ways in a row (one job folder, restarted).
SCENARIOS = {
    ("bad-data",): bad_data,
    ("bad-model",): bad_model,
    ("bad-spec",): bad_spec,
    ("will-not-fit",): will_not_fit,
    ("succeeded", "already-trained", "checkpoint-unreadable"): trained_then_restarted,
    ("disk-full",): disk_full,
    ("host-oom",): host_oom,
    ("killed",): killed,
    ("sigterm",): sigterm,
    ("volume-unusable",): volume_unusable,
    ("scraped",): scraped,
}
NAMES = tuple(name for names in SCENARIOS for name in names)
