"""kopf's operator pause, for the operator's own work queue.

kopf pauses a replica while a peer of higher priority is alive (peering): it closes every
watch stream and stops every daemon, so its own handlers write nothing. The work queue's
workers are not kopf's handlers; they must stand still too, or a standby replica would
reconcile from what it last saw. kopf keeps the pause in one toggle set (on while any reason
to pause holds: a higher peer, a missing peering object) that it hands to its own root tasks
and offers no handler. The daemon killer is one of those tasks, started with the operator
and alive as long as it; its coroutine holds the toggle set as an argument. :func:`find`
reads it from there, once, at start-up, and the operator refuses to start without it rather
than run a queue that peering cannot stop (a kopf that moved it: see the pin in
constraints.txt).
"""

from __future__ import annotations

import asyncio
from typing import Any

KILLER = "daemon killer"  # kopf's name for the task (kopf/_core/reactor/running.py)
ARGUMENT = "operator_paused"


def find() -> Any | None:
    """kopf's pause toggle set (``is_on()`` while paused, ``wait_for(False)``), or None when
    no kopf operator runs in this event loop."""
    for task in asyncio.all_tasks():
        if task.get_name() != KILLER:
            continue
        coro = task.get_coro()
        while coro is not None:  # kopf's guard() wraps the killer: follow its ``coro``
            frame = getattr(coro, "cr_frame", None)
            found = frame.f_locals if frame is not None else {}
            if ARGUMENT in found:
                return found[ARGUMENT]
            coro = found.get("coro") or getattr(coro, "cr_await", None)
    return None


async def resumed(paused) -> None:
    """Returns at once while running; waits while paused."""
    if paused.is_on():
        await paused.wait_for(False)
