"""The memory of the machine a job runs on, for a CPU job without resources.memory
(``ftjob run``, ``ftjob plan``): what ``parallelism.sharding: auto`` fits against there."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")  # cgroup v2; "max" when unlimited


def memory_bytes() -> float | None:
    """The smaller of the physical memory and this cgroup's limit; None if unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    try:
        limit = CGROUP_LIMIT.read_text().strip()
    except OSError:
        limit = ""
    if limit.isdigit():
        total = min(total, int(limit))
    return float(total) if total > 0 else None
