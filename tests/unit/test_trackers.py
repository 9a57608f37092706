"""The trackers' sender, with rank 0's real Progress: a tracker that hangs holds neither a step
nor the end of the run for longer than the bound, and is said once. (Trackers that answer, and
one that refuses, are tested against the real clients in tests/e2e/test_tracking.py.)"""

import sys
import threading
import time

import hangs
import pytest

from ftjob.job.folder import JobFolder
from ftjob.trainer.report import progress, trackers


class Hanging:
    """A tracker whose server accepts and never answers: every call blocks."""

    name = "mlflow"

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls = 0

    def start(self, params, ids):
        self.calls += 1
        self.started.set()
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
    assert time.perf_counter() - began < hangs.FLOOR  # bounded by the machine, not the tracker
    # The sender's thread takes its first event when it gets the CPU: on a busy machine the
    # 1,000 steps may all be queued before it does. Then it is stuck, once, and only once.
    assert hanging.started.wait(hangs.FLOOR)
    assert hanging.calls == 1
    began = time.perf_counter()
    report.close()
    # The 0.5 s bound and the file writes after it, not the hang (which lasts until released
    # below): a busy machine's slowest still tells the two apart.
    assert time.perf_counter() - began < hangs.FLOOR
    (said,) = report.snapshot["trackingWarnings"]
    assert said.startswith("tracking: mlflow is off for this run: still sending")
    hanging.release.set()  # the thread goes on, sends nothing more, says nothing more
    time.sleep(0.2)
    assert report.snapshot["trackingWarnings"] == [said]


def _tensorboard_run(tmp_path, before_last_step=lambda: None) -> progress.Progress:
    """Rank 0's Progress with a TensorBoard tracker, after 4 DPO steps and 2 evaluations (the
    run not ended: no phase "succeeded" closes the writer), closed. ``before_last_step`` is
    called once the tracker has taken steps 1-3."""
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
        if step == 4:
            caught_up(tmp_path)
            before_last_step()
        report.step(step, 1e-3, step / 4)
        report.logged(step, 0.7 - step / 100, 100, 0.0, **dpo(step))
        if step % 2 == 0:
            report.evaluated(step, 0.69 - step / 100, **dpo(step + 1))
    report.close()
    return report


LAST_SCALAR = list(trackers.STEP_METRICS.values())[-1]  # a step's last, in writing order


def caught_up(tmp_path) -> None:
    """Wait until the event file holds step 3's last scalar (and so all steps before)."""
    began = time.monotonic()
    folder = JobFolder(tmp_path).tensorboard
    while not folder.exists() or 3 not in [s for s, _ in _series(tmp_path)(LAST_SCALAR)]:
        assert time.monotonic() - began < hangs.FLOOR, "the tracker wrote nothing"
        time.sleep(0.05)


def _series(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(JobFolder(tmp_path).tensorboard))
    events.Reload()
    return lambda tag: [
        (e.step, round(e.value, 6))
        for e in (events.Scalars(tag) if tag in events.Tags()["scalars"] else [])
    ]


class EventFile:
    """TensorBoard's writes of event records, as slow as the test says: ``delay`` seconds
    each (a slow volume), and none after the next ``allowed`` (a volume that hangs) until
    ``release``."""

    def __init__(self, write):
        self.write, self.delay, self.allowed = write, 0.0, None
        self.released = threading.Event()

    def __call__(self, writer, data):
        if self.allowed is not None:
            self.allowed -= 1
            if self.allowed < 0:
                self.released.wait()
        time.sleep(self.delay)
        self.write(writer, data)


@pytest.fixture
def event_file(monkeypatch):
    from tensorboard.summary.writer import record_writer

    held = EventFile(record_writer.RecordWriter.write)
    monkeypatch.setattr(record_writer.RecordWriter, "write", lambda w, d: held(w, d))
    yield held
    held.released.set()  # the writer's thread finishes before tmp_path goes


def test_dpo_metrics_reach_a_tracker_under_trls_names(tmp_path):
    """What the DPO objective hands Progress (rewards, accuracy, margin; in training and in
    evaluations) reaches a real tracker (TensorBoard's, read back with its own reader)."""
    _tensorboard_run(tmp_path)
    series = _series(tmp_path)

    assert series("train/rewards/accuracies") == [(s, 0.5 + s / 10) for s in range(1, 5)]
    assert series("train/rewards/margins") == [(s, s / 100) for s in range(1, 5)]
    assert series("train/rewards/chosen") == [(s, s / 50) for s in range(1, 5)]
    assert series("eval/rewards/accuracies") == [(2, 0.8), (4, 1.0)]
    assert series("eval/rewards/rejected") == [(2, 0.03), (4, 0.05)]
    assert series("eval/loss") == [(2, 0.67), (4, 0.65)]


def test_the_last_step_is_in_a_slow_event_file_when_close_returns(tmp_path, event_file):
    """A volume that takes 0.2 s per record from the last step on: close() returns once the
    last step and evaluation are in TensorBoard's file (its own writer thread would have
    written them seconds later, after the process ended)."""
    report = _tensorboard_run(tmp_path, lambda: setattr(event_file, "delay", 0.2))
    series = _series(tmp_path)
    assert series("train/rewards/chosen") == [(s, s / 50) for s in range(1, 5)]
    assert series("eval/loss") == [(2, 0.67), (4, 0.65)]
    assert "trackingWarnings" not in report.snapshot


def test_what_a_hung_event_file_did_not_take_is_said(tmp_path, monkeypatch, event_file):
    """A volume that stops taking writes at the last evaluation (the last step's 8 training
    scalars go through): close() waits its bound, then says the tracker is still sending and
    how many events it did not send."""
    monkeypatch.setattr(trackers, "CLOSE_WAIT", 1.0)
    report = _tensorboard_run(tmp_path, lambda: setattr(event_file, "allowed", 8))
    (said,) = report.snapshot["trackingWarnings"]
    assert said == (
        "tracking: tensorboard is off for this run: still sending 1 s after the end of the "
        "run, 1 event not sent; training goes on"
    )


def test_a_tracker_whose_client_is_missing_is_said_at_the_start_with_the_install(
    tmp_path, monkeypatch, capsys
):
    """In a pod whose image lacks the tracking extra: said on rank 0's screen and in progress
    when the trainer starts, not found by an import at the first step."""
    from ftjob.api.jobspec import parse_spec

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    raw = {"model": {"source": "m"}, "dataset": {"source": "d.jsonl"}}
    raw |= {"training": {"maxSteps": 1}, "tracking": {"tensorboard": {"enabled": True}}}
    spec = parse_spec(raw)
    report = progress.Progress(tmp_path, True, total=1, world=1)
    trackers.attach(report, spec, "j", tmp_path)
    (said,) = report.snapshot["trackingWarnings"]
    assert "spec.tracking.tensorboard: the tensorboard client" in said
    assert "pip install 'ftjob[tracking]'" in said
    assert "warning: tracking: spec.tracking.tensorboard" in capsys.readouterr().out
    report.close()
