"""PURE: the trainer-operator contract. Trainer, operator and ``ftjob run`` import this.

Two documents cross the boundary between a training process and whoever watches it:

* the **termination record**, a small JSON object written to ``FTJOB_TERMINATION_LOG`` (the
  container's terminationMessagePath on a cluster, a file in the job folder under
  ``ftjob run``) when the trainer ends: ``{"outcome": "succeeded", "exportPath": ...}`` or
  ``{"outcome": "failed", "reason": ..., "message": ..., ...}``;
* the **progress document** (``/progress``, ``progress.json``), whose ``phase`` is one of
  :data:`PHASES` from the first second of the run.

The operator decides from the record (retry or not); it reads the log tail only when no
record exists (the process was killed, or crashed below Python).
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import asdict, dataclass
from typing import Any

# ------------------------------------------------------------------------ the job's folder
# What a job's folder holds besides its export, by name: ftjob/job/folder.py's JobFolder
# builds every path from these, and spec.output.path may not name one or lie inside one (the
# export would overwrite it). A new entry is added here and nowhere else.
CHECKPOINTS = "checkpoints"
DATA = "data"
# Model and dataset downloads (the Hugging Face cache, HF_HOME), fetched once. The folder keeps
# the name "hub": job folders already on users' volumes hold their downloads there.
DOWNLOADS = "hub"
LOGS = "logs"
TMP = "tmp"
TENSORBOARD = "tensorboard"
WANDB = "wandb"  # W&B's own files when they go to the job's folder
RECORD = "spec.json"  # the spec the folder trains
OWNER = "owner"  # the lease: who writes here now
SOURCES = "sources.json"  # what hf:// and s3:// sources resolved to
# s3:// downloads: beside the job folders on the volume (shared by jobs), not inside one.
S3_CACHE = "s3-cache"
PROGRESS = "progress.json"
HISTORY = "progress.jsonl"  # one line per logged step
TRACKING = "tracking.json"  # the trackers' run ids
PUSHED = "pushed.json"  # what output.push uploaded
COMPLETIONS = "completions.jsonl"  # GRPO: a few sampled completions per logged step
# torch.compile's caches (TORCHINDUCTOR_CACHE_DIR: inductor's and AOT autograd's compiled
# graphs, generated kernels): a restart or a new gang loads compiled layers from here.
COMPILE_CACHE = "compile-cache"
FOLDER_DIRS = (CHECKPOINTS, DATA, DOWNLOADS, LOGS, TMP, TENSORBOARD, WANDB, COMPILE_CACHE)
FOLDER_FILES = (RECORD, OWNER, SOURCES, PROGRESS, HISTORY, TRACKING, PUSHED, COMPLETIONS)

# Phases in the order a run passes through them; "failed" can follow any of them.
PHASES = (
    "starting",
    "downloading",
    "preparing-data",
    "loading",
    "training",
    "checkpointing",
    "evaluating",
    "exporting",
    "pushing",  # uploading the export to output.push's destinations
    "succeeded",
    "failed",
    # SIGTERM (an eviction, a drain, a spot reclaim, Kueue preemption): the gang stopped at one
    # step boundary, saved there (when the grace period allowed) and ended; not a failure.
    "preempted",
)
# Phases before the first training step: the stall timeout does not apply to them.
STARTUP_PHASES = ("starting", "downloading", "preparing-data", "loading")

# Failure reasons a trainer can name (one CamelCase word, as Kubernetes condition reasons).
BAD_DATA = "BadData"
BAD_MODEL = "BadModel"  # the model source cannot be read (missing folder, bad config, Hub 404)
# The Hub could not be reached for a download (the network, DNS, a timeout, 429 or 5xx), after
# the trainer's own retries: transient, so a new gang may succeed where this one did not.
HUB_UNREACHABLE = "HubUnreachable"
# An s3:// endpoint did not answer after the client's retries: transient, as HubUnreachable.
STORE_UNREACHABLE = "StoreUnreachable"
BAD_SPEC = "BadSpec"  # the job document itself is invalid
# The plan, computed by each training process from the model's own config.json before any
# data is prepared or weight read, says the job will not fit its memory (spec.plan.enforce
# on): the same inputs would run out of memory again, so no door retries it.
WILL_NOT_FIT = "WillNotFit"
CUDA_OOM = "CudaOOM"
HOST_OOM = "HostOOM"
# A collective (NCCL or gloo) that waited longer than network.collectiveTimeoutSeconds; the
# message names the rank (and node) that stopped answering when the heartbeats tell.
COLLECTIVE_TIMEOUT = "CollectiveTimeout"
NCCL_TIMEOUT = "NCCLTimeout"  # written by trainers before CollectiveTimeout; still understood
NCCL_ERROR = "NCCLError"
DISK_FULL = "DiskFull"
CHECKPOINT_UNREADABLE = "CheckpointUnreadable"
EXPORT_FAILED = "ExportFailed"
# The upload of the export to output.push failed, whatever the destination (the Hub or an
# s3:// prefix): the message names it. The export stays, and a rerun only pushes.
PUSH_FAILED = "PushFailed"
HUB_PUSH_FAILED = "HubPushFailed"  # written by trainers before PushFailed; still understood
OWNED_ELSEWHERE = "JobFolderBusy"  # another run owns the job folder
# The preflight's findings (ftjob.trainer.gang.preflight), before any weight is read:
NODE_UNHEALTHY = "NodeUnhealthy"  # a GPU of this node is slow, short of memory or broken
FABRIC_MISCONFIGURED = "FabricMisconfigured"  # the gang's all-reduce is far below the fabric's
VOLUME_UNUSABLE = "VolumeUnusable"  # the job's volume cannot be written and read back
INTERNAL = "Internal"

# What a log says when its process left no record (killed, or crashed below Python): read
# from a pod's log tail by the operator and from a node's log by `ftjob run`.
LOG_SIGNS = (
    (re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED"), CUDA_OOM),
    # NCCL's watchdog, gloo's transport ("Timed out waiting 30000ms for send operation"), and
    # the store's wait for a key a peer never set (at the process group's start).
    (
        re.compile(
            r"Watchdog caught collective operation timeout|NCCL.{0,80}(timed out|timeout)"
            r"|DistBackendError.{0,200}[Tt]imeout|Timed out waiting \d+ms for \w+ operation"
            r"|wait timeout after \d+ms, keys",
            re.S,
        ),
        COLLECTIVE_TIMEOUT,
    ),
)


def reason_in_log(text: str) -> str | None:
    """The failure reason a log's text shows (:data:`LOG_SIGNS`), or None."""
    return next((reason for sign, reason in LOG_SIGNS if sign.search(text)), None)


NODE_NAME_ENV = "FTJOB_NODE_NAME"  # set by the operator from the downward API (spec.nodeName)
# Set by ftjob's node agent (ftjob.trainer.agent) in its workers' environment: the gang's
# restarts in place so far. Absent: no ftjob agent runs the trainer (plain torchrun).
RESTARTS_IN_PLACE_ENV = "FTJOB_RESTARTS_IN_PLACE"


def node_name() -> str:
    """The Kubernetes node this process runs on (the host name outside a cluster)."""
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


REASONS = (
    BAD_DATA,
    BAD_MODEL,
    BAD_SPEC,
    WILL_NOT_FIT,
    HUB_UNREACHABLE,
    STORE_UNREACHABLE,
    CUDA_OOM,
    HOST_OOM,
    COLLECTIVE_TIMEOUT,
    NCCL_TIMEOUT,
    NCCL_ERROR,
    DISK_FULL,
    CHECKPOINT_UNREADABLE,
    EXPORT_FAILED,
    PUSH_FAILED,
    HUB_PUSH_FAILED,
    OWNED_ELSEWHERE,
    NODE_UNHEALTHY,
    FABRIC_MISCONFIGURED,
    VOLUME_UNUSABLE,
    INTERNAL,
)
# Retrying the same inputs cannot help: the operator fails the job at once.
PERMANENT = frozenset({BAD_DATA, BAD_MODEL, BAD_SPEC, WILL_NOT_FIT})
# Restarting the workers in place on the same nodes cannot help either: the preflight found
# these nodes, their fabric or their volume unfit. A new gang (elsewhere, the bad nodes kept
# away) may succeed, so the node agent leaves them to the operator's ladder.
NOT_IN_PLACE = PERMANENT | {NODE_UNHEALTHY, FABRIC_MISCONFIGURED, VOLUME_UNUSABLE}
# When several processes of one pod fail, the record that explains the others wins: the rank
# whose memory ran out, not the ranks whose collectives then timed out waiting for it.
# Earlier in this tuple is more telling.
SPECIFICITY = (
    BAD_SPEC,
    WILL_NOT_FIT,
    BAD_DATA,
    BAD_MODEL,
    HUB_UNREACHABLE,
    STORE_UNREACHABLE,
    CHECKPOINT_UNREADABLE,
    DISK_FULL,
    VOLUME_UNUSABLE,
    NODE_UNHEALTHY,
    CUDA_OOM,
    HOST_OOM,
    OWNED_ELSEWHERE,
    FABRIC_MISCONFIGURED,
    EXPORT_FAILED,
    PUSH_FAILED,
    HUB_PUSH_FAILED,
    INTERNAL,
    NCCL_ERROR,
    COLLECTIVE_TIMEOUT,
    NCCL_TIMEOUT,
)


@dataclass
class Failure:
    """Why a training process stopped, as far as it knows."""

    reason: str
    message: str
    rank: int | None = None
    node: str | None = None
    step: int | None = None
    where: str | None = None  # file:line, or the spec field, when known
    fix: str | None = None  # what to change, when the cause says more than the reason's fix
    progress: dict[str, Any] | None = None  # rank 0's final numbers (final_progress)

    def record(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if v is not None}
        return {"outcome": "failed", **data}


class TrainerError(Exception):
    """A failure the trainer can name. Raise it (or a subclass) anywhere in the trainer; the
    entry point turns it into a termination record without a traceback."""

    reason = INTERNAL

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        where: str | None = None,
        fix: str | None = None,
        node: str | None = None,
    ):
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.where = where
        # The fix for this cause (a field to set, a file to create); None: the reason's own.
        self.fix = fix
        # The node at fault when it is not this process's own (a preflight check that failed on
        # another node fails every rank, and every record names that node); None: this one.
        self.node = node


def success_record(export_path: str, progress: dict[str, Any] | None = None) -> dict[str, Any]:
    rec = {"outcome": "succeeded", "exportPath": export_path}
    return rec | ({"progress": progress} if progress else {})


# The numbers rank 0 ends with, carried in its termination record (key "progress"): the
# operator reads progress from rank 0 every FTJOB_PROGRESS_SECONDS while it runs, and a job
# that ends between two reads would otherwise keep the step, loss and checkpoint of the last
# read (a short job always does). A record holds at most 4096 bytes (the kubelet's limit for a
# termination message), so this is the few numbers `kubectl get ftj` shows, not the snapshot,
# and the push's outcome: the last thing a trainer does, which no read sees before it exits.
FINAL_PROGRESS = ("step", "totalSteps", "loss", "evalLoss", "lastCheckpointStep", "lastCheckpoint",
                  "pushedTo", "promotion")  # fmt: skip


def final_progress(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The part of a progress snapshot a termination record carries (:data:`FINAL_PROGRESS`)."""
    return {k: snapshot[k] for k in FINAL_PROGRESS if snapshot.get(k) is not None}


# ------------------------------------------------------------------------------ preemption
# A signal is a checkpoint: SIGTERM asks the gang to stop at one step boundary and save there.
# Set by the operator from the pod's terminationGracePeriodSeconds (and by `ftjob run`): the
# seconds between SIGTERM and SIGKILL, which the save must fit in.
GRACE_ENV = "FTJOB_GRACE_SECONDS"
# The variables whose values come from Secrets (spec.env's valueFrom, spec.secrets, trackers'
# and the object store's keys), comma-separated names: the trainer masks their values in all
# it prints, logs and records (ftjob.trainer.secrecy). Set by ftjob.job.launch.
SECRET_ENV = "FTJOB_SECRET_ENV"
# A profile of N training steps on rank 0 (ftjob.trainer.report.profile): set by `ftjob run
# --profile-steps N`, or in a job's spec.env.
PROFILE_STEPS_ENV = "FTJOB_PROFILE_STEPS"
# A process (worker or node agent) that stopped for a SIGTERM, saved or not: distinct from a
# failure (1) and from a signal's death (128+n), so that neither torch's agent, `ftjob run`
# nor the operator spends a restart on it.
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again later


class Preempted(Exception):
    """The gang agreed to stop for a SIGTERM at ``step``; ``checkpoint`` is the folder saved
    there, or None when the grace period was too short (the previous one stays newest)."""

    def __init__(self, step: int, checkpoint: str | None, message: str):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


def preempted_record(step: int | None, checkpoint: str | None, message: str) -> dict[str, Any]:
    """The termination record of a process that stopped for a SIGTERM (not a failure);
    ``step`` None: stopped outside the training loop (the node agent writes it)."""
    rec = {"outcome": "preempted", "message": message, "node": node_name(),
           "rank": int(os.environ.get("RANK", "0"))}  # fmt: skip
    if step is not None:
        rec["step"] = step
    if checkpoint is not None:
        rec["checkpoint"] = checkpoint
    return rec


def rank_of(reason: str | None) -> int:
    """How telling a reason is: 0 the most (SPECIFICITY), unknown reasons last."""
    return SPECIFICITY.index(reason) if reason in SPECIFICITY else len(SPECIFICITY)


def keep(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """Which of two records one termination file should hold (several ranks share a pod's).

    A failure beats a success (the pod did fail); of two failures the more telling reason
    wins, and between equally telling ones the first written stays (it came first, the
    others followed from it).
    """
    if old is None or old.get("outcome") != "failed":
        return new
    if new.get("outcome") != "failed":
        return old
    return new if rank_of(new.get("reason")) < rank_of(old.get("reason")) else old


# The kubelet keeps at most 4096 bytes of a termination message: a record cut there is no
# JSON, and its pod would be diagnosed from the log tail instead.
RECORD_LIMIT = 4096


def dumps(record: dict[str, Any]) -> str:
    """The record as the termination file holds it; without its progress numbers when they
    would push it past :data:`RECORD_LIMIT` (the reason and message matter more)."""
    text = json.dumps(record, sort_keys=True)
    if len(text.encode()) > RECORD_LIMIT and "progress" in record:
        text = json.dumps({k: v for k, v in record.items() if k != "progress"}, sort_keys=True)
    return text


def parse(text: str | None) -> dict[str, Any] | None:
    """The record in a termination message, or None (a log tail, or nothing)."""
    try:
        value = json.loads(text or "")
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    if value.get("outcome") in ("succeeded", "failed", "preempted"):
        return value
    if isinstance(value.get("exportPath"), str):  # the record before it had an outcome
        return {"outcome": "succeeded", **value}
    return None
