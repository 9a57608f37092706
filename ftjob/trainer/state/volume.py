"""Write errors on the job's volume, named: a full disk is a diagnosis, not a traceback.

torch.distributed.checkpoint gathers each rank's failure into a ``CheckpointException``
(a BaseException); the OSError that matters (ENOSPC, EDQUOT, EIO, ...) is somewhere inside.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from ftjob.api.contract import DISK_FULL, TrainerError

FULL = (errno.ENOSPC, errno.EDQUOT)
MIN_FREE = 1 << 20  # a failed write with less than this left: the volume is full


def os_error(error: BaseException | None, _seen: int = 0) -> OSError | None:
    """The OSError behind ``error``: itself, a DCP rank's failure, or its cause."""
    if error is None or _seen > 8:
        return None
    if isinstance(error, OSError):
        return error
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):  # CheckpointException: rank -> (exception, traceback)
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) else value
            if isinstance(inner, BaseException) and (found := os_error(inner, _seen + 1)):
                return found
    if "os error 28" in str(error) or "No space left on device" in str(error):
        # safetensors (Rust) reports I/O errors as its own exception, with the OS's text.
        return OSError(errno.ENOSPC, "No space left on device")
    return os_error(error.__cause__ or error.__context__, _seen + 1)


def size_of(path: Path | None) -> int | None:
    if path is None or not path.exists():
        return None
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def root_error(error: BaseException) -> BaseException:
    """The first rank's own exception inside a CheckpointException, else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return error


def summary(error: BaseException) -> str:
    inner = root_error(error)
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[-1] if text else ''}"[:300]


def write_failed(
    error: BaseException, what: str, where: Path, other_reason: str, needed: int | None = None
) -> TrainerError | None:
    """A TrainerError for a failed write of ``what`` under ``where`` (None: not a write
    error). Call it before removing what the write left: a full volume is told by ENOSPC, or,
    where a library lost the errno (torch's zip writer says "unexpected pos"), by less room
    left than the write needed. Any other OSError is ``other_reason``."""
    cause = os_error(error)
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    short = free is not None and free < max(needed or 0, MIN_FREE)
    if (cause is not None and cause.errno in FULL) or short:
        need = f"; it needs about {human(needed)}" if needed else ""
        return TrainerError(
            f"{what}: no space left on the volume holding {where} ({human(free)} free{need}). "
            "Free space or enlarge the volume, then run again: training resumes from the "
            "last complete checkpoint.",
            reason=DISK_FULL,
            where=str(where),
        )
    if cause is None:
        return None
    return TrainerError(
        f"{what}: writing to {where} failed: {cause.strerror or cause} "
        f"(errno {cause.errno}, {human(free)} free)",
        reason=other_reason,
        where=str(where),
    )
