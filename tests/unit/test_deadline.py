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


def test_a_run_past_its_deadline_cuts_the_running_test_and_fails_the_rest(tmp_path: Path):
    (tmp_path / "test_slow.py").write_text(SLOW)
    # not a hang guard: the deadline under test (the child starts in 0.6 s, sleeps 120 s)
    env = dict(os.environ, PYTHONPATH=str(TESTS), **{deadline.VARIABLE: str(time.time() + 10)})
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
            "-q",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=hangs.FLOOR,
    )  # fmt: skip: not cut at the deadline, the child outlives this limit and the test fails
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Timeout" in out and "test_runs_into_the_deadline" in out, out
    assert "not run: the run's deadline (FTJOB_TEST_DEADLINE" in out, out
    assert "1 failed" in out and "1 error" in out, out  # the summary: the run ended
