"""One work queue for every job, as controller-runtime's: keys in, a fixed pool of workers out.

A key queued twice before a worker takes it is reconciled once; a key queued while a worker
holds it is reconciled again once that worker is done (never by two workers at once). Each
key's next look (a resync, a deadline) waits in one heap served by one timer of the event
loop, not in a task or a timer per key: at a thousand jobs the queue holds a set entry, a
deque entry and a heap entry per job, and nothing else.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Hashable


class WorkQueue:
    """Deduplicated keys for workers (:meth:`get` / :meth:`done`), and their requeues."""

    def __init__(self) -> None:
        self._order: deque[Hashable] = deque()
        self._queued: set[Hashable] = set()
        self._active: set[Hashable] = set()  # held by a worker now
        self._again: set[Hashable] = set()  # queued while held: queued again when done
        self._waiters: deque[asyncio.Future] = deque()  # workers waiting for a key
        self._due: dict[Hashable, float] = {}  # each key's earliest requeue (loop time)
        self._heap: list[tuple[float, int, Hashable]] = []  # (when, tiebreak, key), stale ok
        self._count = 0
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._order)

    def add(self, key: Hashable) -> None:
        """Reconcile ``key`` soon; a no-op if it is already waiting for a worker."""
        if key in self._active:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._order.append(key)
            self._wake_one()

    def add_after(self, key: Hashable, seconds: float) -> None:
        """Reconcile ``key`` in ``seconds``, unless an earlier requeue is already due."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(seconds, 0.0)
        if self._due.get(key, float("inf")) <= when:
            return
        self._due[key] = when
        self._count += 1
        heapq.heappush(self._heap, (when, self._count, key))
        if self._heap[0][2] == key and self._heap[0][0] == when:
            self._arm(loop)

    def forget(self, key: Hashable) -> None:
        """No more requeues of ``key`` (its object is gone); a worker holding it finishes."""
        self._due.pop(key, None)
        self._again.discard(key)
        if key in self._queued:
            self._queued.discard(key)
            self._order.remove(key)

    def clear(self) -> None:
        """Forget every key (the operator paused: what it knew may be stale when it resumes)."""
        for key in list(self._queued | set(self._due)):
            self.forget(key)
        self._heap.clear()

    async def get(self) -> Hashable:
        """The next key, held by the caller until :meth:`done`."""
        while not self._order:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the key is another worker's
                raise
        key = self._order.popleft()
        self._queued.discard(key)
        self._active.add(key)
        return key

    def done(self, key: Hashable) -> None:
        self._active.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """One loop timer, at the heap's earliest entry."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(self._heap[0][0], self._fire) if self._heap else None

    def _fire(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time() + 0.001  # the loop may run a timer up to its clock's resolution early
        while self._heap and self._heap[0][0] <= now:
            when, _, key = heapq.heappop(self._heap)
            if self._due.get(key) == when:  # not superseded by an earlier one, nor forgotten
                del self._due[key]
                self.add(key)
        self._timer = None
        self._arm(loop)
