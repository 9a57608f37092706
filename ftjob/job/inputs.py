"""PURE but for reading this machine's files: a local job's inputs, checked before torch starts.

``ftjob run`` calls :func:`missing` before it launches any process, so a mistyped model or
data path is named in a moment with its field and fix, not after the trainer's 10-20 s of
imports; and :func:`already_trained` answers a rerun of a finished job without starting torch.
The trainer keeps its own checks (pods on a cluster read the volume, not this machine), and
resolves relative paths the same way: beside the job file (FTJOB_SOURCE_ROOT).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import FieldError
from ftjob.api.source import Hub, Local, parse
from ftjob.job import folder as jobfolder
from ftjob.job import modelfiles
from ftjob.job.folder import JobFolder

# What to change when a local source is missing (the trainer's own checks say the same).
MODEL_FIX = modelfiles.MODEL_FIX
DATA_FIX = (
    "set spec.dataset.source to an existing file or folder (a relative path is read beside "
    "the job file, or from the volume on a cluster), or hf://org/name"
)


def resolve(source: str, root: Path | None = None) -> str:
    """hf://org/name -> org/name for the Hub; a relative path -> beside ``root``, the job
    file's folder (default FTJOB_SOURCE_ROOT: what the trainer is told it is; else here); an
    s3:// URL as it is (sources.fetch puts a local copy in its place before anything reads)."""
    found = parse(source)
    if isinstance(found, Hub):
        return found.repo
    if isinstance(found, Local):
        return str(found.at(root or os.environ.get("FTJOB_SOURCE_ROOT", ".")))
    return source


def _local(source: str, root: Path) -> Path | None:
    """The path a local source names (None for a Hub or object store source)."""
    found = parse(source)
    return found.at(root) if isinstance(found, Local) else None


def missing(spec: FineTuneJobSpec, root: Path, job_dir: Path | None) -> list[FieldError]:
    """Every local input of ``spec`` that is not there; ``root`` is the job file's folder.

    ``job_dir`` is the job folder (None: a fresh one); checkpoint.resumeFrom is read only
    while it holds no checkpoint, as the trainer does, so only then must it exist.
    """
    out = []
    model = _local(spec.model.source, root)
    # The trainer's own check: a folder with config.json and safetensors weights.
    if model is not None and (found := modelfiles.folder_problem(model, spec.model.source)):
        out.append(FieldError("spec.model.source", found[0], fix=found[1]))
    data = _local(spec.dataset.source, root)
    if data is not None and not data.exists():
        out.append(
            FieldError(
                "spec.dataset.source",
                f"{spec.dataset.source}: no such file or folder (looked at {data})",
                fix=DATA_FIX,
            )
        )
    seed = spec.checkpoint.resume_from
    fresh = job_dir is None or not JobFolder(job_dir).has_checkpoints()
    if seed and fresh and not (path := _local(seed, root)).is_dir():
        out.append(
            FieldError(
                "spec.checkpoint.resumeFrom",
                f"{seed}: no such folder (looked at {path})",
                fix="name another job's folder or one of its checkpoints/step-N folders (a "
                "relative path is read beside the job file), or remove resumeFrom",
            )
        )
    return out


def already_trained(
    spec: FineTuneJobSpec, job_dir: Path, recorded: dict[str, Any] | None
) -> Path | None:
    """The export, if the job folder's run is finished for ``spec``; else None.

    The trainer's own rule (:func:`ftjob.job.folder.finished`), and
    progress.json must say so too: a gang killed after its export but before its last
    progress update is left to the trainer, which completes the record.
    """
    out = jobfolder.export_path(job_dir, spec)
    if not jobfolder.finished(spec, recorded or {}, out) or not out.is_dir():
        return None
    if jobfolder.push_pending(spec, job_dir, recorded or {}):
        return None  # trained, not yet pushed where output.push says: the trainer pushes
    try:
        snap = json.loads(JobFolder(job_dir).progress.read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(snap, dict) and snap.get("phase") == "succeeded" else None
