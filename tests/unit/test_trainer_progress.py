"""trainer/report/progress.py and the checkpoint selection rule: pure or local-only pieces.

python -m pytest tests/unit/test_trainer_progress.py -q
"""

from __future__ import annotations

import json
import time
import urllib.request

import hangs
import pytest

from ftjob.job import atomic
from ftjob.plan.modelshape import flops_per_token
from ftjob.trainer.report import metrics, progress, trackers
from ftjob.trainer.state import checkpoint


def test_flops_count_frozen_base_weights_without_weight_gradients():
    full = flops_per_token(1000, 0, layers=2, hidden=8, seq_len=16, frozen_base=False)
    lora = flops_per_token(1000, 10, layers=2, hidden=8, seq_len=16, frozen_base=True)
    attention = 12 * 2 * 8 * 16
    assert full == 6 * 1000 + attention
    assert lora == 4 * 1000 + 6 * 10 + attention


def test_peak_flops_by_device_name():
    assert progress.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert progress.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert progress.peak_flops("NVIDIA H100 80GB HBM3", gpu_type="A100-80GB") == 312e12
    assert progress.peak_flops(None) is None  # CPU


def test_h100_80gb_takes_its_peak_from_the_device_and_assumes_the_slower_board_otherwise():
    """resources.gpuType: H100-80GB fixes the memory, not the board: the device's own name
    decides MFU's peak; a name the table lacks keeps the plan's assumed (PCIe) peak."""
    assert progress.peak_flops("NVIDIA H100 80GB HBM3", gpu_type="H100-80GB") == 989e12
    assert progress.peak_flops("NVIDIA H100 PCIe", gpu_type="H100-80GB") == 756e12
    assert progress.peak_flops("NVIDIA H100 (unnamed)", gpu_type="H100-80GB") == 756e12
    assert progress.peak_flops("Some Future GPU") is None


def test_prometheus_text_leaves_out_unknown_values():
    snapshot = {"phase": "training", "step": 3, "loss": 2.5, "mfu": None}
    text = metrics.TrainerMetrics(lambda: snapshot).text().decode()
    assert "ftjob_step 3.0\n" in text and "ftjob_loss 2.5\n" in text
    assert "ftjob_mfu_ratio" not in text
    assert 'ftjob_phase{phase="training"} 1.0' in text
    assert 'ftjob_phase{phase="exporting"} 0.0' in text
    assert "# TYPE ftjob_step gauge" in text


@pytest.fixture
def report(tmp_path):
    p = progress.Progress(tmp_path, True, total=10, world=2, peak=1e6)
    p.serve(0)
    yield p
    p.close()


def get(report, path: str) -> str:
    url = f"http://127.0.0.1:{report.snapshot['port']}{path}"
    with urllib.request.urlopen(url, timeout=hangs.FLOOR) as r:
        return r.read().decode()


def test_progress_is_served_as_json_and_prometheus_and_written_to_file(report, tmp_path):
    report.begin(0)
    report.step(1, lr=1e-3, epoch=0.1, seconds=0.3)
    report.logged(1, loss=3.0, tokens=2000, flops=5e5)
    report.step(2, lr=1e-3, epoch=0.2, seconds=7.0)  # not a log step: no loss, no file line
    report.evaluated(2, 2.75)
    report.flush()
    served = json.loads(get(report, "/progress"))
    assert (served["step"], served["totalSteps"], served["loss"]) == (2, 10, 3.0)
    assert served["evalLoss"] == 2.75 and served["phase"] == "training"
    assert served["tokensSeen"] == 2000 and served["tokensPerSecond"] > 0
    assert served["etaSeconds"] >= 0
    # MFU: the window's model FLOPs (all ranks) / (seconds x 1e6 FLOP/s peak x 2 ranks); the
    # seconds are those tokens/s was measured over.
    seconds = 2000 / served["tokensPerSecond"]
    assert served["mfu"] == pytest.approx(5e5 / (seconds * 2e6), rel=1e-3, abs=1e-4)
    scraped = get(report, "/metrics")
    assert "ftjob_eval_loss 2.75" in scraped
    # Step time is a histogram: one step under half a second, one between 5 and 10.
    assert 'ftjob_step_seconds_bucket{le="0.5"} 1.0' in scraped
    assert 'ftjob_step_seconds_bucket{le="5.0"} 1.0' in scraped
    assert 'ftjob_step_seconds_bucket{le="10.0"} 2.0' in scraped
    assert "ftjob_step_seconds_sum 7.3" in scraped
    on_disk = json.loads((tmp_path / "progress.json").read_text())
    assert on_disk["step"] == 2 and on_disk["evalLoss"] == 2.75
    events = [json.loads(line)["event"] for line in (tmp_path / "progress.jsonl").open()]
    assert events == ["step", "eval"]  # step 2 was not a logged step


def test_dpo_metrics_reach_json_prometheus_the_log_line_and_the_bar(report, capsys):
    from ftjob.cli import screen

    report.begin(0)
    report.step(1, lr=1e-3, epoch=0.1)
    dpo = {"chosenReward": 0.2, "rejectedReward": -0.1, "rewardAccuracy": 0.75,
           "rewardMargin": 0.3}  # fmt: skip
    report.logged(1, loss=0.6, tokens=100, flops=1e3, **dpo)
    report.evaluated(1, 0.65, **{**dpo, "rewardAccuracy": 0.5})
    served = json.loads(get(report, "/progress"))
    assert {k: served[k] for k in dpo} == dpo
    assert (served["evalRewardAccuracy"], served["evalRewardMargin"]) == (0.5, 0.3)
    scraped = get(report, "/metrics")
    assert "ftjob_reward_accuracy 0.75" in scraped and "ftjob_eval_reward_accuracy 0.5" in scraped
    said = capsys.readouterr().out
    assert "acc 0.75  margin 0.3000" in said
    assert "eval loss 0.6500  reward accuracy 0.50  margin 0.3000" in said
    assert "reward acc 0.75" in screen.bar_fields(served)["info"]


def test_a_figure_reported_once_is_one_point_and_the_snapshot_keeps_it(report, tmp_path, capsys):
    """GRPO with numIterations 2: step 2 trains on step 1's completions and reports only its
    loss-time figures. Its progress.jsonl line, its log line and the trackers' event leave the
    reward out (one point a generation batch); the snapshot (/progress, /metrics, status)
    keeps step 1's."""
    heard = []
    told = {"event": lambda _, kind, snap: heard.append((kind, snap)), "close": lambda _: None}
    report.listeners.append(type("Listener", (), told)())
    report.begin(0)
    rewards = {"answer": {"mean": 0.5, "std": 0.1}}
    report.step(1, lr=1e-3, epoch=0.1)
    report.logged(1, loss=0.0, tokens=10, flops=0.0, reward=0.5, rewards=rewards, kl=0.0)
    report.step(2, lr=1e-3, epoch=0.1)
    report.logged(2, loss=0.0, tokens=10, flops=0.0, kl=0.01)
    report.flush()
    lines = [json.loads(line) for line in (tmp_path / "progress.jsonl").open()]
    assert [("reward" in e, "rewards" in e, e["kl"]) for e in lines] == [
        (True, True, 0.0),
        (False, False, 0.01),
    ]
    steps = [snap for kind, snap in heard if kind == "step"]
    assert [trackers.measured("step", snap)[1].get("train/reward") for snap in steps] == [0.5, None]
    said = capsys.readouterr().out.splitlines()
    assert "reward 0.5000" in said[-2] and "reward" not in said[-1] and "kl 0.0100" in said[-1]
    served = json.loads(get(report, "/progress"))
    assert (served["step"], served["reward"], served["kl"]) == (2, 0.5, 0.01)
    assert "ftjob_reward 0.5" in get(report, "/metrics")


def test_files_are_written_by_their_own_thread_and_nothing_is_lost(tmp_path, monkeypatch):
    """A slow volume holds up the writer thread, never the step; what was reported reaches
    the files by close(), every history line included."""
    import threading

    from ftjob.job import atomic

    gate, real = threading.Event(), atomic.write_json
    monkeypatch.setattr(atomic, "write_json", lambda *a: (gate.wait(hangs.FLOOR), real(*a)))
    p = progress.Progress(tmp_path, True, total=3, world=1)
    p.begin(0)
    for n in (1, 2, 3):
        p.step(n, lr=1e-3, epoch=0.0)
        p.logged(n, loss=3.0 - n / 10, tokens=10, flops=0.0)  # returns with the volume stuck
    assert not (tmp_path / "progress.json").exists()
    gate.set()
    p.close()
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 3
    lines = [json.loads(line) for line in (tmp_path / "progress.jsonl").open()]
    assert [e["step"] for e in lines if e["event"] == "step"] == [1, 2, 3]


def test_other_ranks_publish_nothing(tmp_path):
    quiet = progress.Progress(tmp_path, False, total=10, world=2)
    quiet.serve(0)
    quiet.step(1, lr=1e-3, epoch=0.0)
    quiet.logged(1, loss=3.0, tokens=10, flops=0.0)
    assert not (tmp_path / "progress.json").exists()


def test_a_busy_port_does_not_stop_training(report, tmp_path, capsys):
    other = progress.Progress(tmp_path / "b", True, total=1, world=1)
    other.serve(report.snapshot["port"])
    assert "cannot serve on port" in capsys.readouterr().out
    assert other.snapshot["port"] is None


def test_only_committed_checkpoints_are_resumed(tmp_path):
    assert checkpoint.latest(tmp_path / "none") is None
    for step, committed in [(4, True), (8, True), (12, False)]:
        folder = checkpoint.folder(tmp_path, step)
        folder.mkdir()
        if committed:
            (folder / checkpoint.COMMITTED).write_text(f"{step}\n")
    (tmp_path / ".tmp-step-00000016").mkdir()
    newest = checkpoint.latest(tmp_path)
    assert newest.name == "step-00000008" and checkpoint.step_of(newest) == 8


class Clock:
    """time.monotonic for ftjob.trainer.report.startup, moved by the test."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_start_up_is_said_once_with_every_phase_and_kept_in_progress(tmp_path, monkeypatch, capsys):
    from ftjob.trainer.report import startup

    clock = Clock()
    monkeypatch.setattr(startup.time, "monotonic", clock)
    monkeypatch.setattr(startup, "process_age", lambda: 6.0)  # interpreter + imports so far
    report = progress.Progress(tmp_path, True, total=10, world=2)
    began = time.time()
    report.startup.mark("imports")
    for phase, seconds in [("rendezvous", 0.4), ("download", 0.0), ("data", 1.2)]:
        clock.now += seconds
        report.startup.mark(phase)
    clock.now += 2.3  # _load: 2.0 s of it reading weights (its own figure), the rest sharding
    report.startup.mark("shard", within=("load", 2.0))
    clock.now += 0.1
    report.startup.mark("resume")
    report.begin(0)
    clock.now += 4.2
    report.step(1, lr=1e-3, epoch=0.1)
    clock.now += 1.0
    report.step(2, lr=1e-3, epoch=0.2)
    report.close()
    said = [line for line in capsys.readouterr().out.splitlines() if "start-up" in line]
    assert said == [
        "start-up 14.2 s: imports 6.0, rendezvous 0.4, download 0.0, data 1.2, load 2.0, "
        "shard 0.3, resume 0.1, first step 4.2"
    ]
    kept = json.loads((tmp_path / "progress.json").read_text())["startup"]
    assert list(kept["phases"]) == list(startup.PHASES)
    assert kept["seconds"] == pytest.approx(14.2)
    assert sum(kept["phases"].values()) == pytest.approx(kept["seconds"], abs=0.01)
    # When the first step ended, on the wall clock a launcher compares with (bench/startup.py).
    # Kept to the millisecond, so rounded either way by up to half of one (a fast machine got
    # here within that half millisecond, 2026-12-05: the rounded-up time was "in the future").
    ms = 0.001  # not a hang guard: the rounding's bound
    assert began - ms <= kept["endedAt"] <= time.time() + ms


def test_the_process_age_counts_this_interpreters_start():
    from ftjob.trainer.report import startup

    # This pytest process started before the test ran, and not days ago.
    assert 0.05 < startup.process_age() < 86400


def test_a_record_discarded_takes_what_a_killed_writer_left_beside_it(tmp_path):
    """A writer killed between its temporary file and the rename leaves the temporary file;
    discarding the record (a download finished: tests/e2e/test_s3.py's killed downloader)
    removes it too, and nothing of another file's."""
    record, other = tmp_path / "w.bin.part.json", tmp_path / "other.json"
    atomic.write_json(record, {"done": 1})
    atomic.write_json(other, {"x": 1})
    left = tmp_path / ".w.bin.part.json.tmp-4242-1"
    left.write_text('{"do')  # killed mid-write
    atomic.discard(record)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json"]
