"""api/objectives.py: an objective's metrics are declared once and every reader takes them from
there. A made-up objective registered with one metric shows in every place a metric can show,
with no other edit: a reader that still named DPO's keys would miss it.

python -m pytest tests/unit/test_objectives.py -q
"""

from __future__ import annotations

import pytest

from ftjob.api import crd, objectives
from ftjob.api.objectives import Gauge, Metric, Objective

KL = Metric(
    key="klDivergence",
    fmt=".3f",
    tracker="train/kl",
    log="kl",
    eval_log="eval kl",
    screen="kl",
    gauge=Gauge("ftjob_kl", "Made-up: KL to the reference, last step."),
    eval_gauge=Gauge("ftjob_eval_kl", "Made-up: KL to the reference on the eval set."),
    status="klDivergence (made-up jobs): KL to the reference of the latest logged step.",
    eval_status="evalKlDivergence (made-up jobs): KL to the reference at the latest evaluation.",
    column="KL",
)


@pytest.fixture
def made_up(monkeypatch):
    monkeypatch.setitem(objectives.OBJECTIVES, "made-up", Objective("made-up", (KL,)))


def test_dpo_declares_what_each_reader_showed_before():
    dpo = {m.key for m in objectives.DPO.metrics}
    dpo_eval = {m.eval_key for m in objectives.DPO.metrics}
    assert [m.key for m in objectives.metrics() if m.key in dpo] == [
        "chosenReward", "rejectedReward", "rewardAccuracy", "rewardMargin",
    ]  # fmt: skip
    assert [(g.name, key) for g, key in objectives.gauges() if key in dpo_eval] == [
        ("ftjob_eval_reward_accuracy", "evalRewardAccuracy"),
        ("ftjob_eval_reward_margin", "evalRewardMargin"),
    ]
    step, evaluation = objectives.trackers()
    assert step["rewardAccuracy"] == "train/rewards/accuracies"
    assert {k: v for k, v in evaluation.items() if k[4:5].lower() + k[5:] in dpo} == {
        "evalChosenReward": "eval/rewards/chosen",
        "evalRejectedReward": "eval/rewards/rejected",
        "evalRewardAccuracy": "eval/rewards/accuracies",
        "evalRewardMargin": "eval/rewards/margins",
    }
    assert [k for k in objectives.status() if k in dpo or k in dpo_eval] == [
        "rewardAccuracy", "rewardMargin", "evalRewardAccuracy",
    ]  # fmt: skip
    values = {"rewardAccuracy": 0.75, "rewardMargin": 0.3, "chosenReward": 0.2}
    assert objectives.labelled(values, "log") == ["acc 0.75", "margin 0.3000"]
    assert objectives.labelled(values, "eval_log") == ["reward accuracy 0.75", "margin 0.3000"]
    assert objectives.labelled(values, "screen") == ["reward acc 0.75"]


def test_grpo_declares_trls_tracker_names_and_a_reward_column():
    grpo = {m.key: m for m in objectives.GRPO.metrics}
    assert {k: m.tracker for k, m in grpo.items()} == {
        "reward": "train/reward",
        "rewardStd": "train/reward_std",
        "completionLength": "train/completions/mean_length",
        "clipRatio": "train/clip_ratio/region_mean",
        "clipRatioLow": "train/clip_ratio/low_mean",
        "clipRatioHigh": "train/clip_ratio/high_mean",
        "zeroStdRatio": "train/frac_reward_zero_std",
        "truncatedRatio": "train/completions/clipped_ratio",
        "completionMinLength": "train/completions/min_length",
        "completionMaxLength": "train/completions/max_length",
        "terminatedLength": "train/completions/mean_terminated_length",
        "terminatedMinLength": "train/completions/min_terminated_length",
        "terminatedMaxLength": "train/completions/max_terminated_length",
        "entropy": "train/entropy",
        "kl": "train/kl",
    }
    assert grpo["reward"].column == "Reward" and grpo["reward"].card == "mean reward"
    gauges = [(g.name, key) for g, key in objectives.gauges()]
    assert ("ftjob_reward", "reward") in gauges and ("ftjob_eval_reward", "evalReward") in gauges
    values = {"reward": 0.25, "rewardStd": 0.1, "completionLength": 12.0, "clipRatio": 0.0}
    assert objectives.labelled(values, "log") == [
        "reward 0.2500",
        "± 0.1000",
        "len 12.0",
        "clip 0.000",
    ]
    assert objectives.labelled(values, "screen") == ["reward 0.2500"]


def test_each_status_description_starts_with_its_field_name():
    for m in objectives.metrics():
        assert not m.status or m.status.startswith(m.key + " ")
        assert not m.eval_status or m.eval_status.startswith(m.eval_key + " ")


def test_a_column_needs_a_status_field():
    with pytest.raises(ValueError, match="status field"):
        Metric(key="x", fmt=".2f", tracker="train/x", column="X")


def test_two_objectives_cannot_declare_one_key_two_ways(monkeypatch):
    other = Metric(key="rewardAccuracy", fmt=".3f", tracker="train/other")
    monkeypatch.setitem(objectives.OBJECTIVES, "other", Objective("other", (other,)))
    with pytest.raises(ValueError, match="rewardAccuracy"):
        objectives.metrics()


def test_the_trainer_builds_every_declared_objective():
    from ftjob.trainer.objectives import objective

    assert set(objective.OBJECTIVES) == set(objectives.OBJECTIVES)
    for name, build in objective.OBJECTIVES.items():
        assert build.__self__.declared is objectives.OBJECTIVES[name]


def test_a_made_up_objective_reaches_the_crd_and_status(made_up):
    from ftjob.operator import status

    version = crd.crd()["spec"]["versions"][0]
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns][-3:] == ["Reward-Acc", "KL", "Image"]
    assert columns[-2] == {
        "name": "KL",
        "type": "number",
        "jsonPath": ".status.progress.klDivergence",
        "priority": 1,
    }
    progress = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    fields = progress["progress"]["properties"]
    assert fields["klDivergence"] == {"description": KL.status, "type": "number"}
    assert fields["evalKlDivergence"] == {"description": KL.eval_status, "type": "number"}
    snapshot = {"step": 3, "klDivergence": 0.125, "evalKlDivergence": 0.25, "other": 1}
    reported = status.progress(snapshot)
    assert (reported["klDivergence"], reported["evalKlDivergence"]) == (0.125, 0.25)
    assert "other" not in reported


def test_a_made_up_objective_reaches_prometheus_trackers_and_the_screen(made_up):
    from ftjob.cli import screen
    from ftjob.trainer.report import metrics, progress, trackers

    snapshot = {"step": 3, "evalStep": 2, "klDivergence": 0.125, "evalKlDivergence": 0.25}
    text = metrics.TrainerMetrics(lambda: snapshot).text().decode()
    assert "ftjob_kl 0.125\n" in text and "ftjob_eval_kl 0.25\n" in text
    assert "# HELP ftjob_kl Made-up: KL to the reference, last step." in text
    assert trackers.measured("step", snapshot) == (3, {"train/kl": 0.125})
    assert trackers.measured("eval", snapshot) == (2, {"eval/kl": 0.25})
    assert "kl 0.125" in screen.bar_fields(snapshot)["info"]
    assert {"klDivergence", "evalKlDivergence"} <= set(progress.kept_keys())


def test_a_made_up_objective_reaches_the_log_lines_and_progress(made_up, tmp_path, capsys):
    from ftjob.trainer.report import progress

    report = progress.Progress(tmp_path, True, total=10, world=1)
    report.begin(0)
    report.step(1, lr=1e-3, epoch=0.1)
    report.logged(1, loss=0.6, tokens=100, flops=1e3, klDivergence=0.125)
    report.evaluated(1, 0.65, klDivergence=0.25)
    report.close()
    # The first step's start-up line (tests/unit/test_trainer_progress.py) comes before it.
    said = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("start-up")]
    assert said[0].startswith("step  1/10  loss 0.6000  kl 0.125  lr 1.00e-03")
    assert said[1] == "eval  step 1/10  eval loss 0.6500  eval kl 0.250"
    assert report.snapshot["evalKlDivergence"] == 0.25
