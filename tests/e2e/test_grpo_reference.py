"""GRPO's KL term in a full fine-tune: the reference is a frozen copy of the starting model
(trainer/objectives/kl_reference.py), laid out as the policy. In this process as a gang of one
(a plain module) and with `ftjob run` sharded over 2 processes: the KL is exactly 0 while the
policy is the starting model and positive once it moved; the copy's weights never move while
the policy's do; and with numIterations 2 each generation batch's rewards are one point of
the log and the trackers' series, on the step that sampled it, not one a step.

    python -m pytest tests/e2e/test_grpo_reference.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from in_process import EXAMPLES, one_rank, train_here
from safetensors.torch import load_file
from test_grpo_run import tiny_grpo
from test_trainer_run import history, run

from ftjob.trainer.objectives import kl_reference
from ftjob.trainer.report import trackers

STEPS = 4  # two generation batches of numIterations 2


def full_kl(name: str) -> dict:
    doc = tiny_grpo()
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["method"] = {"type": "full"}
    spec["training"].update(maxSteps=STEPS, warmup=0, learningRate=1e-3)
    spec["training"]["grpo"].update(beta=0.04, numIterations=2)
    return doc


def starting_weights() -> dict[str, torch.Tensor]:
    (weights,) = (EXAMPLES / "tiny-model").glob("*.safetensors")
    return load_file(weights)


def assert_kl_and_rewards_once(workdir: Path) -> None:
    steps = history(workdir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    # Step 1 trains the starting model itself: the policy and the copy agree to the bit.
    # Every later step's policy has taken an optimizer step away from it.
    assert steps[0]["kl"] == 0.0 and all(s["kl"] > 0 for s in steps[1:]), steps
    # Steps 1 and 3 sample; 2 and 4 train on the same completions again: their loss-time
    # figures are logged, the batch's rewards and lengths only where they were sampled.
    sampled = [s for s in steps if "reward" in s]
    assert [s["step"] for s in sampled] == [1, 3]
    assert all("rewards" in s and "completionLength" in s for s in sampled)
    assert all("clipRatio" in s and "entropy" in s for s in steps)
    points = [trackers.measured("step", s)[1] for s in steps]
    assert ["train/reward" in p for p in points] == [True, False, True, False]
    assert ["train/rewards/answer/mean" in p for p in points] == [True, False, True, False]
    # The snapshot (status, /metrics) keeps the newest reward between generation batches.
    snapshot = json.loads((workdir / "progress.json").read_text())
    assert snapshot["step"] == STEPS and snapshot["reward"] == sampled[-1]["reward"]


def test_a_full_fine_tune_takes_the_kl_to_a_frozen_copy_of_the_starting_model(
    tmp_path, monkeypatch
):
    """One process: the copy is a plain module beside the policy. Its weights, read from the
    model's files in fp32 (CPU compute), are those files' and are the same after training,
    while the policy's export differs from them."""
    kept = {}

    def spied(*args):
        net, read = load_copy(*args)
        kept["net"] = net
        kept["loaded"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
        return net, read

    load_copy = kl_reference.load_copy
    monkeypatch.setattr(kl_reference, "load_copy", spied)
    workdir = tmp_path / "full-kl"
    out = train_here(one_rank(full_kl("full-kl"), STEPS), workdir)
    assert "reference: a frozen copy of tiny-model in fp32, whole, as the policy" in out, out
    assert_kl_and_rewards_once(workdir)
    start, net = starting_weights(), kept["net"]
    after = net.state_dict()
    assert not any(p.requires_grad for p in net.parameters()) and not net.training
    for name, value in kept["loaded"].items():
        assert torch.equal(after[name], value), name
    assert all(torch.equal(after[name], start[name].float()) for name in start)
    exported = load_file(next((workdir / "model").glob("*.safetensors")))
    assert any(not torch.equal(exported[n].float(), start[n].float()) for n in start)


def test_sharded_over_two_processes_the_copy_is_sharded_like_the_policy(tmp_path):
    """`ftjob run` of the same job over 2 processes, sharding full: the copy is sharded on
    the policy's mesh and gives the same KL: 0, then positive."""
    for name in ("tiny-model", "data", "rewards"):
        (tmp_path / name).symlink_to(EXAMPLES / name)
    doc = full_kl("full-kl-sharded")
    doc["spec"]["parallelism"] = {"sharding": "full"}
    workdir = tmp_path / "full-kl-sharded"
    code, out = run(doc, workdir)
    assert code == 0, out
    assert "full sharding over 2 ranks" in out, out
    assert "reference: a frozen copy of tiny-model in fp32, sharded as the policy over 2" in out
    assert_kl_and_rewards_once(workdir)
