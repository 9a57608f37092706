"""Each rank's heartbeat in the rendezvous store: who stopped answering when a collective
times out.

A collective that times out says only that *this* rank waited too long (gloo: ``Timed out
waiting 30000ms for send operation``; NCCL's watchdog alike), not for whom. So every rank
keeps ``ftjob/heartbeat/<rank>`` in the gang's store (node 0's agent serves it, beside the
rendezvous) up to date from a thread: its last step, when it ended, and when the thread last
beat (every few seconds, and after a step at most once a second). A rank frozen whole
(SIGSTOP, a dead node) stops beating; the rank whose collective timed out reads every
heartbeat and names those older than ``STALE_BEATS`` beats in its termination record
(:func:`silent`, :func:`describe_silent`).

The thread beats while the training thread waits in a collective, so a rank stuck inside a
kernel or a hung collective keeps beating and is told apart by its step instead: the ranks
furthest behind are named when none went silent.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from datetime import timedelta

STALE_BEATS = 3  # a heartbeat this many intervals old: the rank stopped answering
MIN_SPACING = 1.0  # seconds between a rank's beats at most once a second, however fast it steps
PREFIX = "ftjob/heartbeat/"


def interval_for(collective_timeout: float) -> float:
    """Beat often enough that a silent rank is stale well before a collective times out."""
    return max(0.5, min(5.0, collective_timeout / (2 * STALE_BEATS)))


def _store(timeout: float):
    """A client of the gang's store (MASTER_ADDR:MASTER_PORT), or None without one."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError):  # no store there: heartbeats are a help, not a need
        return None


class Heartbeat:
    """This rank's heartbeat; the training loop says each step done (:meth:`at`). Its thread
    beats as long as the process lives (a daemon: the process's end is the heartbeat's)."""

    def __init__(self, rank: int, world: int, node: str, interval: float):
        self.rank, self.world, self.node, self.interval = rank, world, node, interval
        self.step = 0
        self._store = _store(timeout=max(5.0, 2 * interval))
        self._wake = threading.Event()
        self._last = 0.0
        self._thread = None
        if self._store is not None:
            self._beat()
            self._thread = threading.Thread(target=self._run, daemon=True, name="ftjob-beat")
            self._thread.start()

    def at(self, step: int) -> None:
        """A step is done: the thread tells the store soon (at most once a second, never
        from the training thread)."""
        self.step = step
        if time.time() - self._last >= MIN_SPACING:
            self._wake.set()

    def _beat(self) -> None:
        self._last = time.time()
        value = {"step": self.step, "at": self._last, "node": self.node, "pid": os.getpid()}
        with contextlib.suppress(Exception):  # a store gone (node 0 lost): nothing to tell
            self._store.set(f"{PREFIX}{self.rank}", json.dumps(value))

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            self._beat()

    def read(self) -> dict[int, dict]:
        """Every rank's last heartbeat that the store holds (rank -> beat)."""
        if self._store is None:
            return {}
        try:
            return read(self._store, self.world)
        except Exception:  # noqa: BLE001 - the store is gone: one timeout, not one per rank
            return {}


def read(store, world: int) -> dict[int, dict]:
    """Every rank's heartbeat in ``store`` (rank -> beat), in two round trips of the store
    when every rank has beaten, as it has by the time a collective times out: the gang may be
    thousands of ranks, each reading while it fails. A ``multi_get`` of a key never set waits
    for the store's timeout, so when one is missing each key is checked first."""
    keys = [f"{PREFIX}{rank}" for rank in range(world)]
    ranks = list(range(world))
    if not store.check(keys):
        ranks = [rank for rank in ranks if store.check([keys[rank]])]
    if not ranks:
        return {}
    values = store.multi_get([keys[rank] for rank in ranks])
    return {rank: json.loads(value) for rank, value in zip(ranks, values, strict=True)}


def silent(beats: dict[int, dict], world: int, now: float, interval: float) -> list[int]:
    """Ranks whose heartbeat is stale (or missing while others beat): they stopped
    answering. PURE."""
    if not beats:
        return []
    limit = STALE_BEATS * interval
    return [r for r in range(world) if r not in beats or now - beats[r]["at"] > limit]


def behind(beats: dict[int, dict]) -> list[int]:
    """Ranks at the lowest step when others are further on (all beating). PURE."""
    steps = {r: b["step"] for r, b in beats.items()}
    if not steps or len(set(steps.values())) == 1:
        return []
    low = min(steps.values())
    return sorted(r for r, s in steps.items() if s == low)


def describe_silent(beats: dict[int, dict], world: int, now: float, interval: float) -> str:
    """Who the gang was waiting for, as a sentence ("" when the heartbeats cannot tell)."""

    def who(rank: int) -> str:
        beat = beats.get(rank)
        if beat is None:
            return f"rank {rank} (no heartbeat)"
        return (
            f"rank {rank} (node {beat['node']}, pid {beat['pid']}): last heartbeat "
            f"{now - beat['at']:.0f} s ago, at step {beat['step']}"
        )

    gone = silent(beats, world, now, interval)
    if gone:
        return "stopped answering: " + "; ".join(who(r) for r in gone)
    late = behind(beats)
    if late:
        return "waiting for the ranks furthest behind: " + "; ".join(who(r) for r in late)
    return ""


_current: Heartbeat | None = None  # this process's heartbeat, for the failure record


def start(rank: int, world: int, node: str, collective_timeout: float) -> Heartbeat:
    global _current
    _current = Heartbeat(rank, world, node, interval_for(collective_timeout))
    return _current


def explain() -> str:
    """Who stopped answering, from this process's heartbeat store ("" if unknown)."""
    if _current is None:
        return ""
    beat = _current
    return describe_silent(beat.read(), beat.world, time.time(), beat.interval)
