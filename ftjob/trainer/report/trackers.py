"""Experiment trackers: rank 0 reports the run to MLflow, Weights & Biases and TensorBoard.

The job names them in ``spec.tracking``; each listens to rank 0's :class:`Progress` and gets
the same events the progress files do: the folder is this run's ("owned": the run starts, or
resumes, with the spec as its parameters), training begins at a step ("begin"), a logged
step ("step": loss, learning rate, tokens/s, MFU), an evaluation ("eval"), the end
("phase" succeeded, with the export's location, or failed).

Each tracker sends from a thread of its own through a queue: the training step never waits
for a network. A call that fails is tried again (:data:`TRIES` times); then the tracker is
turned off for this run and said once, in the log and in progress (``trackingWarnings``):
a tracker that is down never fails training.

One job is one run in each tracker, across restarts: the run ids are kept in the job folder
(``tracking.json``, written once this run holds the folder), so a restarted gang or a rerun
of ``ftjob run`` continues the same MLflow and W&B run, and TensorBoard appends to its event
files, purging the steps that the resumed run replays. Steps a tracker already holds are not
sent again. The clients are the trackers' own (the ``tracking`` extra), imported only when
the job names them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import re
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ftjob import __version__
from ftjob.api import objectives
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.jobspec.tracking import MlflowSpec, WandbSpec
from ftjob.api.schema import FieldError, to_dict
from ftjob.job import atomic
from ftjob.job.folder import JobFolder

TRIES = 3  # attempts per call, 1 s and then 2 s apart
# Seconds the end of the run waits, all trackers together, for what they still send: a
# tracker that answers needs a small part of it for its last calls, even on a busy machine,
# and one MLflow call that hit its 30 s HTTP timeout can still be tried again. A tracker still
# sending then hangs or is far behind: what it has not sent is said, and the exit waits no
# longer. (A pod that Kubernetes stops has 60 s of grace in all; its failure record is
# written before this wait.)
CLOSE_WAIT = 60.0
QUEUE = 10_000  # events waiting per tracker; more are dropped (and said) rather than held
# The progress snapshot's fields each tracker records, under the names trackers use; then
# the objectives' own (api/objectives.py, see names()).
STEP_METRICS = {
    "loss": "train/loss",
    "learningRate": "train/learning_rate",
    "tokensPerSecond": "train/tokens_per_second",
    "mfu": "train/mfu",
    "epoch": "train/epoch",
}
EVAL_METRICS = {"evalLoss": "eval/loss"}  # an evaluation's
EVAL_METRIC = EVAL_METRICS["evalLoss"]  # the series a resumed MLflow run reads its place from


# Each tracker's client module (the ``tracking`` extra installs them all).
CLIENTS = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}
INSTALL = "pip install 'ftjob[tracking]'"


def named(spec: FineTuneJobSpec) -> list[str]:
    """The trackers ``spec.tracking`` turns on."""
    t = spec.tracking
    on = {
        "mlflow": t.mlflow,
        "wandb": t.wandb,
        "tensorboard": t.tensorboard and t.tensorboard.enabled,
    }
    return [name for name, wanted in on.items() if wanted]


def not_installed(spec: FineTuneJobSpec) -> list[FieldError]:
    """The trackers the job names whose client this Python cannot import, with the install
    command: ``ftjob run`` refuses them before any process starts (a run that trains without
    its tracker would end "already trained" once the client is installed), and the trainer
    says them at its start."""
    out = []
    for name in named(spec):
        try:
            found = importlib.util.find_spec(CLIENTS[name]) is not None
        except (ImportError, ValueError):  # a broken install imports no better
            found = False
        if not found:
            out.append(
                FieldError(
                    f"spec.tracking.{name}",
                    f"the {name} client ({CLIENTS[name]}) is not installed in this Python, so "
                    "the run would not be tracked",
                    fix=f"{INSTALL} (or remove spec.tracking.{name})",
                )
            )
    return out


def names(event: str) -> dict[str, str]:
    """The snapshot's fields a "step" or "eval" event reports, and their trackers' names."""
    step, evaluation = objectives.trackers()
    return EVAL_METRICS | evaluation if event == "eval" else STEP_METRICS | step


def attach(report, spec: FineTuneJobSpec, name: str, job_dir: Path) -> None:
    """Make the trackers ``spec.tracking`` names listeners of rank 0's ``report``."""
    if not report.enabled:
        return
    t = spec.tracking
    ids = _Ids(JobFolder(job_dir).tracking)
    warnings = _Warnings(report)
    found = [
        _Mlflow(t.mlflow, name, job_dir) if t.mlflow else None,
        _Wandb(t.wandb, name, job_dir) if t.wandb else None,
        _Tensorboard(job_dir) if t.tensorboard and t.tensorboard.enabled else None,
    ]
    for problem in not_installed(spec):  # said at the start, not at the first step's import
        warnings.add(f"tracking: {problem.path}: {problem.message}; fix: {problem.fix}")
        report.log(f"warning: tracking: {problem}")
    params = parameters(spec)
    closing: dict[str, float] = {}  # one deadline for all trackers at the end of the run
    for tracker in filter(None, found):
        report.listeners.append(_Sender(tracker, ids, params, warnings, report.log, closing))


def parameters(spec: FineTuneJobSpec) -> dict[str, str]:
    """The spec, flat (``training.learningRate``: "0.003"): what a tracker shows as the run's
    parameters. Lists and maps are JSON. Of ``env`` only the names: a value may be a
    credential written in the job, and a tracker's parameters are read by more people."""
    out: dict[str, str] = {"ftjob.version": __version__}

    def flat(value: Any, prefix: str) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                flat(inner, f"{prefix}.{key}" if prefix else key)
        elif value is not None:
            text = value if isinstance(value, str) else json.dumps(value)
            out[prefix] = text[:500]  # MLflow's limit is higher; a long value is a list

    doc = to_dict(spec)
    doc["env"] = [e["name"] for e in doc.get("env", [])]
    flat(doc, "")
    return out


def measured(event: str, snap: dict) -> tuple[int, dict[str, float]]:
    """The step and the metrics a "step" or "eval" event reports."""
    step = (snap.get("evalStep") or 0) if event == "eval" else snap["step"]
    fields = names(event)
    out = {fields[k]: snap[k] for k in fields if snap.get(k) is not None}
    if event == "step":
        out.update(per_reward(snap.get("rewards")))
    else:
        out.update(per_reward(snap.get("evalRewards"), "eval"))
    return step, out


def per_reward(rewards, prefix: str = "train") -> dict[str, float]:
    """GRPO's rewards by function (progress key ``rewards``, ``evalRewards``: name -> mean and
    std) under TRL's tracker names, train/rewards/<name>/mean and /std (eval/... for the
    held-out prompts)."""
    if not isinstance(rewards, dict):
        return {}
    return {
        f"{prefix}/rewards/{name}/{what}": value
        for name, both in rewards.items()
        for what, value in both.items()
        if value is not None
    }


def reported(job_dir: Path, after: dict[str, int], upto: int) -> list[tuple[str, dict]]:
    """What earlier runs of the job reported (progress.jsonl) after the steps a tracker holds
    (``after``: event -> step) up to ``upto``, the newest report of each step: a run killed
    while its tracker was behind leaves no hole in the history the next run continues."""
    newest: dict[tuple[str, int], dict] = {}
    with contextlib.suppress(OSError), open(JobFolder(job_dir).history) as lines:
        for line in lines:  # one at a time: a long run's history is long
            try:
                row = json.loads(line)
                step = measured(row["event"], row)[0] if row.get("event") in after else -1
            except (ValueError, KeyError, TypeError, AttributeError):  # a line cut short
                continue
            if after.get(row.get("event"), upto) < step <= upto:
                newest[(row["event"], step)] = row
    return [(event, row) for (event, _), row in sorted(newest.items(), key=lambda x: x[0][1])]


def when(row: dict) -> float:
    """The time a progress.jsonl row was reported (seconds since the epoch)."""
    try:
        return (
            datetime.strptime(row["updatedAt"], "%Y-%m-%dT%H:%M:%SZ")
            .replace(tzinfo=timezone.utc)
            .timestamp()
        )
    except (KeyError, TypeError, ValueError):
        return time.time()


def redact(text: str) -> str:
    """An error message without credentials written into an address (https://user:pw@...)."""
    return re.sub(r"//[^/@\s]+@", "//***@", text)


class _Ids:
    """tracking.json: each tracker's run id, kept for the restarted gang (atomic writes)."""

    def __init__(self, path: Path):
        self.path, self._lock = path, threading.Lock()

    def get(self, tracker: str) -> dict:
        with self._lock:
            return dict(self._read().get(tracker) or {})

    def set(self, tracker: str, value: dict) -> None:
        with self._lock:  # two trackers' threads: neither loses the other's id
            atomic.write_json(self.path, {**self._read(), tracker: value})

    def _read(self) -> dict:
        try:
            value = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}


class _Warnings:
    """What went wrong with the trackers, in progress as ``trackingWarnings``."""

    def __init__(self, report):
        self.report, self._lock, self.said = report, threading.Lock(), []

    def add(self, message: str) -> None:
        with self._lock:
            self.said.append(message)
            said = list(self.said)
        self.report.update(trackingWarnings=said)


class _Sender:
    """One tracker's thread: events in through a queue, calls out with bounded retries.

    Each event is counted when it is queued and when the tracker's call for it has returned
    (each tracker's call returns once what it was given is written or handed on): at the end,
    what was logged and not sent, for whatever reason, is said rather than lost quietly."""

    def __init__(self, tracker, ids, params: dict, warnings: _Warnings, log, closing: dict):
        self.tracker, self.ids, self.params = tracker, ids, params
        self.warnings, self.log, self.closing = warnings, log, closing
        self.off = self.ended = self.started = self.closed = False
        self._said, self._count = threading.Lock(), threading.Lock()
        self.queued = self.done = 0  # events put on the queue; those the thread is done with
        self.dropped = 0  # not queued: the queue was full (the tracker fell behind)
        self.late = 0  # came after the tracker's run ended, or after close() began
        self._queue: queue.Queue = queue.Queue(QUEUE)
        self._thread = threading.Thread(target=self._run, daemon=True, name=tracker.name)
        self._thread.start()

    def event(self, kind: str, snap: dict) -> None:
        with self._count:  # another thread (stragglers, a phase) may log while close() runs
            if self.closed:
                self.late += 1
                return
            try:
                self._queue.put_nowait((kind, snap, time.time()))
                self.queued += 1
            except queue.Full:
                self.dropped += 1

    def close(self) -> None:
        """Send what is queued, then stop: all trackers together wait at most CLOSE_WAIT
        seconds; what one has not sent by then is said (the thread is a daemon: one that
        hangs does not hold the exit)."""
        deadline = self.closing.setdefault("at", time.monotonic() + CLOSE_WAIT)
        with self._count:
            self.closed = True
        with contextlib.suppress(queue.Full):  # full and not drained: the deadline ends it
            self._queue.put((None, None, None), timeout=max(0.0, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._count:
            unsent, dropped, late = self.queued - self.done, self.dropped, self.late
        why = []
        if self._thread.is_alive():
            why.append(f"still sending {CLOSE_WAIT:g} s after the end of the run")
        if unsent + dropped:
            behind = "fell behind: " if dropped else ""
            why.append(f"{behind}{_events(unsent + dropped)} not sent")
        if late:
            why.append(f"{_events(late)} after its run's end not sent")
        if why:
            self._give_up(", ".join(why))

    def _run(self) -> None:
        while True:
            kind, snap, at = self._queue.get()
            if kind is None:
                return
            try:
                self._one(kind, snap, at)
            finally:
                with self._count:
                    self.done += 1

    def _one(self, kind: str, snap: dict, at: float) -> None:
        if self.off:  # said when it went off: nothing after that is sent
            return
        if self.ended:
            if kind in ("begin", "step", "eval"):
                with self._count:
                    self.late += 1
            return
        try:
            self._handle(kind, snap, at)
        except Exception as e:  # noqa: BLE001 - any failure of a tracker leaves training be
            self._give_up(redact(f"{type(e).__name__}: {e}")[:400])

    def _handle(self, kind: str, snap: dict, at: float) -> None:
        t = self.tracker
        if kind == "owned":
            _retry(lambda: t.start(self.params, self.ids))
            self.started = True
        elif not self.started:
            return
        elif kind == "begin":
            _retry(lambda: t.begin(snap["step"]))
        elif kind in ("step", "eval"):
            step, values = measured(kind, snap)
            if values:
                _retry(lambda: t.metrics(step, values, at))
        elif kind == "phase" and snap["phase"] in ("succeeded", "failed"):
            self.ended = True
            ok = snap["phase"] == "succeeded"
            _retry(lambda: t.finish(ok, snap.get("exportPath") if ok else None))

    def _give_up(self, why: str) -> None:
        """Said once: from now on this run goes on without the tracker."""
        with self._said:
            if self.off:
                return
            self.off = True
        message = f"tracking: {self.tracker.name} is off for this run: {why}; training goes on"
        self.log(message)
        self.warnings.add(message)


def _events(n: int) -> str:
    return f"{n} event" if n == 1 else f"{n} events"


def _retry(call):
    for attempt in range(TRIES):
        try:
            return call()
        except Exception:  # noqa: BLE001 - the last failure is raised, named by the sender
            if attempt == TRIES - 1:
                raise
            time.sleep(2**attempt)


class _Mlflow:
    """One MLflow run per job (MlflowClient: no process-wide active run)."""

    name = "mlflow"

    def __init__(self, cfg: MlflowSpec, job: str, job_dir: Path):
        self.cfg, self.job, self.job_dir = cfg, job, job_dir
        self.run_id: str | None = None
        # The highest step the run already holds, per event: a replayed step is not resent.
        self.held = {"step": 0, "eval": 0}

    def start(self, params: dict[str, str], ids: _Ids) -> None:
        # MLflow's own retries wait minutes by default; ours are bounded (a user's env wins).
        for var, value in (("MAX_RETRIES", "2"), ("BACKOFF_FACTOR", "1"), ("TIMEOUT", "30")):
            os.environ.setdefault(f"MLFLOW_HTTP_REQUEST_{var}", value)
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = self.client = MlflowClient(tracking_uri=self.cfg.tracking_uri)
        kept = ids.get(self.name)
        run = None
        if kept.get("trackingUri") == self.cfg.tracking_uri and kept.get("runId"):
            run = _existing(client, kept["runId"])
        if run is None:
            experiment = client.get_experiment_by_name(self.cfg.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else client.create_experiment(self.cfg.experiment)
            )
            tags = {"ftjob.job": self.job, "ftjob.folder": str(self.job_dir)}
            run = client.create_run(experiment_id, run_name=self.job, tags=tags)
            self.run_id = run.info.run_id
            ids.set(self.name, {"trackingUri": self.cfg.tracking_uri, "runId": self.run_id,
                                "experimentId": experiment_id})  # fmt: skip
        else:
            self.run_id = run.info.run_id
            client.update_run(self.run_id, status="RUNNING")
            for event, key in (("step", STEP_METRICS["loss"]), ("eval", EVAL_METRIC)):
                history = client.get_metric_history(self.run_id, key)
                self.held[event] = max((m.step for m in history), default=0)
        # Parameters are write-once in MLflow: a resumed run adds only those it lacks.
        new = [Param(k, v) for k, v in params.items() if k not in run.data.params]
        for i in range(0, len(new), 100):  # the server's batch limit
            client.log_batch(self.run_id, params=new[i : i + 100])

    def begin(self, step: int) -> None:
        for event, row in reported(self.job_dir, dict(self.held), step):
            self.metrics(*measured(event, row), when(row), event)

    def metrics(self, step: int, values: dict, at: float, event: str | None = None) -> None:
        from mlflow.entities import Metric

        event = event or ("eval" if EVAL_METRIC in values else "step")
        if step <= self.held[event]:
            return
        ms = int(at * 1000)
        metrics = [Metric(k, float(v), ms, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        self.held[event] = step

    def finish(self, ok: bool, export: str | None) -> None:
        if export:
            self.client.set_tag(self.run_id, "ftjob.export", export)
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def _existing(client, run_id: str):
    """The kept run, or None when the server no longer has it (deleted, or a new store)."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return None if run.info.lifecycle_stage == "deleted" else run


class _Wandb:
    """One W&B run per job: its id is chosen and kept before the run starts."""

    name = "wandb"

    def __init__(self, cfg: WandbSpec, job: str, job_dir: Path):
        self.cfg, self.job, self.job_dir = cfg, job, job_dir
        self.run = None

    def start(self, params: dict[str, str], ids: _Ids) -> None:
        import wandb
        from wandb.sdk.lib.runid import generate_id

        where = {"project": self.cfg.project, "entity": self.cfg.entity}
        kept = ids.get(self.name)
        run_id = kept.get("id") if {k: kept.get(k) for k in where} == where else None
        if not run_id:
            run_id = generate_id()
            ids.set(self.name, {**where, "id": run_id})
        # Offline runs (and W&B's own files) go to the job's folder unless WANDB_DIR says.
        folder = None if os.environ.get("WANDB_DIR") else self.job_dir
        settings = wandb.Settings(init_timeout=60, console="off", silent=True)
        self.run = wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            id=run_id,
            name=self.job,
            resume="allow",
            mode=self.cfg.mode,
            dir=folder,
            settings=settings,
        )
        self.run.config.update(params, allow_val_change=True)

    def begin(self, step: int) -> None:
        pass

    def metrics(self, step: int, values: dict[str, float], at: float) -> None:
        if step >= self.run.step:  # W&B refuses a step below the run's (a replayed step)
            self.run.log(values, step=step)

    def finish(self, ok: bool, export: str | None) -> None:
        if export:
            self.run.summary["ftjob.export"] = export
        self.run.finish(exit_code=0 if ok else 1)


class _Tensorboard:
    """Event files in <job folder>/tensorboard, appended to by every run of the job."""

    name = "tensorboard"

    def __init__(self, job_dir: Path):
        self.job_dir, self.folder = job_dir, JobFolder(job_dir).tensorboard
        self.params: dict[str, str] = {}
        self.writer = None

    def start(self, params: dict[str, str], ids: _Ids) -> None:
        self.params = params

    def begin(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # Each run writes a new event file with the whole history: TensorBoard hides what
        # earlier files hold (purge_step 1), this one has the steps up to the checkpoint the
        # run resumes from as the job's progress.jsonl reported them (a killed writer may not
        # have flushed its last events), then its own.
        self.writer = SummaryWriter(str(self.folder), purge_step=1, flush_secs=10)
        table = "\n".join(f"| {k} | {v} |" for k, v in self.params.items())
        self.writer.add_text("spec", "| field | value |\n|---|---|\n" + table, 1)
        for event, row in reported(self.job_dir, {"step": 0, "eval": 0}, step):
            self._add(*measured(event, row), when(row))
        self.writer.flush()

    def metrics(self, step: int, values: dict[str, float], at: float) -> None:
        if self.writer is not None:
            self._add(step, values, at)
            # The writer's own thread writes later (flush_secs): the sender counts a step as
            # sent when this returns, so it returns once the step is in the event file.
            self.writer.flush()

    def _add(self, step: int, values: dict[str, float], at: float) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step, walltime=at)

    def finish(self, ok: bool, export: str | None) -> None:
        if self.writer is not None:
            self.writer.add_text("export", export or "the run failed")
            self.writer.close()
