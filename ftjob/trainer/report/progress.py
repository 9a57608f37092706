"""Training progress for people (log lines, a bar on a terminal) and for the operator (HTTP).

Rank 0 keeps one :class:`Progress` and publishes the same snapshot three ways, as
docs/progress.md specifies: ``GET /progress`` (JSON), ``GET /metrics`` (Prometheus,
:mod:`ftjob.trainer.report.metrics`) on ``network.progressPort`` (``FTJOB_PROGRESS_PORT`` overrides
it; 0 picks a free port), and ``FTJOB_JOB_DIR/progress.json`` (replaced atomically), plus
one line per logged step in ``FTJOB_JOB_DIR/progress.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ftjob.api import contract, objectives
from ftjob.api.hardware import GPUS, gpu_for_device_name
from ftjob.job import atomic
from ftjob.job.folder import JobFolder
from ftjob.trainer.report import metrics
from ftjob.trainer.report.startup import Startup


def peak_flops(device_name: str | None, gpu_type: str | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device (ftjob.api.hardware's table); None on CPU.

    ``resources.gpuType`` names the table entry when the spec has it; otherwise the CUDA
    device name is matched. An unknown device gives None (MFU is then not reported). A
    gpuType whose peak is only assumed (H100-80GB: SXM or PCIe) yields to the device's own
    name, and keeps its assumed peak only where the name matches no entry.
    """
    named = GPUS.get(gpu_type) if gpu_type else None
    if named is not None and not named.peak_assumed:
        return named.peak_bf16_flops
    gpu = (gpu_for_device_name(device_name) if device_name else None) or named
    return gpu.peak_bf16_flops if gpu else None


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Rank 0's view of the run; other ranks get an instance that does nothing.

    It exists from the first second of the run (phase "starting"), before the number of steps
    is known: :meth:`planned` fills that in once data and model are loaded.
    """

    def __init__(self, job_dir: Path, enabled: bool, total: int | None, world: int, **info):
        self.enabled, self.job_dir, self.total = enabled, job_dir, total
        self.writes_files = info.pop("writes_files", True)  # see own_folder()
        self.peak = info.pop("peak", None)
        self.world = world
        self.tty = sys.stdout.isatty()
        self.snapshot = {
            "phase": "starting",
            "phaseStartedAt": _now(),
            "step": 0,
            "totalSteps": total,
            "epoch": 0.0,
            "loss": None,
            "evalLoss": None,
            "learningRate": None,
            "tokensPerSecond": None,
            "tokensSeen": 0,
            "mfu": None,
            "etaSeconds": None,
            "lastCheckpointStep": None,
            "lastCheckpoint": None,
            "resumedFrom": None,
            "exportPath": None,
            "worldSize": world,
            # This gang's restarts in place so far (ftjob.trainer.agent), and the ranks
            # persistently slower than the others (ftjob.trainer.gang.stragglers).
            "restartsInPlace": restarts_in_place(),
            "stragglers": [],
            "port": None,
            "startedAt": _now(),
            "updatedAt": _now(),
            **info,
        }
        self.last_step: int | None = None  # kept on every rank, for the failure record
        self._lock = threading.Lock()
        self._window = (time.perf_counter(), 0)  # (time, step) at the last log
        self._server: ThreadingHTTPServer | None = None
        self._files = _FileWriter(job_dir) if enabled else None
        self.metrics = metrics.TrainerMetrics(self._copy)
        # Each phase's seconds to the first step (train.py marks them), said once (step()).
        self.startup = Startup()
        # Told each event with the snapshot (ftjob.trainer.report.trackers); each must return at
        # once: what it sends, it sends from a thread of its own.
        self.listeners: list = []

    def _copy(self) -> dict:
        with self._lock:
            return dict(self.snapshot)

    def final(self) -> dict | None:
        """What the termination record carries of the snapshot (contract.final_progress):
        rank 0's only, the one rank that knows the losses; None on the others."""
        return contract.final_progress(self._copy()) if self.enabled else None

    # -------------------------------------------------------------------- publishing

    def serve(self, port: int) -> None:
        """Serve /progress and /metrics from a daemon thread (a busy port only warns)."""
        if not self.enabled:
            return
        progress = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path.startswith("/progress"):
                    body, kind = json.dumps(progress._copy()).encode(), "application/json"
                elif self.path.startswith("/metrics"):
                    body, kind = progress.metrics.text(), metrics.CONTENT_TYPE
                else:
                    self.send_error(404, "try /progress or /metrics")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keep scrapes out of the training log
                pass

        try:
            self._server = ThreadingHTTPServer(("", port), Handler)
        except OSError as e:
            self.log(f"progress: cannot serve on port {port} ({e}); progress.json only")
            return
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.update(port=self._server.server_address[1])

    def update(self, history: str | None = None, **fields) -> None:
        """Change the snapshot; ``history`` ("step", "eval") also appends it to progress.jsonl."""
        if not self.enabled:
            return
        with self._lock:
            changed = fields.get("phase", self.snapshot["phase"]) != self.snapshot["phase"]
            if changed:
                fields["phaseStartedAt"] = _now()
            self.snapshot.update(fields, updatedAt=_now())
            snap = dict(self.snapshot)
        told = measured(snap, fields) if history == "step" else snap
        if self.writes_files:
            self._files.write(snap, history and {"event": history, **told})
        self._tell(history or ("phase" if changed else None), told)

    def _tell(self, event: str | None, snap: dict) -> None:
        """Listeners hear "owned", "begin", "step", "eval" and "phase" (a new phase)."""
        if event:
            for listener in self.listeners:
                listener.event(event, snap)

    def own_folder(self) -> None:
        """Write the snapshot to the job folder from now on: once this run holds the folder
        (its owner lease) and the folder's record matches its spec. Before that only
        ``/progress`` serves it, so a run refused as a second writer, or for a changed spec,
        leaves another run's progress files as they were.

        The numbers the previous run of this job left in progress.json (:func:`kept_keys`) seed
        the snapshot, and this run overwrites them as it reports its own: a rerun that finds
        the job already trained ends with the finished run's step and losses, not step 0."""
        if self.enabled:
            previous = _read_snapshot(JobFolder(self.job_dir).progress)
            kept = {k: previous[k] for k in kept_keys() if k in previous}
            if not _inside(kept.get("lastCheckpoint"), self.job_dir):
                # A folder copied or moved here: its numbers are this run's, that path is not.
                kept.pop("lastCheckpoint", None)
                kept.pop("lastCheckpointStep", None)
            with self._lock:
                self.snapshot.update(kept)
        self.writes_files = True
        self.update()
        if self.enabled:
            self._tell("owned", self._copy())

    def log(self, message: str) -> None:
        if self.enabled:
            if self.tty:
                sys.stdout.write("\r\033[K")
            print(message, flush=True)

    def flush(self) -> None:
        """Wait until progress.json and progress.jsonl hold everything reported so far."""
        if self._files is not None:
            self._files.flush()

    def close(self) -> None:
        for listener in self.listeners:  # each waits a bounded time for what it still sends
            listener.close()
        if self._files is not None:
            self._files.close()  # what was last reported is on the volume before the exit
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -------------------------------------------------------------------- training events

    def phase(self, phase: str, **fields) -> None:
        """Enter ``phase`` (one of ftjob.api.contract.PHASES), with that phase's own fields, e.g.
        ``report.phase("downloading", downloadedBytes=..., totalBytes=...)``."""
        self.update(phase=phase, **fields)

    def planned(self, total: int, peak=None, **info) -> None:
        """What loading found out: the steps to run, the device's peak FLOP/s (for MFU),
        sharding, ..."""
        self.total, self.peak = total, peak
        self.update(totalSteps=total, **info)

    def begin(self, step: int) -> None:
        """Training starts (or resumes) at ``step``: rates are measured from here."""
        self.last_step = step
        self._window = (time.perf_counter(), step)
        # tokensSeen counts this attempt's tokens (a seeded figure is the previous run's).
        self.update(phase="training", step=step, tokensSeen=0)
        if self.enabled:
            self._tell("begin", self._copy())

    def step(self, step: int, lr: float, epoch: float, seconds: float | None = None) -> None:
        """Record one optimizer step (``seconds`` it took): /progress serves it, the file
        thread writes it when it can, a terminal's bar moves; no number waits for the device."""
        self.last_step = step
        if not self.enabled:
            return
        if seconds is not None:
            self.metrics.step_seconds.observe(seconds)
        if not self.startup.finished:  # the first step of this process: start-up is over
            self.startup.finish()
            self.log(self.startup.line())
            self.update(startup=self.startup.record())
        self.update(step=step, learningRate=lr, epoch=round(epoch, 4))
        if self.tty and self.snapshot["loss"] is not None:
            sys.stdout.write("\r" + self.line(bar=True))
            sys.stdout.flush()

    def logged(self, step: int, loss: float, tokens: int, flops: float, **metrics) -> None:
        """A log step: the step's loss over all ranks, and the tokens and model FLOPs of all
        ranks since the last log, from which tokens/s, MFU (docs/progress.md) and the ETA;
        ``metrics``: the objective's own (api/objectives.py: DPO's rewardAccuracy, ...)."""
        if not self.enabled:
            return
        t0, step0 = self._window
        now = time.perf_counter()
        elapsed = max(now - t0, 1e-9)
        fields = {"step": step, "loss": loss, "tokensSeen": self.snapshot["tokensSeen"] + tokens}
        fields.update(metrics)
        fields["tokensPerSecond"] = round(tokens / elapsed, 1)
        fields["etaSeconds"] = round(elapsed / max(step - step0, 1) * (self.total - step), 1)
        if self.peak:
            fields["mfu"] = round(flops / (elapsed * self.peak * self.world), 4)
        self._window = (now, step)
        self.update(history="step", **fields)
        self.log(self.line(metrics=fields))  # the step's own: a figure reported once shows once

    def line(self, bar: bool = False, metrics: dict | None = None) -> str:
        """The step in words; ``metrics``: the objective's to show (the newest of each)."""
        s = self.snapshot
        width = len(str(self.total))
        parts = [f"step {s['step']:>{width}}/{self.total}", f"loss {s['loss']:.4f}"]
        if bar:
            done = int(20 * s["step"] / max(self.total, 1))
            parts.insert(0, "[" + "#" * done + "." * (20 - done) + "]")
        parts += objectives.labelled(s if metrics is None else metrics, "log")
        if s["evalLoss"] is not None:
            parts.append(f"eval {s['evalLoss']:.4f}")
        parts.append(f"lr {s['learningRate']:.2e}")
        if s["tokensPerSecond"] is not None:
            parts.append(f"tok/s {s['tokensPerSecond']:,.0f}")
        mfu = s["mfu"]
        parts.append(f"mfu {mfu:.1%}" if mfu is not None else "mfu n/a")
        parts.append(f"eta {_eta(s['etaSeconds'])}")
        return "  ".join(parts)

    def stragglers(self, named: list[dict], line: str) -> None:
        """The ranks now named stragglers ([] when none is any longer), said in the log."""
        if not self.enabled:
            return
        self.update(stragglers=named)
        self.log(line)

    def evaluated(self, step: int, loss: float, **metrics) -> None:
        """An evaluation's mean loss; ``metrics``: the objective's own under their training
        keys (api/objectives.py), kept as the eval keys (rewardAccuracy -> evalRewardAccuracy)."""
        if not self.enabled:
            return
        named = {"eval" + k[0].upper() + k[1:]: v for k, v in metrics.items()}
        self.update(history="eval", phase="training", evalLoss=loss, evalStep=step, **named)
        # An objective's own numbers say more than next-token perplexity.
        own = objectives.labelled(metrics, "eval_log") or [f"(ppl {_ppl(loss)})"]
        self.log("  ".join([f"eval  step {step}/{self.total}  eval loss {loss:.4f}", *own]))


# What a run found out and a rerun keeps until it knows better (docs/progress.md): not its
# phase, times, port or per-attempt fields (resumedFrom, replacesExport), and not exportPath,
# which a run sets only once it has succeeded. The objectives' metrics are kept too (kept_keys()).
KEPT = (
    "step", "totalSteps", "epoch", "loss", "evalLoss", "evalStep", "learningRate",
    "tokensPerSecond", "tokensSeen", "mfu", "lastCheckpointStep", "lastCheckpoint",
    "loadPeakRssMiB", "trainPeakRssMiB", "trainPeakGpuMiB",
    "rewards",  # GRPO: each reward function's mean and std (api/objectives.py: its names vary)
    "evalRewards",  # and on the held-out prompts
)  # fmt: skip


def measured(snap: dict, fields: dict) -> dict:
    """A log step as its progress.jsonl line and the trackers' event have it: the snapshot
    without the objective's metrics that this step did not report (``fields``), so that a
    figure reported once (GRPO's completions' figures, once a generation batch) is one point
    of its series, not one a step. The snapshot keeps them: /progress, /metrics and the
    status show the newest of each."""
    unreported = {m.key for m in objectives.metrics()} | {"rewards"}
    return {k: v for k, v in snap.items() if k not in unreported or k in fields}


def kept_keys() -> tuple[str, ...]:
    """:data:`KEPT` and every objective's metrics, in training and in evaluations."""
    return (*KEPT, *objectives.keys())


def restarts_in_place() -> int:
    """How often this gang's workers were restarted in place: the node agent's count
    (FTJOB_RESTARTS_IN_PLACE, every restart of the gang), else torchrun's own
    (TORCHELASTIC_RESTART_COUNT, this node's failures only)."""
    for name in (contract.RESTARTS_IN_PLACE_ENV, "TORCHELASTIC_RESTART_COUNT"):
        with contextlib.suppress(KeyError, ValueError):
            return int(os.environ[name])
    return 0


def _read_snapshot(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: start from a fresh snapshot
        return {}
    return value if isinstance(value, dict) else {}


def _inside(path, folder: Path) -> bool:
    return isinstance(path, str) and Path(path).is_relative_to(folder)


def _ppl(loss: float) -> str:
    return f"{math.exp(loss):.2f}" if loss < 50 else "inf"


class _FileWriter:
    """Writes progress.json (and appends progress.jsonl) from a thread of its own: a slow
    shared volume never holds up rank 0, and so never the other ranks waiting for it at the
    next collective. Only the newest snapshot is written; no history line is dropped."""

    def __init__(self, job_dir: Path):
        self.job_dir = job_dir
        self._wake = threading.Condition()
        self._snapshot: dict | None = None
        self._history: list[str] = []
        self._busy = self._closed = False
        threading.Thread(target=self._run, daemon=True, name="progress-files").start()

    def write(self, snapshot: dict, history: dict | None) -> None:
        """The newest snapshot, and a line to append to progress.jsonl (None: none)."""
        with self._wake:
            self._snapshot = snapshot
            if history:
                self._history.append(json.dumps(history))
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._snapshot is not None or self._closed)
                if self._snapshot is None:
                    return
                snapshot, lines = self._snapshot, self._history
                self._snapshot, self._history, self._busy = None, [], True
            try:
                folder = JobFolder(self.job_dir)
                atomic.write_json(folder.progress, snapshot)
                if lines:
                    with open(folder.history, "a") as f:
                        f.write("".join(line + "\n" for line in lines))
            except OSError as e:  # a full volume: the checkpoint or export names it properly
                print(f"progress: cannot write to {self.job_dir}: {e}", file=sys.stderr)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def flush(self, timeout: float = 30) -> None:
        """Wait until what was reported so far is on the volume."""
        with self._wake:
            self._wake.wait_for(lambda: self._snapshot is None and not self._busy, timeout)

    def close(self) -> None:
        """Write what is pending, then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self.flush()
