"""End what a kit step left running, by pid: every process whose environment carries the step's
tag (bench/gpu_kit/run.sh sets KIT_STEP to a fresh value for each step).

    python -m bench.gpu_kit.reap TAG

A step's time limit signals its process group, but torch's agent starts each trainer rank in
a session of its own, and TRL's ranks can outlive torchrun: they would hold the GPU into the
next step. The tag is inherited by every descendant, so this finds them however they were
started, and never a process the kit did not start. SIGTERM, then SIGKILL after a grace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

VARIABLE = "KIT_STEP"


def tagged(tag: str) -> list[int]:
    """Pids (not this process's) whose environment has KIT_STEP=tag."""
    wanted = f"{VARIABLE}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if wanted in environ:
            found.append(int(entry.name))
    return sorted(found)


def reap(tag: str, grace: float = 5.0) -> list[int]:
    """Signal the tagged processes (TERM, then KILL those left after ``grace`` s); their pids."""
    first = tagged(tag)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = tagged(tag)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = tagged(tag)
        if not left:
            break
    return first


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0]:
        print("usage: python -m bench.gpu_kit.reap TAG", file=sys.stderr)
        return 2
    ended = reap(argv[0])
    if ended:
        print(f"reap: ended {len(ended)} leftover process(es) of step {argv[0]}: {ended}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
