"""tests/prebuilds.py: the session's download-bound builds start at collection, beside the
control plane's build, and a test that needs one gets its result; nothing else starts them.

    python -m pytest tests/unit/test_prebuilds.py -q
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import deadline
import hangs
import prebuilds

HERE = Path(__file__)


def build(tmp_path, name: str, code: int = 0, seconds: float = 0.0) -> prebuilds.Prebuild:
    """A build that notes it started, waits ``seconds``, prints, then exits with ``code``."""
    script = (f"import pathlib, sys, time; pathlib.Path({str(tmp_path / name)!r}).touch(); "
              f"time.sleep({seconds}); print('built {name}'); print('log', file=sys.stderr); "
              f"sys.exit({code})")  # fmt: skip
    return prebuilds.Prebuild(
        name, [sys.executable, "-c", script], fixture=name, timeout=hangs.FLOOR
    )


def test_only_the_builds_a_collected_test_needs_start_at_collection(tmp_path):
    wanted, unwanted, left = (build(tmp_path, n) for n in ("wanted", "unwanted", "left"))
    items = [({"tmp_path", "wanted"}, HERE), ({"left", "tmp_path"}, HERE)]
    started = prebuilds.start_needed(items, {"left"}, builds=(wanted, unwanted, left))
    assert started == ["wanted"]
    assert wanted.result() == (0, "built wanted\n", "log\n")
    assert (tmp_path / "wanted").exists()
    assert not (tmp_path / "unwanted").exists() and not (tmp_path / "left").exists()


def test_a_build_runs_while_the_session_goes_on_and_its_failure_reaches_the_test(tmp_path):
    failing = build(tmp_path, "failing", code=3, seconds=0.5)
    prebuilds.start_needed([({"failing"}, HERE)], set(), builds=(failing,))
    # Running before any test asked for it: the marker it writes first appears meanwhile.
    hangs.poll((tmp_path / "failing").exists, what="the build's start marker")
    code, out, err = failing.result()
    assert (code, out, err) == (3, "built failing\n", "log\n")


def test_a_build_not_started_at_collection_runs_when_a_test_asks(tmp_path):
    late = build(tmp_path, "late")
    assert late.result()[0] == 0 and (tmp_path / "late").exists()


def test_a_session_that_ends_first_stops_a_build_still_running(tmp_path):
    slow = build(tmp_path, "slow", seconds=60)
    slow.start()
    slow.stop()
    assert slow._proc.poll() is not None


def test_a_build_past_its_limit_is_stopped_and_reported(tmp_path):
    hung = build(tmp_path, "hung", seconds=60)
    hung.timeout = 1
    code, out, err = hung.result()
    assert code == -1 and out == ""
    assert "past its limit of 1 s" in err
    assert hung._proc.poll() is not None


def test_the_wait_for_a_build_ends_at_the_runs_deadline_saying_so(tmp_path, monkeypatch):
    """A build that cannot end before the run's deadline is stopped there, not at its own
    limit: the run keeps its summary, and the test that waited says why."""
    slow = build(tmp_path, "slow", seconds=hangs.FLOOR + 30)  # past its own limit: a cut
    end = time.time() + 2  # not a hang guard: the deadline under test
    monkeypatch.setenv(deadline.VARIABLE, str(end))
    code, _, err = slow.result()
    assert code == -1
    assert f"unfinished at the run's deadline ({deadline.VARIABLE})" in err
    assert slow._proc.poll() is not None


def test_every_test_of_a_folder_needs_its_folders_build_and_waits_for_it_first(tmp_path):
    """The control plane's build is every tests/cluster test's; a test of another folder
    neither starts it nor waits for it. wait_needed returns once the build has ended."""
    plane = build(tmp_path, "plane", seconds=3)
    plane.fixture, plane.folder = None, "cluster"
    cluster = prebuilds.ROOT / "tests" / "cluster" / "test_kueue.py"
    assert prebuilds.start_needed([(set(), HERE)], set(), builds=(plane,)) == []
    prebuilds.wait_needed(set(), cluster, builds=(plane,))  # not started: nothing to wait for
    assert not plane.started()
    assert prebuilds.start_needed([(set(), cluster)], set(), builds=(plane,)) == ["plane"]
    prebuilds.wait_needed(set(), HERE, builds=(plane,))  # not this test's
    assert plane._proc.poll() is None  # still running
    prebuilds.wait_needed(set(), cluster, builds=(plane,))
    assert plane._proc.poll() == 0


def test_tests_that_need_a_build_run_after_those_that_need_none(tmp_path):
    """On a fresh machine the unit and e2e tests run while the plane compiles: the cluster
    tests (first by name) and a test that asks for a build's fixture move to the end."""
    plane = build(tmp_path, "plane")
    plane.fixture, plane.folder = None, "cluster"
    floor = build(tmp_path, "floor")
    cluster = prebuilds.ROOT / "tests" / "cluster" / "test_kueue.py"
    items = [(set(), cluster), ({"tmp_path"}, HERE), ({"floor"}, HERE), (set(), HERE),
             (set(), cluster)]  # fmt: skip
    assert prebuilds.builds_last(items, builds=(plane, floor)) == [1, 3, 0, 2, 4]
    assert not plane.started() and not floor.started()  # ordering starts nothing
