"""The trackers' sender, with rank 0's real Progress: a tracker that hangs holds neither a step
nor the end of the run for longer than the bound, and is said once. (Trackers that answer, and
one that refuses, are tested against the real clients in tests/e2e/test_tracking.py.)"""

import threading
import time

from ftjob.trainer import progress, trackers


class Hanging:
    """A tracker whose server accepts and never answers: every call blocks."""

    name = "mlflow"

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def start(self, params, ids):
        self.calls += 1
        self.release.wait()


def test_a_hanging_tracker_holds_no_step_and_the_end_waits_only_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers, "CLOSE_WAIT", 0.5)
    report = progress.Progress(tmp_path, True, total=1000, world=1)
    hanging = Hanging()
    sender = trackers._Sender(
        hanging, trackers._Ids(tmp_path / "tracking.json"), {}, trackers._Warnings(report),
        report.log, {},
    )  # fmt: skip
    report.listeners.append(sender)
    report.own_folder()
    report.begin(0)
    began = time.perf_counter()
    for step in range(1, 1001):  # the sender is stuck in start(): events only queue
        report.step(step, 1e-3, step / 1000)
        report.logged(step, 2.0, 100, 0.0)
    assert time.perf_counter() - began < 30  # bounded by the machine, not by the tracker
    assert hanging.calls == 1
    began = time.perf_counter()
    report.close()
    assert time.perf_counter() - began < 5  # the 0.5 s bound, not the hang
    (said,) = report.snapshot["trackingWarnings"]
    assert said.startswith("tracking: mlflow is off for this run: still sending")
    hanging.release.set()  # the thread goes on, sends nothing more, says nothing more
    time.sleep(0.2)
    assert report.snapshot["trackingWarnings"] == [said]
