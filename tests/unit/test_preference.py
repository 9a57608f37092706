"""trainer/objectives/preference.py against TRL's DPO trainer, run here as the reference
implementation:
the same tiny model, the same pairs (prepared by ftjob's own pipeline), the same settings ->
the same loss, rewards, reward accuracy and margin (1e-5).

python -m pytest tests/unit/test_preference.py -q
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import whole_logits
from transformers import AutoModelForCausalLM, AutoTokenizer

from ftjob.api.jobspec import parse_spec
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import pairs
from ftjob.trainer.objectives import preference

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = EXAMPLES / "tiny-model"
ROWS = [
    {"prompt": "Q: What colour is the sky? A:", "chosen": " blue", "rejected": " green, mostly"},
    {"prompt": "Q: Is snow cold? A:", "chosen": " yes, it is", "rejected": " no"},
    {"prompt": "Q: 2 + 2? A:", "chosen": " 4", "rejected": " 5"},
    {"prompt": "Q: Name a fruit. A:", "chosen": " an apple", "rejected": " a chair"},
    {"prompt": "Q: Where is Paris? A:", "chosen": " in France", "rejected": " on the moon"},
    {"prompt": "Q: Do fish swim? A:", "chosen": " they do", "rejected": " they fly"},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def prepared(tok, tmp_path_factory) -> list[dict]:
    """The pairs as ftjob prepares them (data.load over a JSONL file)."""
    folder = tmp_path_factory.mktemp("pairs")
    source = folder / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = parse_spec(
        {
            "model": {"source": str(TINY)},
            "dataset": {"source": str(source), "format": "preference"},
            "training": {"objective": "dpo", "maxSteps": 1},
        }
    )
    loaded = data.load(spec, tok, folder / "job", log=lambda *_: None)
    return loaded.train.rows(range(len(loaded.train)))


def models():
    """A policy that has moved away from its reference: the tiny model plus seeded noise."""
    reference = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return policy.eval(), reference.eval()


def trl_metrics(policy, reference, tok, prepared, beta, loss_type, tmp_path) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    args = DPOConfig(
        output_dir=str(tmp_path),
        beta=beta,
        loss_type=[loss_type],
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(ROWS[:1]),  # required; the batch below is what counts
        processing_class=tok,
    )
    examples = [{k: p[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for p in prepared]
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(examples)
    trainer.model.train()  # metrics land under "train"; the tiny model has no dropout
    loss = trainer._compute_loss(trainer.model, batch, False)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {
        "loss": loss.item(),
        "chosenReward": logged["rewards/chosen"],
        "rejectedReward": logged["rewards/rejected"],
        "rewardAccuracy": logged["rewards/accuracies"],
        "rewardMargin": logged["rewards/margins"],
        "chosenLogps": logged["logps/chosen"],
        "rejectedLogps": logged["logps/rejected"],
    }


def ftjob_metrics(policy, reference, tok, prepared, beta, loss_type) -> dict:
    batch = data.collate(pairs.rows(prepared, shared=False), tok.pad_token_id)

    def logps(net):
        out = net(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        return whole_logits.response_logps(out.logits, batch.labels)

    ours = logps(policy)
    with torch.no_grad():
        ref = logps(reference)
    result = preference.dpo(
        ours,
        ref,
        beta=beta,
        loss_type=loss_type,
        tokens=whole_logits.response_tokens(batch.labels),
    )
    metrics = preference.means(result.sums())
    chosen, rejected = ours.detach().chunk(2)
    return {
        **metrics,
        "loss": result.loss.item(),
        "chosenLogps": chosen.mean().item(),
        "rejectedLogps": rejected.mean().item(),
    }


@pytest.mark.parametrize(("beta", "loss_type"), [(0.1, "sigmoid"), (0.5, "sigmoid"), (0.2, "ipo")])
def test_loss_rewards_accuracy_and_margin_equal_trl_dpo_trainer(
    tok, prepared, tmp_path, beta, loss_type
):
    policy, reference = models()
    ours = ftjob_metrics(policy, reference, tok, prepared, beta, loss_type)
    theirs = trl_metrics(policy, reference, tok, prepared, beta, loss_type, tmp_path)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name] == pytest.approx(theirs[name], abs=1e-5), (name, ours, theirs)
    # Guards against a comparison of nothing: the policy has moved, and the pairs disagree.
    assert abs(ours["rewardMargin"]) > 1e-3 and 0 < ours["rewardAccuracy"] < 1


def test_the_loss_gradient_raises_chosen_and_lowers_rejected():
    policy = torch.tensor([-4.0, -5.5, -5.0, -5.0], requires_grad=True)  # 2 pairs
    result = preference.dpo(policy, torch.full((4,), -5.0), beta=0.1)
    result.loss.backward()
    assert (policy.grad[:2] < 0).all() and (policy.grad[2:] > 0).all()  # descent: c up, r down
    assert result.accuracy.item() == 0.5
    sums = preference.means(result.sums())
    assert sums["rewardMargin"] == pytest.approx((0.1 * 1 + 0.1 * -0.5) / 2)
    assert sums["rewardAccuracy"] == 0.5 and sums["chosenReward"] == pytest.approx(0.025)


def test_a_full_fine_tune_dpo_job_trains_against_stored_reference_log_probs():
    """Full: the reference is the initial model's stored log-probabilities
    (trainer/objectives/reference.py);
    LoRA and QLoRA: the network with its adapters off."""
    from ftjob.trainer.objectives import objective

    spec = parse_spec(
        {
            "model": {"source": str(TINY)},
            "dataset": {"source": "pairs.jsonl", "format": "preference"},
            "method": {"type": "full"},
            "training": {"objective": "dpo", "maxSteps": 1},
        }
    )
    dpo = objective.Dpo(beta=0.1, loss_type="sigmoid", shared=True)
    assert objective.of(spec) == replace(dpo, stored=True)
    for method in ("lora", "qlora"):
        adapted = parse_spec({**spec_dict(spec), "method": {"type": method}})
        assert objective.of(adapted) == dpo
    # Only the trainer's packed attention reads a shared prompt.
    eager = parse_spec({**spec_dict(spec), "model": {"source": str(TINY), "attention": "eager"}})
    assert objective.of(eager) == replace(dpo, stored=True, shared=False)


def spec_dict(spec) -> dict:
    from ftjob.api.schema import to_dict

    return to_dict(spec)


@pytest.mark.parametrize("smoothing", [0.1, 0.3])
def test_label_smoothing_equals_trls_conservative_loss_pair_by_pair(
    tok, prepared, tmp_path, smoothing
):
    """Conservative DPO: -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d). TRL 1.16's
    "sigmoid" ignores label_smoothing and its "robust" divides by 1 - 2e; its "aot" is
    exactly this loss on pairs sorted by d, so with one pair per batch (nothing to sort) it is
    the reference, pair by pair."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    policy, reference = models()
    beta = 0.5
    batch = data.collate(pairs.rows(prepared, shared=False), tok.pad_token_id)

    def logps(net):
        out = net(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        return whole_logits.response_logps(out.logits, batch.labels)

    with torch.no_grad():
        ours = preference.dpo(logps(policy), logps(reference), beta=beta,
                              label_smoothing=smoothing)  # fmt: skip
        plain = preference.dpo(logps(policy), logps(reference), beta=beta)
    args = DPOConfig(output_dir=str(tmp_path), beta=beta, loss_type=["aot"],
                     label_smoothing=smoothing, report_to="none", use_cpu=True, bf16=False,
                     gradient_checkpointing=False)  # fmt: skip
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tok,
                         train_dataset=Dataset.from_list(ROWS[:1]))  # fmt: skip
    collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id)
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    theirs = []
    for p in prepared:
        with torch.no_grad():
            loss = trainer._compute_loss(trainer.model, collate([{k: p[k] for k in keys}]), False)
        theirs.append(loss.item())
    assert ours.losses.tolist() == pytest.approx(theirs, abs=1e-5)
    # Smoothing changes the loss, not the rewards; it is the unsmoothed loss at e = 0.
    assert (ours.losses - plain.losses).abs().max() > 1e-3
    assert torch.equal(ours.chosen_rewards, plain.chosen_rewards)


def test_label_smoothing_is_for_the_sigmoid_loss_only():
    with pytest.raises(ValueError, match="sigmoid loss only"):
        preference.dpo(torch.zeros(2), torch.zeros(2), beta=0.1, loss_type="ipo",
                       tokens=torch.ones(2), label_smoothing=0.1)  # fmt: skip
