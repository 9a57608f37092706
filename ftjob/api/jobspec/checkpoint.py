"""checkpoint: the shared volume, the job's folder on it, and the cadence of checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from ftjob.api.jobspec.fields import RELATIVE_PATH, RELATIVE_PATH_HINT
from ftjob.api.schema import api_field


@dataclass(kw_only=True)
class VolumeRef:
    """A PersistentVolumeClaim shared by every pod of the job (ReadWriteMany)."""

    claim_name: str = api_field(
        "claimName of a ReadWriteMany PersistentVolumeClaim in the job's namespace.",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        pattern_hint="be a PersistentVolumeClaim name (lowercase letters, digits, '-', '.')",
        max_length=253,
    )


@dataclass(kw_only=True)
class CheckpointSpec:
    """checkpoint: sharded checkpoints on a shared volume; restarts resume from the newest."""

    volume: VolumeRef | None = api_field(
        "volume shared by all pods for checkpoints and the exported model (required when "
        "nodes > 1). Mounted at /ftjob.",
        None,
    )
    path: str | None = api_field(
        "path of the job's folder on the volume (default: <name>-<first 8 characters of the "
        "job's uid>, so a job deleted and created again starts in a new, empty folder; "
        "ftjob run: runs/<name>). A path given here is reused by every job that names it.",
        None,
        pattern=RELATIVE_PATH,
        pattern_hint=RELATIVE_PATH_HINT,
        max_length=256,
    )
    resume_from: str | None = api_field(
        "resumeFrom: a folder on the volume (another job's folder, or one of its "
        "checkpoints/step-N folders) whose newest committed checkpoint this job starts from "
        "while its own folder has none. Read only: the job writes only to its own folder.",
        None,
        pattern=RELATIVE_PATH,
        pattern_hint=RELATIVE_PATH_HINT,
        max_length=256,
    )
    every: int = api_field("every: steps between checkpoints.", 100, minimum=1)
    keep: int = api_field("keep: newest complete checkpoints kept.", 3, minimum=1, maximum=100)
    async_save: bool = api_field(
        "asyncSave writes checkpoints in the background while training continues; each "
        "process then keeps a CPU copy of its share of the checkpoint.",
        False,
    )
    grace_period_seconds: int | None = api_field(
        "gracePeriodSeconds: the pods' terminationGracePeriodSeconds, the time between "
        "SIGTERM (an eviction, a drain, a spot reclaim, a preemption) and SIGKILL, in which "
        "the gang stops at a step boundary and saves a checkpoint there (default: twice the "
        "planner's save time, at least 60; a save that would not fit is skipped and the "
        "previous checkpoint is resumed).",
        None,
        minimum=5,
        maximum=86400,
    )
