"""A job's folder: :class:`JobFolder` names every path in it, and the folder's record of the
spec it trains (``<job folder>/spec.json``).

    owner                 who writes here now (ftjob.job.lease)
    spec.json             the spec this folder was trained with (+ its hash)
    hub/                  the Hugging Face cache: model and dataset downloads, fetched once
    sources.json          which downloads the run reads (ftjob.trainer.fetch.sources)
    ../s3-cache/<key>/    s3:// downloads, shared by the volume's jobs (ftjob.trainer.fetch.s3)
    data/<key>/           tokenized, packed, memory-mapped sequences
    compile-cache/        torch.compile's caches (TORCHINDUCTOR_CACHE_DIR): compiled once
    checkpoints/step-N/   committed checkpoints (ftjob.trainer.state.checkpoint)
    logs/                 node-<rank>.log and .termination (ftjob run), nccl/, profile/
                          (FTJOB_PROFILE_STEPS: ftjob.trainer.report.profile)
    tmp/                  TMPDIR of the node's processes (ftjob run)
    progress.json         rank 0's last progress snapshot
    tracking.json, tensorboard/   the trackers' run ids and TensorBoard's event files
    model/                the export (or ``output.path``), written last, atomically
    pushed.json           what was pushed to the Hub

A job folder's checkpoints and export belong to one training run. Continuing them with a
spec that trains differently (another learning rate, data set, seed, batch or world size)
would silently mix two runs, and a finished folder would answer "already trained" for a
model it never trained. So the folder records the spec and the fingerprint of the fields that
change training; ``ftjob run`` and the trainer refuse a spec that differs there, naming the
fields, once a checkpoint or an export depends on the record (a run that failed before its
first checkpoint, on bad data or a download, left nothing to mix: its fixed spec replaces
the record), while what does not change the steps already taken may change freely: how long to
train (maxSteps, epochs), how often to log, evaluate or checkpoint, where and how it runs
(images, scheduling, network, sharding, offload, precision), and what is exported. The export is
swapped in whole (:func:`swap_in_export`): a continued job's older export stays readable
until the new one is complete.

    python -c "from ftjob.job import folder; help(folder)"
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The entries' names are the contract's (spec.output.path may not take one).
from ftjob.api.contract import (
    CHECKPOINTS,
    COMPILE_CACHE,
    COMPLETIONS,
    DATA,
    DOWNLOADS,
    HISTORY,
    LOGS,
    OWNER,
    PROGRESS,
    PUSHED,
    RECORD,
    S3_CACHE,
    SOURCES,
    TENSORBOARD,
    TMP,
    TRACKING,
)
from ftjob.api.jobspec import API_VERSION, KIND, FineTuneJobSpec
from ftjob.api.schema import to_dict
from ftjob.job import atomic

STEP = re.compile(r"^step-(\d{8})$")  # a checkpoint's folder, by its step


@dataclass(frozen=True)
class JobFolder:
    """Every path in one job's folder: nothing else builds them."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def record(self) -> Path:
        return self.root / RECORD

    @property
    def owner(self) -> Path:
        return self.root / OWNER

    @property
    def downloads(self) -> Path:
        """The Hugging Face cache (HF_HOME): model and dataset downloads."""
        return self.root / DOWNLOADS

    @property
    def sources(self) -> Path:
        return self.root / SOURCES

    @property
    def s3_cache(self) -> Path:
        """s3:// downloads, beside the job folders on the volume, so jobs that read the same
        objects share one copy (ftjob.trainer.fetch.s3: one folder per content)."""
        return self.root.parent / S3_CACHE

    @property
    def data(self) -> Path:
        return self.root / DATA

    @property
    def compile_cache(self) -> Path:
        """torch.compile's caches (TORCHINDUCTOR_CACHE_DIR)."""
        return self.root / COMPILE_CACHE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def step(self, step: int) -> Path:
        return step_folder(self.checkpoints, step)

    def has_checkpoints(self) -> bool:
        return any(self.checkpoints.glob("step-*"))

    @property
    def logs(self) -> Path:
        return self.root / LOGS

    @property
    def profile(self) -> Path:
        """A profile of a few steps (ftjob.trainer.report.profile): summary.json, trace.json.
        Under logs/, whose name output.path already may not take."""
        return self.logs / "profile"

    def node_log(self, rank: int) -> Path:
        return self.logs / f"node-{rank}.log"

    def node_termination(self, rank: int) -> Path:
        return self.logs / f"node-{rank}.termination"

    @property
    def nccl_logs(self) -> Path:
        return self.logs / "nccl"

    @property
    def preflight(self) -> Path:
        return self.root / ".preflight"

    @property
    def tmp(self) -> Path:
        return self.root / TMP

    @property
    def progress(self) -> Path:
        return self.root / PROGRESS

    @property
    def tracking(self) -> Path:
        return self.root / TRACKING

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def pushed(self) -> Path:
        return self.root / PUSHED

    @property
    def history(self) -> Path:
        return self.root / HISTORY

    @property
    def completions(self) -> Path:
        """GRPO's sampled completions: a few per logged step, one JSON line each, with their
        prompt and rewards, for a user to read what the model writes."""
        return self.root / COMPLETIONS

    def export(self, spec: FineTuneJobSpec) -> Path:
        """Where the job's export goes: ``output.path`` inside the job folder, else ``model``."""
        return self.root / (spec.output.path or "model")


def step_folder(checkpoints: Path, step: int) -> Path:
    """A checkpoint's folder in a checkpoints folder (this job's, or one a job starts from)."""
    return checkpoints / f"step-{step:08d}"


def writing(final: Path) -> Path:
    """Where a checkpoint (or an export) is written before it is renamed to ``final``: a name
    that no reader takes for a complete one."""
    return final.with_name(f".tmp-{final.name}")


BEING_WRITTEN = writing(Path("step-*")).name  # the checkpoints a crash left half-written


# The spec sections whose fields change what training computes ...
TRAINING_SECTIONS = ("model", "dataset", "method", "training")
# ... except these, which change how long it runs or what it reports, not the steps taken.
SAFE = frozenset(
    {
        "model.attention",  # the same attention, computed by another kernel
        "training.maxSteps",
        "training.epochs",
        "training.logEvery",
        "training.evalEvery",
        "training.activationCheckpointing",  # recomputes the same activations
        "training.compile",  # the same layers, compiled
        # The same fp32 weights and moments, computed at another precision: an fp8 run's
        # checkpoint resumes in bf16 or fp32 and the reverse (trainer/model/float8.py).
        "training.precision",
        "training.fp8Recipe",
    }
)


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flat(inner, f"{prefix}.{key}" if prefix else key, out)
    else:
        out[prefix] = value


def training_fields(spec: FineTuneJobSpec) -> dict[str, Any]:
    """The fields that change training, flat (``training.learningRate``: 3e-3, ...)."""
    full = to_dict(spec)
    out: dict[str, Any] = {}
    for section in TRAINING_SECTIONS:
        _flat(full.get(section, {}), section, out)
    # The batch order and the global batch follow from the number of processes.
    out["resources.worldSize"] = spec.resources.world_size
    return {k: v for k, v in sorted(out.items()) if k not in SAFE}


def fingerprint(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def record(name: str, spec: FineTuneJobSpec) -> dict[str, Any]:
    """The document kept in the folder: the whole spec, and what training depends on."""
    fields = training_fields(spec)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": to_dict(spec),
        "training": fields,
        "fingerprint": fingerprint(fields),
    }


def changes(recorded: dict[str, Any], spec: FineTuneJobSpec) -> list[str]:
    """``spec.X: old -> new`` for each training field that differs from the record."""
    old = recorded.get("training")
    if not isinstance(old, dict):  # a record older than fingerprints: derive from its spec
        from ftjob.api.jobspec import parse_spec

        old = training_fields(parse_spec(recorded.get("spec") or {}))
    # A record written before a field became safe to change still lists it.
    old = {k: v for k, v in old.items() if k not in SAFE}
    new = training_fields(spec)
    if fingerprint(old) == fingerprint(new):
        return []
    missing = object()
    return [
        f"spec.{key}: {_show(old.get(key, missing))} -> {_show(new.get(key, missing))}"
        for key in sorted(set(old) | set(new))
        if old.get(key, missing) != new.get(key, missing)
    ]


def _show(value: Any) -> str:
    return (
        "(unset)"
        if not isinstance(value, str | int | float | bool | list | dict)
        else (json.dumps(value))
    )


def read(folder: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(JobFolder(folder).record.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write(folder: Path, name: str, spec: FineTuneJobSpec, trained_steps: int | None = None):
    """Record ``spec`` (atomically: a reader sees the old record or the new one), keeping
    what the record says of the export unless ``trained_steps`` says it anew."""
    if trained_steps is None:
        old = read(folder) or {}
        # A record replaced by a spec that trains differently says nothing of an export.
        trained_steps = None if old and changes(old, spec) else old.get("trainedSteps")
    doc = record(name, spec)
    if trained_steps is not None:
        doc["trainedSteps"] = trained_steps
    atomic.write_json(JobFolder(folder).record, doc)
    return doc


def trained(folder: Path, recorded: dict[str, Any], spec: FineTuneJobSpec) -> list[str]:
    """What in ``folder`` was trained under its record: its checkpoints and its export (at
    the recorded spec's output.path or ``spec``'s). Empty: nothing depends on the record."""
    jf = JobFolder(folder)
    steps = sorted(int(m[1]) for p in jf.checkpoints.glob("step-*") if (m := STEP.match(p.name)))
    held = [f"checkpoints up to step {steps[-1]}"] if steps else []
    outs = {jf.export(spec)}
    try:
        from ftjob.api.jobspec import parse_spec

        outs.add(jf.export(parse_spec(recorded.get("spec") or {})))
    except (ValueError, TypeError, AttributeError):  # an odd record names no other export
        pass
    held += [f"an export in {out}" for out in sorted(outs) if export_present(out)]
    return held


def conflicts(folder: Path, recorded: dict[str, Any] | None, spec: FineTuneJobSpec) -> list[str]:
    """``spec.X: old -> new`` for each training field that differs from the folder's record,
    when trained state depends on it. A run that failed before its first checkpoint (bad data,
    a download) left nothing a new spec could mix with: fixing the spec and running again
    must simply work."""
    if not recorded:
        return []
    diff = changes(recorded, spec)
    return diff if diff and trained(folder, recorded, spec) else []


def refusal(folder: Path, diff: list[str], fix: str, held: list[str] | None = None) -> str:
    """The message for a folder whose record differs in ``diff`` (``held``: what was trained
    with the record, the reason the change is refused)."""
    what = f" ({', '.join(held)})" if held else ""
    lines = [
        f"{folder} holds a run trained with another spec{what}; continuing it would mix two runs:",
        *(f"  {line}" for line in diff),
        fix,
    ]
    return "\n".join(lines)


def claim(folder: Path, name: str, spec: FineTuneJobSpec, writer: bool) -> dict[str, Any]:
    """At the start of every training process: refuse a folder recorded with a spec that
    trains differently (every rank reads and decides alike); the writer (rank 0) records
    ``spec``. Returns the record; its ``trainedSteps`` is how many steps the export holds (a
    run asked for more trains on from the newest checkpoint instead of stopping)."""
    from ftjob.api.contract import BAD_SPEC, TrainerError

    recorded = read(folder) or {}
    diff = conflicts(folder, recorded, spec)
    if diff:
        fix = (
            "Create the job under another name, set spec.checkpoint.path to a new folder, "
            "or remove this folder to start over."
        )
        held = trained(folder, recorded, spec)
        raise TrainerError(refusal(folder, diff, fix, held), reason=BAD_SPEC, where="spec")
    if recorded and changes(recorded, spec):
        recorded = {}  # nothing was trained with it: the new spec replaces it (write's rule)
    if writer:
        return write(folder, name, spec)
    return {**record(name, spec), **{k: v for k, v in recorded.items() if k == "trainedSteps"}}


# ------------------------------------------------------------------------------ the export
# A continued job (maxSteps raised after its export) writes a new export over the old one.
# The old one must stay readable until the new one is complete, and a crash at any instant
# must leave one complete export where people and the next run look for it.


def _aside(out: Path) -> Path:
    return out.with_name(f".old-{out.name}")


def recover_export(out: Path) -> None:
    """Undo a swap cut short between its two renames: the previous export was moved aside and
    the new one never moved in, so put the previous one back (it is complete: it is only
    ever deleted once the new one is in place). Run by the folder's one writer."""
    old = _aside(out)
    if old.is_dir() and not out.exists():
        old.rename(out)


def export_path(job_dir: Path, spec: FineTuneJobSpec) -> Path:
    """Where the job's export goes: ``output.path`` inside the job folder, else ``model``."""
    return JobFolder(job_dir).export(spec)


def finished(spec: FineTuneJobSpec, recorded: dict, out: Path) -> bool:
    """Whether the folder's run is done for ``spec``: the export exists and the folder's record
    says it holds at least maxSteps steps (any, when the job trains for epochs). The trainer
    answers "already trained" by this rule, and ``ftjob run`` before starting any process."""
    asked = spec.training.max_steps
    trained = recorded.get("trainedSteps") or 0
    return export_present(out) and (asked is None or trained >= asked)


def export_present(out: Path) -> bool:
    """Whether the folder holds a complete export (in place, or aside after a crash). Asks
    for the aside copy first: if the writer moves it back meanwhile, ``out`` exists after."""
    return _aside(out).is_dir() or out.exists()


def swap_in_export(new: Path, out: Path) -> None:
    """Put the complete export ``new`` at ``out``: the old export is renamed aside, the new
    one renamed in, and only then is the old one removed. Each rename is atomic, so at every
    instant one complete export is at ``out`` or aside (see :func:`recover_export`)."""
    old = _aside(out)
    recover_export(out)  # an earlier crash's aside copy may be the only complete export
    shutil.rmtree(old, ignore_errors=True)  # else it is the half-removed rest of a finished swap
    if out.exists():
        out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------ the push
# output.push uploads the export to each destination after training. What was pushed where is
# recorded beside the spec, one record per destination, so a rerun of a finished job pushes
# only where it is not done yet (a push failed, a destination was added or changed, or a
# continued job replaced the export) and trains nothing.


def pushed(folder: Path) -> dict[str, dict[str, Any]]:
    """Destination -> the record of the latest push there from this folder (empty: none). A
    record without ``commitUrl`` is a push decided not to happen (output.promoteWhen)."""
    try:
        value = json.loads(JobFolder(folder).pushed.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(value, dict):
        return {}
    if "repo" in value:  # written before output.push listed destinations: one record
        return {value["repo"]: value}
    pushes = value.get("pushes")
    return pushes if isinstance(pushes, dict) else {}


def push_key(spec: FineTuneJobSpec, recorded: dict[str, Any], destination: str) -> dict[str, Any]:
    """What a push uploads: the destination, and which export (its path and the steps it
    holds)."""
    return {
        "repo": destination,
        "export": spec.output.path or "model",
        "trainedSteps": recorded.get("trainedSteps"),
    }


def pending_pushes(spec: FineTuneJobSpec, folder: Path, recorded: dict[str, Any]) -> list[str]:
    """The destinations of output.push whose upload of the folder's export is not yet done."""
    done = pushed(folder)

    def is_done(where: str) -> bool:
        record = done.get(where, {})
        return {k: record.get(k) for k in ("repo", "export", "trainedSteps")} == push_key(
            spec, recorded, where
        )

    return [where for where in spec.output.push or [] if not is_done(where)]


def push_pending(spec: FineTuneJobSpec, folder: Path, recorded: dict[str, Any]) -> bool:
    return bool(pending_pushes(spec, folder, recorded))


def record_push(
    folder: Path, spec: FineTuneJobSpec, recorded: dict[str, Any], destination: str, **found
) -> dict:
    """Record a push to ``destination`` that completed (``found``: its commit URL, revision,
    ...), or was decided against, atomically, keeping the other destinations' records."""
    doc = {**push_key(spec, recorded, destination), **found}
    pushes = {**pushed(folder), destination: doc}
    atomic.write_json(JobFolder(folder).pushed, {"pushes": pushes})
    return doc
