"""The trainer's termination record: what an exception means, and the file that says so.

:func:`classify` names a failure (ftjob.api.contract's reasons) from the exception that ended the
run; :func:`write` puts a record into ``FTJOB_TERMINATION_LOG`` -- the container's
terminationMessagePath on a cluster, ``<job>/logs/node-<rank>.termination`` under
``ftjob run``. Every process of a pod shares that file, so writes are serialised with a lock
and :func:`ftjob.api.contract.keep` decides which record stays.
"""

from __future__ import annotations

import errno
import fcntl
import os
import traceback
from pathlib import Path
from typing import Any

from ftjob.api import contract
from ftjob.trainer.gang import heartbeat
from ftjob.trainer.report import secrecy

# The CPU allocator's message when a tensor cannot get host memory (torch raises a plain
# RuntimeError for it, where Python's own allocations raise MemoryError).
_HOST_ALLOC = "DefaultCPUAllocator: can't allocate memory"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# A collective whose peer went away: gloo's transport raises a plain RuntimeError for it
# ("Connection closed by peer", "Connection reset by peer"). It is what this rank saw of
# another's failure, not a failure of its own, so it is a collective's error (NCCLError), which
# a peer's own cause outranks (contract.SPECIFICITY); Internal would call it a bug of ours.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
_PACKAGE = str(Path(__file__).resolve().parents[1])


def classify(exc: BaseException) -> tuple[str, str, str | None]:
    """(reason, message, where) for the exception that ended the run.

    The exception and its causes are all looked at, and the most telling name wins
    (contract.SPECIFICITY): an export that failed because the disk was full is DiskFull. What
    names nothing is Internal, with the exception's last line and the trainer line that raised
    it.
    """
    named = [(n, e) for e in _chain(exc) if (n := _name(e)) is not None]
    if not named:
        return contract.INTERNAL, _last_line(exc), _where(exc)
    (reason, where), e = min(named, key=lambda item: contract.rank_of(item[0][0]))
    if isinstance(e, contract.TrainerError):
        return reason, _last_line(e), where  # its message names the file, line or field
    return reason, _last_line(e), where or _where(e)


def _name(e: BaseException) -> tuple[str, str | None] | None:
    # torch here, not at the top: a node's first moments (ftjob.trainer.node) write records
    # before torch is loaded, and only an exception raised after it loaded can be torch's.
    import torch
    import torch.distributed as dist

    if isinstance(e, contract.TrainerError):
        return e.reason, e.where
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and _HOST_ALLOC in str(e)):
        return contract.HOST_OOM, None
    if isinstance(e, torch.OutOfMemoryError):
        return contract.CUDA_OOM, None
    if isinstance(e, OSError) and e.errno in _DISK_FULL:
        return contract.DISK_FULL, e.filename
    # A timeout by the words the operator reads in a log tail (contract.LOG_SIGNS): NCCL's
    # watchdog, gloo's transport, the store's wait.
    if contract.reason_in_log(f"{type(e).__name__}: {e}") == contract.COLLECTIVE_TIMEOUT:
        return contract.COLLECTIVE_TIMEOUT, None
    if isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and ("NCCL" in str(e) or any(p in str(e) for p in _PEER_GONE))
    ):
        return contract.NCCL_ERROR, None
    if "No space left on device" in str(e):
        return contract.DISK_FULL, None  # torch.save's and dcp's writers report it as text
    return None


def _chain(exc: BaseException):
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _last_line(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    text = lines[-1].strip() if lines else ""
    if isinstance(e, contract.TrainerError):
        return str(e).strip()  # written for people already, every line of it
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _where(e: BaseException) -> str | None:
    """file:line of the innermost ftjob frame (else the innermost frame) that raised ``e``."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return None
    ours = [f for f in frames if f.filename.startswith(_PACKAGE)]
    frame = (ours or frames)[-1]
    name = frame.filename
    if name.startswith(_PACKAGE):
        name = "ftjob" + name[len(_PACKAGE) :]
    return f"{name}:{frame.lineno}"


def failure(
    exc: BaseException, step: int | None = None, progress: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The failure record for ``exc`` raised in this process; ``progress``: rank 0's final
    numbers (contract.final_progress), which the operator shows for the failed job."""
    reason, message, where = classify(exc)
    fix = next((e.fix for e in _chain(exc) if isinstance(e, contract.TrainerError)), None)
    node = next((e.node for e in _chain(exc) if isinstance(e, contract.TrainerError)), None)
    if reason == contract.COLLECTIVE_TIMEOUT:
        # Whom the gang waited for: the heartbeats in the gang's store tell, where they can.
        who = heartbeat.explain()
        if who:
            message = f"{message}; {who}"
    return named(reason, message, where, step, fix, node, progress)


def named(
    reason: str,
    message: str,
    where: str | None = None,
    step: int | None = None,
    fix: str | None = None,
    node: str | None = None,
    progress: dict[str, Any] | None = None,
):
    """A failure record of this process (its rank filled in, and its node unless the failure
    names the node at fault)."""
    return contract.Failure(
        reason=reason,
        message=message,
        rank=int(os.environ.get("RANK", "0")),
        node=node or contract.node_name(),
        step=step,
        where=where,
        fix=fix,
        progress=progress or None,
    ).record()


def write(record: dict[str, Any]) -> None:
    """Put ``record`` in ``FTJOB_TERMINATION_LOG`` (unset: nowhere), unless the file already
    holds a more telling one. The file always holds one whole JSON record."""
    target = os.environ.get("FTJOB_TERMINATION_LOG")
    if not target:
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        # Masked: the record becomes the pod's termination message, then status and Events.
        chosen = contract.keep(contract.parse(f.read()), secrecy.masked(record))
        f.seek(0)
        f.truncate()
        f.write(contract.dumps(chosen))
        f.flush()
