"""kopf's operator pause, for the operator's own work queue.

kopf pauses a replica while a peer of higher priority is alive (peering): it closes every
watch stream and stops every daemon, so its own handlers write nothing. The work queue's
workers are not kopf's handlers; they must stand still too, or a standby replica would
reconcile from what it last saw. kopf keeps the pause in one toggle set (on while any reason
to pause holds: a higher peer, a missing peering object) that it hands to its own root tasks
and offers no handler. The daemon killer is one of those tasks, started with the operator
and alive as long as it; its coroutine holds the toggle set as an argument. :func:`find`
reads it from there, once, at start-up, and the operator refuses to start without it rather
than run a queue that peering cannot stop.

kopf offers no public way to know it is paused (kopf 1.45.2: the toggle set is made inside
``spawn_tasks`` and handed to its own tasks only; ``DaemonStoppingReason.OPERATOR_PAUSING``
reaches only a daemon's stop flag), so kopf is pinned to :data:`KOPF_VERSION`, the version
whose internals this reads: in pyproject.toml's ``operator`` extra and constraints.txt (which
the images install from), and the operator refuses to start on another
(:func:`version_error`; tests/unit/test_operator_pause.py holds the three equal).
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any

KOPF_VERSION = "1.45.2"  # the kopf whose task names and arguments find() reads
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


def version_error(installed: str | None = None) -> str | None:
    """Why the operator must not start on the installed kopf (None: it is :data:`KOPF_VERSION`).
    Another version may keep the pause toggle elsewhere, and a queue that peering cannot
    stop lets two replicas act at once."""
    installed = installed or metadata.version("kopf")
    if installed == KOPF_VERSION:
        return None
    return (
        f"kopf {installed} is installed, but the operator reads kopf {KOPF_VERSION}'s internals "
        "to stop its work queue while peering pauses it (operator/pause.py): install "
        f"kopf=={KOPF_VERSION} (pip install -c constraints.txt 'ftjob[operator]')"
    )
