"""What a person sees of ``ftjob run``: the trainer's own lines, and a live bar on a terminal.

The trainer's rank 0 prints its log lines (steps, evaluations, checkpoints, resume) to
stdout; warnings and tracebacks go to stderr, which stays in the node's log file. On a
terminal a rich progress bar sits under those lines (step, loss, tokens/s, ETA), fed by
``progress.json``, which rank 0 rewrites on every step; elsewhere (a pipe, CI) the lines
come plain, one per event, and no bar is drawn.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TextIO

from ftjob.api import objectives

# Before rank 0's first progress.json: Python, torch and the trainer are being imported.
IMPORTING = "importing torch and the trainer"
# What each start-up phase is doing, for the bar while no step has been taken.
STARTUP = {
    "starting": "setting up the processes",
    "downloading": "downloading the model",
    "preparing-data": "preparing the data",
    "loading": "loading the model",
}


class Screen:
    """Lines from any thread; :meth:`poll` (the main loop's) moves the bar."""

    def __init__(self, out: TextIO, progress_file: Path, since: float):
        self.out, self.progress_file, self.since = out, progress_file, since
        self.live = out.isatty()
        self._lock = threading.Lock()
        self._bar = None
        self._task = None
        self._seen = 0.0  # mtime of the last progress.json read

    def __enter__(self) -> Screen:
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            console = Console(file=self.out, highlight=False)
            self._bar = Progress(
                TextColumn("{task.description:<9}"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=console,
                transient=True,  # the bar leaves no trace once the run ends
                refresh_per_second=4,
            )
            self._task = self._bar.add_task("starting", total=None, info=IMPORTING)
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None

    def line(self, text: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
            else:
                self.out.write(text + "\n")
                self.out.flush()

    def poll(self) -> None:
        """Move the bar to rank 0's latest snapshot (one written by this run only)."""
        if self._bar is None:
            return
        snap = self._read()
        if snap is None:
            if not self._seen:  # still importing: the seconds say it is not stuck
                waited = time.time() - self.since
                with self._lock:
                    if self._bar is not None:
                        self._bar.update(self._task, info=f"{IMPORTING} ({waited:.0f} s)")
            return
        with self._lock:
            if self._bar is not None:
                self._bar.update(self._task, **bar_fields(snap))

    def _read(self) -> dict | None:
        try:
            mtime = self.progress_file.stat().st_mtime
            if mtime < self.since or mtime == self._seen:
                return None  # a previous run's file, or nothing new
            snap = json.loads(self.progress_file.read_text())
        except (OSError, ValueError):
            return None  # not written yet, or replaced while read: the next poll will do
        self._seen = mtime
        return snap


def bar_fields(snap: dict) -> dict:
    """The bar's description, position and text for one progress snapshot."""
    parts = []
    phase = snap.get("phase") or ""
    if phase in STARTUP and not snap.get("step"):
        parts.append(startup_detail(snap))
    if snap.get("loss") is not None:
        parts.append(f"loss {snap['loss']:.4f}")
    parts += objectives.labelled(snap, "screen")
    if snap.get("tokensPerSecond") is not None:
        parts.append(f"tok/s {snap['tokensPerSecond']:,.0f}")
    if snap.get("etaSeconds") is not None:
        parts.append(f"eta {eta(snap['etaSeconds'])}")
    return {
        "description": snap.get("phase") or "",
        "completed": snap.get("step") or 0,
        "total": snap.get("totalSteps"),
        "info": "  ".join(parts),
    }


def startup_detail(snap: dict) -> str:
    """What a start-up phase is doing: the data stage and its count when preparing."""
    phase = snap.get("phase") or ""
    preparing = snap.get("preparing") or {}
    if phase == "preparing-data" and preparing.get("stage"):
        done, total = preparing.get("records") or 0, preparing.get("total")
        count = f" {done:,}/{total:,} records" if total else f" {done:,} records" if done else ""
        return f"data: {preparing['stage']}{count}"
    return STARTUP.get(phase, "")


def eta(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
