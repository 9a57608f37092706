"""DPO with a full fine-tune: the reference is the initial model's response log-probabilities,
computed once before training by the sharded network and stored with the prepared data
(trainer/objectives/reference.py). `ftjob run` of examples/tiny-dpo.yaml with method full, on CPU;
the same job in this process, as a gang of one, resumes from a checkpoint to the same losses
reading the stored reference, not computing it again.

    python -m pytest tests/e2e/test_dpo_full.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import whole_logits
from test_dpo_run import EXAMPLES, assert_resumes_exactly, beside_the_examples, tiny_dpo
from test_trainer_run import history, run

# The slow tier (tests/deadline.py): a full fine-tune's DPO, after LoRA's (test_dpo_run.py).
pytestmark = pytest.mark.slow


def full_dpo() -> dict:
    doc = tiny_dpo()
    doc["metadata"]["name"] = "full-dpo"
    doc["spec"]["method"] = {"type": "full"}
    doc["spec"]["training"]["learningRate"] = 1e-3
    return doc


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return beside_the_examples(tmp_path_factory.mktemp("dpo-full"))


@pytest.fixture(scope="module")
def full(runs) -> tuple[Path, str]:
    code, out = run(full_dpo(), runs / "full")
    assert code == 0, out
    return runs / "full", out


def test_full_dpo_learns_the_preference_and_the_eval_margin_grows(full):
    workdir, out = full
    assert "reference log-probs: computed for 500 pairs in" in out  # 450 train + 50 eval
    steps = history(workdir)
    assert [s["step"] for s in steps] == list(range(1, 41))
    # Step 1's policy is the model that computed the reference: rewards ~0, loss ~log 2
    # (the stored values came from other batches, so only up to rounding).
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert abs(steps[0]["rewardMargin"]) < 1e-4
    last = steps[-10:]
    assert sum(s["rewardAccuracy"] for s in last) / 10 > 0.7
    assert sum(s["loss"] for s in last) / 10 < math.log(2) - 0.05
    evals = history(workdir, "eval")
    assert [e["evalStep"] for e in evals] == [20, 40]
    assert evals[-1]["evalRewardAccuracy"] >= 0.7
    assert 0 < evals[0]["evalRewardMargin"] < evals[-1]["evalRewardMargin"]


def _pairs_batch(folder: Path, pad_id: int):
    from ftjob.trainer.data import batches as data
    from ftjob.trainer.data import pairs

    held = data.Sequences.open(folder)
    return data.collate(pairs.rows(held.rows(range(len(held))), shared=False), pad_id)


def _logps(model, batch) -> torch.Tensor:

    with torch.no_grad():
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    return whole_logits.response_logps(out.logits, batch.labels)


def test_stored_reference_equals_the_initial_models_log_probs(full):
    """What the trainer stored (sharded, in its own batches) is what the base model, loaded
    whole with transformers, gives those pairs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workdir, _ = full
    (stored,) = workdir.glob("data/*/reference-*")
    base = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(EXAMPLES / "tiny-model")
    for split in ("train", "eval"):
        got = np.load(stored / f"{split}.npy")
        batch = _pairs_batch(stored.parent / split, tok.pad_token_id or tok.eos_token_id)
        chosen, rejected = _logps(base.eval(), batch).chunk(2)
        fresh = torch.stack([chosen, rejected], dim=1).numpy()
        assert got.shape == fresh.shape and not np.isnan(got).any()
        np.testing.assert_allclose(got, fresh, rtol=1e-5, atol=1e-4)


def test_the_full_export_loads_and_ranks_the_eval_pairs_as_trained(full):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftjob.trainer.objectives import preference

    workdir, _ = full
    reported = history(workdir, "eval")[-1]
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(workdir / "model")
    (stored,) = workdir.glob("data/*/reference-*")
    reference = torch.from_numpy(np.load(stored / "eval.npy"))
    batch = _pairs_batch(stored.parent / "eval", tok.pad_token_id)
    ref = torch.cat([reference[:, 0], reference[:, 1]])
    beta = full_dpo()["spec"]["training"]["dpo"]["beta"]
    got = preference.means(preference.dpo(_logps(model, batch), ref, beta=beta).sums())
    assert got["rewardAccuracy"] == pytest.approx(reported["evalRewardAccuracy"], abs=1e-6)
    assert got["rewardMargin"] == pytest.approx(reported["evalRewardMargin"], abs=1e-4)
    assert got["loss"] == pytest.approx(reported["evalLoss"], abs=1e-4)


def test_a_full_dpo_run_resumes_to_the_same_losses_reusing_the_reference(tmp_path):
    doc = full_dpo()
    doc["spec"]["training"].update(maxSteps=10, evalEvery=5)
    out = assert_resumes_exactly(doc, tmp_path, 5)
    assert "reference log-probs: reused from" in out and "reference log-probs: computed" not in out
    # The first run stored the reference; the rerun read its copy (mtime kept), wrote none.
    (written,) = (tmp_path / "uninterrupted").glob("data/*/reference-*/train.npy")
    (read,) = (tmp_path / "resumed").glob("data/*/reference-*/train.npy")
    assert read.stat().st_mtime_ns == written.stat().st_mtime_ns
