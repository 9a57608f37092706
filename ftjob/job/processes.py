"""Every process a command started, and ending them all: what ``ftjob run`` leaves behind is
nothing.

A node's agent starts its workers in sessions of their own, a worker may start helpers, and
a process whose parent died is handed to init -- out of reach of a process-group signal. So
``ftjob run`` makes itself the *subreaper* of what it starts (Linux: orphans are handed to it
instead of init) and, to stop a run, signals every descendant it finds in ``/proc``: SIGCONT
first (a stopped process keeps SIGTERM pending until continued), then SIGTERM, and SIGKILL
to whatever is left after the grace period or at once when asked to hurry. Adopted orphans
are reaped, so none lingers as a zombie either.

    python -c "from ftjob.job import processes; print(processes.descendants())"
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Have orphaned descendants handed to this process (Linux); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and len(fields := _stat(int(entry.name))) > 1:
            out[int(entry.name)] = int(fields[1])
    return out


def descendants(root: int | None = None) -> list[int]:
    """Every living descendant of ``root`` (this process by default), parents first."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields from the state on (the command name, which may hold
    spaces and parentheses, ends at the last ")"), or [] if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def started(pid: int) -> int:
    """When ``pid`` started, in clock ticks after boot (0 if there is no such process). With
    its pid it names one process: pids are reused (PID 1 by every container), starts are not."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else 0


def alive(pid: int, since: int = 0) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has) and, given ``since``
    (:func:`started`), the very one that started then rather than a later holder of its pid."""
    fields = _stat(pid)
    if not fields or fields[0] == "Z":
        return False
    return not since or (len(fields) > 19 and int(fields[19]) == since)


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap() -> None:
    """Collect the exit status of adopted orphans (only once this process's own children,
    whose codes it still reads through subprocess, have been waited for)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_all(grace: float, hurry: Callable[[], bool] = lambda: False) -> None:
    """End every descendant: SIGCONT + SIGTERM, then SIGKILL after ``grace`` seconds (or as
    soon as ``hurry()`` says so)."""
    first = [p for p in descendants() if alive(p)]
    _send(first, signal.SIGCONT)
    _send(first, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurry():
        if not any(alive(p) for p in descendants()):
            return
        time.sleep(0.1)
    killed = [p for p in descendants() if alive(p)]
    _send(killed, signal.SIGCONT)  # not needed for SIGKILL, but a debugger's stop is undone
    _send(killed, signal.SIGKILL)
    end = time.monotonic() + 10  # SIGKILL is final; only an uninterruptible sleep delays it
    while time.monotonic() < end and any(alive(p) for p in descendants()):
        time.sleep(0.05)
