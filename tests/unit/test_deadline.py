"""The run's deadline (tests/deadline.py), through the suite's own conftest and the real
pytest-timeout, in a pytest of its own: a test running at the deadline is cut there, the next
fails at once saying why, and the run ends with its summary."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import deadline
import hangs

TESTS = Path(__file__).resolve().parents[1]
SLOW = """
import time

def test_runs_into_the_deadline():
    time.sleep(120)

def test_starts_after_it():
    pass
"""


def test_a_test_is_never_given_past_the_deadline():
    assert deadline.limit(1800, 40) == 40
    assert deadline.limit(30, 40) == 30
    assert deadline.limit(None, 40) == 40  # no limit of its own: the deadline's
    assert deadline.limit(1800, -5) == 1  # past it: pytest-timeout's smallest useful limit


def child(tmp_path: Path, source: str, ahead: float) -> tuple[int, str]:
    """pytest of ``source`` with the suite's conftest and the deadline ``ahead`` seconds away."""
    (tmp_path / "test_child.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=str(TESTS), **{deadline.VARIABLE: str(time.time() + ahead)})
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            str(tmp_path),
            "-v",
            "-rs",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=hangs.FLOOR,
    )  # fmt: skip: not cut at the deadline, the child outlives this limit and the test fails
    return done.returncode, done.stdout + done.stderr


def test_a_run_past_its_deadline_cuts_the_running_test_and_fails_the_rest(tmp_path: Path):
    # not a hang guard: the deadline under test (the child starts in 0.6 s, sleeps 120 s)
    code, out = child(tmp_path, SLOW, 10)
    assert code == 1, out
    assert "Timeout" in out and "test_runs_into_the_deadline" in out, out
    assert "not run: the run's deadline (FTJOB_TEST_DEADLINE" in out, out
    assert "1 failed" in out and "1 error" in out, out  # the summary: the run ended


TIERS = """
import pytest

@pytest.mark.slow
def test_a_slow_variant():
    pass

def test_the_core():
    pass
"""


def test_the_slow_tier_runs_last_and_is_not_started_without_room_before_the_deadline(
    tmp_path: Path,
):
    code, out = child(tmp_path, TIERS, deadline.SLOW_ROOM - 60)
    assert code == 0, out
    assert out.index("test_the_core PASSED") < out.index("test_a_slow_variant SKIPPED"), out
    assert "the slow tier is not started with" in out and "python -m pytest -m slow" in out, out
    code, out = child(tmp_path, TIERS, deadline.SLOW_ROOM + 120)  # room: it runs, last
    assert code == 0 and "2 passed" in out, out
    assert out.index("test_the_core PASSED") < out.index("test_a_slow_variant PASSED"), out
