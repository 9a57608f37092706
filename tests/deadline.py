"""The whole run's deadline. CI stops a run at a hard limit, and a run stopped there prints no
summary: nothing says which test used the time, or why the others failed. `.ci/run` sets
FTJOB_TEST_DEADLINE (seconds since the epoch, minutes short of that limit). A test that would
run past it is cut there by pytest-timeout (its own limit shortened to what is left), and a test
that starts after it fails at once, saying so; the run then ends with its summary. Without the
variable nothing changes. tests/conftest.py calls :func:`shorten` and :func:`refuse`.

The slow tier (tests marked ``slow``: costlier variants of what faster tests show) runs last,
and CI starts a slow test only while the deadline leaves :data:`SLOW_ROOM`: on a fast machine
the whole suite runs, on a slower one the tier stops early and says so in the summary (skipped,
with the seconds left), instead of failing at the deadline. ``python -m pytest -m slow`` runs
the tier whole."""

from __future__ import annotations

import os
import time

import pytest

VARIABLE = "FTJOB_TEST_DEADLINE"
# A slow test starts only with this much of the run left before the deadline: its own 10
# minutes (the slowest took 110 s on a loaded CI machine, and a slow machine is ~2.5x that),
# and the 8 minutes between the deadline (83 minutes into CI's run, .ci/run) and the 75 a CI
# run is kept under. The tier fills what time the core leaves up to that mark, no further.
SLOW_ROOM = 600 + 480


def at() -> float | None:
    value = os.environ.get(VARIABLE)
    return float(value) if value else None


def limit(own: float | None, left: float) -> float:
    """The test's pytest-timeout limit: its own (None or 0: none), at most ``left`` seconds."""
    left = max(left, 1.0)
    return left if not own else min(own, left)


def _own(item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    else:
        value = item.config.getini("timeout")
    return float(value) if value else None


def shorten(item) -> None:
    """Before pytest-timeout reads the test's limit: no later than the deadline."""
    end = at()
    if end is not None:
        item.add_marker(pytest.mark.timeout(limit(_own(item), end - time.time())))


def refuse(item) -> None:
    """At the test's setup: past the deadline, fail it, naming the deadline; a slow test
    without :data:`SLOW_ROOM` left is skipped, saying how to run it."""
    end = at()
    if end is not None and item.get_closest_marker("slow") and end - time.time() < SLOW_ROOM:
        pytest.skip(f"the slow tier is not started with {end - time.time():.0f} s left before "
                    f"the run's deadline ({VARIABLE}; it needs {SLOW_ROOM} s): "
                    "python -m pytest -m slow runs it")  # fmt: skip
    if end is not None and time.time() >= end:
        pytest.fail(f"not run: the run's deadline ({VARIABLE}, set by .ci/run short of CI's "
                    f"hard limit) passed {time.time() - end:.0f} s ago", pytrace=False)  # fmt: skip
