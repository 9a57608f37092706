"""GRPO end to end: `ftjob run` of examples/tiny-grpo.yaml (LoRA, 2 processes on CPU): the tiny
model samples completions of arithmetic prompts, a user's reward function with partial credit
scores them, and the mean reward rises; the same job trained in this process as a gang of one
resumes from a checkpoint to the same completions, rewards and losses, bit for bit. The QLoRA
variant, sharded over both ranks, resumes from its checkpoints' shards as `ftjob run` of a copy
of its folder stopped after a generation batch and inside one.

    python -m pytest tests/e2e/test_grpo_run.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from in_process import resumed_in_process, stopped_after
from test_trainer_run import history, run

from ftjob.trainer.objectives.grpo import SAMPLES_PER_LOG

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 60  # the example's


def tiny_grpo() -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-grpo.yaml").read_text())
    assert doc["spec"]["training"]["maxSteps"] == STEPS
    doc["spec"]["training"]["logEvery"] = 1  # every step's reward
    return doc


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Job folders beside links to the example's relative sources (start() writes the job file
    beside the job's folder): the model, the prompts and the reward function."""
    folder = tmp_path_factory.mktemp("grpo")
    for name in ("tiny-model", "data", "rewards"):
        (folder / name).symlink_to(EXAMPLES / name)
    return folder


@pytest.fixture(scope="module")
def grpo(runs) -> tuple[Path, str]:
    """The example with 15 of its prompts held out, evaluated every 10 steps."""
    doc = tiny_grpo()
    doc["spec"]["dataset"]["evalFraction"] = 0.05
    doc["spec"]["training"]["evalEvery"] = 10
    code, out = run(doc, runs / "tiny-grpo")
    assert code == 0, out
    return runs / "tiny-grpo", out


def completions(workdir: Path) -> dict[tuple[int, int], dict]:
    """(step, i) -> the i-th completion written at that log step; a resumed run's lines
    (written after the first attempt's) replace the first attempt's."""
    by_step: dict[int, list[dict]] = {}
    for line in (workdir / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append(row)
    return {(step, i): row for step, rows in by_step.items()
            for i, row in enumerate(rows[-SAMPLES_PER_LOG:])}  # fmt: skip


def test_the_mean_reward_rises(grpo):
    workdir, out = grpo
    steps = history(workdir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    rewards = [s["reward"] for s in steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # Partial credit for digits: the model learns to write numbers (a rise, not a value).
    assert last > first + 0.15, rewards
    for s in steps:  # the lengths over both ranks' completions of the generation batch
        assert 0 < s["completionMinLength"] <= s["completionLength"] <= s["completionMaxLength"]
        assert s["terminatedMaxLength"] <= s["completionMaxLength"] and s["entropy"] > 0
    assert all(0 <= s["clipRatio"] <= 1 for s in steps)
    # One reward of weight 1: its own mean is the step's reward.
    assert all(s["rewards"]["answer"]["mean"] == pytest.approx(s["reward"]) for s in steps)
    assert "reward" in out and "285 train / 15 eval prompts" in out


def test_the_held_out_prompts_mean_reward_rises_too(grpo):
    """Each evaluation samples numGenerations completions of every held-out prompt from the
    policy as it is (the same draws each time) and scores them: the reward rises on prompts
    the run never trained on, and the loss and lengths are reported beside it."""
    workdir, out = grpo
    evals = history(workdir, "eval")
    assert [e["evalStep"] for e in evals] == [10, 20, 30, 40, 50, 60]
    rewards = [e["evalReward"] for e in evals]
    assert rewards[-1] > rewards[0] + 0.15 and all(0 <= r <= 1 for r in rewards), rewards
    assert all(e["evalCompletionLength"] > 0 and e["evalRewardStd"] >= 0 for e in evals)
    # One reward of weight 1: its own mean is the reward.
    assert all(e["evalRewards"]["answer"]["mean"] == pytest.approx(e["evalReward"]) for e in evals)
    assert "eval  step 60/60" in out and "reward" in out.split("eval  step 60/60")[1]


def test_completions_are_written_to_the_job_folder_with_their_rewards(grpo):
    workdir, _ = grpo
    written = completions(workdir)
    assert {step for step, _ in written} == set(range(1, STEPS + 1))
    row = written[(STEPS, 0)]
    assert row["prompt"].startswith("Question: What is ")
    assert isinstance(row["completion"], str)
    assert row["reward"] == row["rewards"]["answer"]


def test_a_grpo_run_resumes_to_the_same_completions_rewards_and_losses(runs):
    """Resumed from step 4's checkpoint (the adapters, the optimizer, the prompts' order; the
    sampler seeded by generation batch): steps 5-12 sample the uninterrupted run's
    completions and score and train on them alike."""
    doc = tiny_grpo()
    doc["spec"]["training"]["maxSteps"] = 8
    first, again, out = resumed_in_process(doc, runs / "resumed", 4)
    assert "(step 4)" in out, out
    keys = ("loss", "reward", "rewardStd", "completionLength", "clipRatio", "entropy")
    resumed = {s["step"]: {k: s[k] for k in keys} for s in history(again)}
    uninterrupted = {s["step"]: {k: s[k] for k in keys} for s in history(first)}
    assert sorted(resumed) == list(range(5, 9))
    assert resumed == {step: uninterrupted[step] for step in resumed}
    written = completions(first)
    assert completions(again) == {key: written[key] for key in written if key[0] > 4}


def qlora_kl() -> dict:
    """GRPO with everything the plain example leaves off: QLoRA on the 4-bit tiny base, its
    shards gathered layer by layer while sampling (sharding full), the KL term (the adapters
    off), two optimizer steps per generation batch, top-p, a temperature, recomputation."""
    doc = tiny_grpo()
    doc["metadata"]["name"] = "qlora-grpo"
    spec = doc["spec"]
    spec["model"]["source"] = "tiny-qlora-model"
    spec["method"].update(type="qlora", quantization={"type": "nf4"})
    spec["method"]["lora"]["r"] = 16
    spec["parallelism"] = {"sharding": "full"}
    spec["training"].update(maxSteps=6, activationCheckpointing="all")
    spec["training"]["grpo"].update(
        beta=0.04, numIterations=2, lossType="grpo", topP=0.9, temperature=0.8
    )
    return doc


@pytest.fixture(scope="module")
def qlora(runs) -> tuple[Path, str]:
    """The QLoRA job, saving after every step: the resume tests' checkpoints."""
    (runs / "tiny-qlora-model").symlink_to(EXAMPLES / "tiny-qlora-model")
    doc = qlora_kl()
    doc["spec"]["checkpoint"].update(every=1, keep=6)
    code, out = run(doc, runs / "qlora-grpo")
    assert code == 0, out
    return runs / "qlora-grpo", out


@pytest.mark.slow  # tests/deadline.py: the QLoRA GRPO runs, after the full one's
def test_qlora_sharded_grpo_with_the_kl_term_and_two_steps_per_generation(qlora):
    workdir, out = qlora
    assert "full sharding over 2 ranks" in out
    steps = history(workdir)
    assert [s["step"] for s in steps] == list(range(1, 7))
    # Steps 1, 3, 5 sample from the weights they train: ratio 1, nothing clipped. The adapters
    # start at zero and warmup's first step has learning rate 0: KL 0 until step 2's update.
    # Steps 4 and 6 reuse their batch's completions after an update: the ratio moves.
    assert [s["kl"] == 0.0 for s in steps[:3]] == [True, True, False]
    assert all(s["kl"] > 0 for s in steps[2:])
    assert all(steps[k]["clipRatio"] == 0.0 for k in (0, 2, 4))
    assert any(steps[k]["clipRatio"] > 0 for k in (3, 5))
    assert (workdir / "model" / "adapter_model.safetensors").is_file()


def resumed_qlora(runs: Path, uninterrupted: Path, at: int) -> tuple[Path, str]:
    """A copy of the uninterrupted QLoRA run's folder stopped after step ``at`` (its sharded
    checkpoints up to that step), `ftjob run` again: its folder, its output."""
    workdir = runs / f"qlora-from-{at}"
    stopped_after(uninterrupted, workdir, at)
    code, out = run(qlora_kl(), workdir)
    assert code == 0, out
    return workdir, out


def same_steps(workdir: Path, uninterrupted: Path, at: int) -> bool:
    """Steps ``at`` + 1 to 6 with the loss, reward, KL and clip ratio the uninterrupted run
    logged (the reward on the steps that sampled: one point a generation batch)."""
    keys = ("loss", "reward", "kl", "clipRatio")
    resumed = {s["step"]: {k: s.get(k) for k in keys} for s in history(workdir)}
    first = {s["step"]: {k: s.get(k) for k in keys} for s in history(uninterrupted)}
    return resumed == {step: first[step] for step in range(at + 1, 7)}


@pytest.mark.slow  # tests/deadline.py: the QLoRA GRPO runs, after the full one's
def test_a_sharded_qlora_grpo_run_resumes_to_the_same_rewards_and_losses(runs, qlora):
    """Resumed from step 2's checkpoint: a generation batch's first step (numIterations 2),
    so the resumed run samples what the first one did."""
    workdir, out = resumed_qlora(runs, qlora[0], 2)
    assert "resuming from checkpoint" in out and "(step 2)" in out, out
    assert same_steps(workdir, qlora[0], 2)


@pytest.mark.slow  # tests/deadline.py: the QLoRA GRPO runs, after the full one's
def test_a_run_stopped_inside_a_generation_batch_resumes_to_its_completions(runs, qlora):
    """Saved after step 3, the first of generation batch 1's two steps: the checkpoint keeps
    the batch's completions, advantages and old log-probabilities (what each rank holds), so
    step 4 trains on them as the run that was not stopped did, not on a new sampling from the
    weights step 3 left."""
    workdir, out = resumed_qlora(runs, qlora[0], 3)
    assert "resuming from checkpoint" in out and "(step 3)" in out, out
    assert "sampled again" not in out
    assert same_steps(workdir, qlora[0], 3)
