"""Where a run's start-up went: wall seconds of each phase from the process's start to the end
of its first optimizer step, said once in the log and kept in progress (``startup``).

    start-up 34.1 s: imports 14.7, rendezvous 0.6, download 0.0, data 11.8, load 0.2, shard 5.6,
    resume 0.0, first step 1.2

(the tiny example on a 2-core machine under a load average of 13).

The phases follow one another, so they add up to the total: each is the time since the one
before it ended. The trainer's modules import at their top only what start-up itself runs
(torch, the process group); a library a later phase needs is imported where it is first used
and counted in that phase, not in ``imports`` (tests/unit/test_startup_imports.py keeps it
so). In the tiny example ``data`` imports transformers (and through it torch._dynamo and
FSDP), pyarrow, datasets and trl; ``shard`` the model classes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# In the order a run passes through them (train.py marks each end; Progress the first step's).
PHASES = (
    "imports",  # the interpreter, torch and the trainer's modules, to the start of train.run
    "rendezvous",  # the process group, the heartbeat, the preflight and the job folder's lease
    "download",  # hf:// model and data sources fetched to the volume (0 for local sources)
    "data",  # the tokenizer, and the data prepared (or memory-mapped) on the volume
    "load",  # every rank reading its part of the weights
    # the model built on the meta device (transformers' model classes imported) and sharded,
    # the optimizer beside it, and the wait for the gang's slowest rank to have loaded
    "shard",
    "resume",  # the objective's preparation (DPO's reference) and the checkpoint resumed from
    "first step",  # the first optimizer step, its first batch included
)


def process_age() -> float:
    """Seconds since this process started (Linux's /proc), so that ``imports`` holds the
    interpreter's own start-up too; 0 where that cannot be read."""
    try:
        # Field 22 of /proc/self/stat, counted after the command name (which may hold spaces).
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # clock ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class Startup:
    """The phases' seconds so far; ``age``: how long the process ran before this was made."""

    def __init__(self, age: float | None = None):
        now = time.monotonic()
        self.began = now - (process_age() if age is None else age)
        self._last = self.began
        self.seconds: dict[str, float] = {}
        self.finished = False
        self.ended_at: float | None = None  # Unix time of the first step's end

    def mark(self, phase: str, within: tuple[str, float] | None = None) -> None:
        """``phase`` ended now: it took the time since the previous mark. ``within``: (name,
        seconds) of a part of that time measured by the code itself, given to that phase."""
        now = time.monotonic()
        spent = now - self._last
        if within is not None:
            name, part = within
            part = min(max(part, 0.0), spent)
            self.seconds[name] = self.seconds.get(name, 0.0) + part
            spent -= part
        self.seconds[phase] = self.seconds.get(phase, 0.0) + spent
        self._last = now

    def finish(self) -> None:
        """The first step is done: start-up is over."""
        self.mark("first step")
        self.finished = True
        self.ended_at = time.time()

    @property
    def total(self) -> float:
        return self._last - self.began

    def record(self) -> dict:
        """progress's ``startup``: the total and every phase, in seconds, and when the first
        step ended (Unix time: what a launcher's clock compares with, as bench/startup.py)."""
        phases = {p: round(self.seconds.get(p, 0.0), 2) for p in PHASES}
        ended = None if self.ended_at is None else round(self.ended_at, 3)
        return {"seconds": round(self.total, 2), "phases": phases, "endedAt": ended}

    def line(self) -> str:
        phases = ", ".join(f"{p} {self.seconds.get(p, 0.0):.1f}" for p in PHASES)
        return f"start-up {self.total:.1f} s: {phases}"
