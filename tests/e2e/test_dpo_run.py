"""DPO end to end: `ftjob run` of examples/tiny-dpo.yaml (LoRA, 2 processes on CPU) on the
tiny model and its synthetic preference pairs, whose preference is learnable; then the same
pairs with QLoRA on a base that splits into NF4 blocks. Each also trains in this process as a
gang of one and resumes from a checkpoint to the uninterrupted run's losses and eval metrics
(what a method restores is one rank's; tests/e2e/test_recovery.py kills and restarts gangs).

    python -m pytest tests/e2e/test_dpo_run.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import whole_logits
import yaml
from in_process import resumed_in_process
from test_qlora import make_base, nf4_reference
from test_trainer_run import history, losses, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def tiny_dpo() -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-dpo.yaml").read_text())
    doc["spec"]["training"]["logEvery"] = 1  # step 1's loss is the untrained policy's
    doc["spec"]["checkpoint"]["every"] = 8
    return doc


def beside_the_examples(folder: Path) -> Path:
    """A folder for job folders whose job files name the example's relative sources (start()
    writes the job file beside the job's folder)."""
    for name in ("tiny-model", "data"):
        (folder / name).symlink_to(EXAMPLES / name)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return beside_the_examples(tmp_path_factory.mktemp("dpo"))


def test_reward_accuracy_rises_well_above_chance_and_the_eval_margin_grows(dpo):
    workdir, out, _ = dpo
    steps = history(workdir)
    assert [s["step"] for s in steps] == list(range(1, 41))
    # Step 1: the adapters are zero, so the policy is its reference: every reward is 0.
    first = steps[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert (first["rewardAccuracy"], first["rewardMargin"]) == (0.0, 0.0)
    # Later the policy moves away from the reference (the adapter-free network) and learns.
    last = steps[-10:]
    assert sum(s["rewardAccuracy"] for s in last) / 10 > 0.7
    assert sum(s["loss"] for s in last) / 10 < math.log(2) - 0.05
    evals = history(workdir, "eval")
    assert [e["evalStep"] for e in evals] == [20, 40]
    assert evals[-1]["evalRewardAccuracy"] >= 0.7
    assert 0 < evals[0]["evalRewardMargin"] < evals[-1]["evalRewardMargin"]
    assert evals[-1]["evalLoss"] < evals[0]["evalLoss"] < math.log(2)
    # What `ftjob run` prints: the log lines with the reward accuracy and margin.
    assert "450 train / 50 eval preference pairs" in out
    assert "eval  step 40/40  eval loss" in out and "reward accuracy" in out


def assert_ranks_as_reported(base, workdir: Path, beta: float) -> None:
    """The export on ``base``, reloaded with peft in one process, gives the eval set's reward
    accuracy, margin and loss the trainer reported (its reference: the adapter off)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from ftjob.trainer.data import batches as data
    from ftjob.trainer.data import pairs
    from ftjob.trainer.objectives import preference

    reported = history(workdir, "eval")[-1]
    model = PeftModel.from_pretrained(base, workdir / "model").eval()
    tok = AutoTokenizer.from_pretrained(workdir / "model")
    (folder,) = (workdir / "data").glob("*/eval")
    held_out = data.Sequences.open(folder)
    batch = data.collate(
        pairs.rows(held_out.rows(range(len(held_out))), shared=False), tok.pad_token_id
    )

    def logps():
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        return whole_logits.response_logps(out.logits, batch.labels)

    with torch.no_grad():
        policy = logps()
        with model.disable_adapter():
            reference = logps()
    got = preference.means(preference.dpo(policy, reference, beta=beta).sums())
    assert got["rewardAccuracy"] == pytest.approx(reported["evalRewardAccuracy"], abs=1e-6)
    assert got["rewardMargin"] == pytest.approx(reported["evalRewardMargin"], abs=1e-5)
    assert got["loss"] == pytest.approx(reported["evalLoss"], abs=1e-5)


def test_the_exported_adapter_loads_with_peft_and_ranks_the_eval_pairs_as_trained(dpo):
    from transformers import AutoModelForCausalLM

    workdir, _, doc = dpo
    base = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model", dtype=torch.float32)
    assert_ranks_as_reported(base, workdir, doc["spec"]["training"]["dpo"]["beta"])
    # Every adapter trained, the output head's too (lora_B starts at zero).
    from safetensors.torch import load_file

    saved = load_file(workdir / "model" / "adapter_model.safetensors")
    heads = [k for k in saved if "lora_B" in k]
    assert len(heads) == 15 and any("lm_head" in k for k in heads)
    assert all(saved[k].abs().max() > 0 for k in heads), [k for k in heads if not saved[k].any()]


def assert_resumes_exactly(doc: dict, root: Path, at: int, sources: Path = EXAMPLES) -> str:
    """``doc`` resumed in this process from its step-``at`` checkpoint logs the uninterrupted
    run's losses and ends with its eval reward accuracy and loss, exactly; what the rerun
    printed."""
    first, again, out = resumed_in_process(doc, root, at, sources)
    assert f"(step {at})" in out, out
    resumed, uninterrupted = losses(again), losses(first)
    assert sorted(resumed) == list(range(at + 1, doc["spec"]["training"]["maxSteps"] + 1))
    assert max(abs(resumed[s] - uninterrupted[s]) for s in resumed) == 0.0
    final = {k: history(again, "eval")[-1][k] for k in ("evalRewardAccuracy", "evalLoss")}
    assert final == {k: history(first, "eval")[-1][k] for k in final}
    return out


def test_a_dpo_run_resumes_from_its_checkpoint_to_the_same_losses(tmp_path):
    """The adapters and their optimizer state restored; the reference, the adapters off, is
    the restored network's own."""
    doc = tiny_dpo()
    doc["spec"]["training"].update(maxSteps=16, evalEvery=8)
    assert_resumes_exactly(doc, tmp_path, 8)


def qlora_dpo() -> dict:
    """DPO with QLoRA: the tiny pairs on a base whose weights split into whole NF4 blocks over
    two ranks (test_qlora.make_base; the committed tiny model's are too small)."""
    doc = tiny_dpo()
    doc["metadata"]["name"] = "qlora-dpo"
    spec = doc["spec"]
    spec["model"]["source"] = "base"
    spec["method"]["type"] = "qlora"
    spec["training"].update(maxSteps=20, evalEvery=10)
    spec["checkpoint"]["every"] = 10
    return doc


@pytest.fixture(scope="module")
def base(runs) -> Path:
    make_base(runs / "base")
    return runs / "base"


@pytest.fixture(scope="module")
def qlora(runs, base) -> Path:
    code, out = run(qlora_dpo(), runs / "qlora-dpo")
    assert code == 0, out
    return runs / "qlora-dpo"


@pytest.mark.slow  # tests/deadline.py: the QLoRA DPO runs, after the LoRA one's
def test_qlora_dpo_learns_the_preference_and_checkpoints_every_adapter(qlora):
    import torch.distributed.checkpoint as dcp

    steps = history(qlora)
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # 4-bit base = reference
    assert sum(s["rewardAccuracy"] for s in steps[-5:]) / 5 > 0.7
    evals = history(qlora, "eval")
    assert [e["evalStep"] for e in evals] == [10, 20]
    assert evals[-1]["evalRewardAccuracy"] >= 0.7
    assert 0 < evals[0]["evalRewardMargin"] < evals[-1]["evalRewardMargin"]
    # Resuming needs every adapter in the checkpoint: 7 modules x 2 layers + the head, A and B.
    saved = dcp.FileSystemReader(qlora / "checkpoints" / "step-00000010").read_metadata()
    adapters = [k for k in saved.state_dict_metadata if k.startswith("model.") and "lora" in k]
    assert len(adapters) == 30 and sum("lm_head" in k for k in adapters) == 2


@pytest.mark.slow  # tests/deadline.py: the QLoRA DPO runs, after the LoRA one's
def test_a_qlora_dpo_run_resumes_from_its_checkpoint_to_the_same_losses(runs, base, tmp_path):
    """The adapters over the 4-bit base, its reference the adapters off."""
    doc = qlora_dpo()
    doc["spec"]["training"].update(maxSteps=12, evalEvery=6)
    assert_resumes_exactly(doc, tmp_path, 6, sources=runs)


@pytest.mark.slow  # tests/deadline.py: the QLoRA DPO runs, after the LoRA one's
def test_the_qlora_adapter_loads_with_peft_on_the_4bit_base_and_ranks_as_trained(qlora, runs):
    """On the base quantized to NF4 as the trainer did (fp32 on CPU), the adapter and its
    adapter-off reference give the reported eval metrics."""
    base = nf4_reference(runs / "base", torch.float32)
    assert_ranks_as_reported(base, qlora, qlora_dpo()["spec"]["training"]["dpo"]["beta"])
