"""The trackers' sender, with rank 0's real Progress: a tracker that hangs holds neither a step
nor the end of the run for longer than the bound, and is said once. (Trackers that answer, and
one that refuses, are tested against the real clients in tests/e2e/test_tracking.py.)"""

import threading
import time

from ftjob.trainer.report import progress, trackers


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


def test_dpo_metrics_reach_a_tracker_under_trls_names(tmp_path):
    """What the DPO objective hands Progress (rewards, accuracy, margin; in training and in
    evaluations) reaches a real tracker (TensorBoard's, read back with its own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = progress.Progress(tmp_path, True, total=4, world=1)
    sender = trackers._Sender(
        trackers._Tensorboard(tmp_path), trackers._Ids(tmp_path / "tracking.json"), {},
        trackers._Warnings(report), report.log, {},
    )  # fmt: skip
    report.listeners.append(sender)
    report.own_folder()
    report.begin(0)
    dpo = lambda step: {  # noqa: E731 - the objective's metric names, as objective.Dpo sums them
        "rewardAccuracy": 0.5 + step / 10,
        "rewardMargin": step / 100,
        "chosenReward": step / 50,
        "rejectedReward": step / 100,
    }
    for step in range(1, 5):
        report.step(step, 1e-3, step / 4)
        report.logged(step, 0.7 - step / 100, 100, 0.0, **dpo(step))
        if step % 2 == 0:
            report.evaluated(step, 0.69 - step / 100, **dpo(step + 1))
    report.close()

    events = EventAccumulator(str(tmp_path / trackers.TENSORBOARD_DIR))
    events.Reload()

    def series(tag):
        return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]

    assert series("train/rewards/accuracies") == [(s, 0.5 + s / 10) for s in range(1, 5)]
    assert series("train/rewards/margins") == [(s, s / 100) for s in range(1, 5)]
    assert series("train/rewards/chosen") == [(s, s / 50) for s in range(1, 5)]
    assert series("eval/rewards/accuracies") == [(2, 0.8), (4, 1.0)]
    assert series("eval/rewards/rejected") == [(2, 0.03), (4, 0.05)]
    assert series("eval/loss") == [(2, 0.67), (4, 0.65)]
