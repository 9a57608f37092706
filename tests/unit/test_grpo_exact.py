"""GRPO's loss and gradients equal TRL 1.16 GRPOTrainer's, given the same prompts, completions
and rewards: TRL scores, normalises and computes its loss with its own code (its generation
replaced by the fixed completions), ftjob with trainer/objectives/grpo.py on the same weights.

    python -m pytest tests/unit/test_grpo_exact.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ftjob.api.spec import GrpoSpec
from ftjob.trainer.model import attention
from ftjob.trainer.objectives import grpo, grpo_loss, loss
from ftjob.trainer.objectives.generate import KvSampling

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
G = 3
PROMPTS = ["Question: What is 19 + 14?\nAnswer:", "Question: What colour is blood?\nAnswer:"]
# Two reward functions; the second does not apply to two completions (NaN), and one completion
# gets no reward at all (TRL: advantage 0).
SCORES = [
    [1.0, 0.5],
    [0.0, math.nan],
    [0.5, 0.25],
    [1.0, 1.0],
    [0.25, math.nan],
    [math.nan, math.nan],
]
WEIGHTS = [1.0, 0.5]


class _Dist:
    rank, world_size, device = 0, 1, torch.device("cpu")


def completions(tok) -> list[list[int]]:
    """Six completions of different lengths, some ended by end-of-sequence."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (5, 8, 3, 8, 6, 2):
        ids = torch.randint(5, tok.vocab_size, (n,), generator=g).tolist()
        out.append(ids[:-1] + [tok.eos_token_id] if n < 8 else ids)
    return out


def perturbed(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def trl_side(tok, done, settings: GrpoSpec, tmp_path) -> tuple[float, dict, torch.Tensor]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy = perturbed(AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32))
    texts = tok.batch_decode(done, skip_special_tokens=True)

    def reward(j):
        def fn(prompts, completions, **_):
            return [
                None if math.isnan(SCORES[i][j]) else SCORES[i][j] for i in range(len(completions))
            ]

        fn.__name__ = f"r{j}"
        return fn

    args = GRPOConfig(
        output_dir=str(tmp_path), num_generations=G, per_device_train_batch_size=len(done),
        max_completion_length=settings.max_completion_length, temperature=settings.temperature,
        loss_type=settings.loss_type, beta=settings.beta, epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high, num_iterations=settings.num_iterations,
        scale_rewards=settings.scale_rewards, reward_weights=WEIGHTS, report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=policy, reward_funcs=[reward(0), reward(1)], args=args, processing_class=tok,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
    )  # fmt: skip
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS for _ in range(G)]

    def fixed(prompts):
        return prompt_ids, done, None, texts, None, {}, None, None

    trainer._generate = fixed
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(
        [{"prompt": p} for p in PROMPTS for _ in range(G)]
    )
    trainer.current_gradient_accumulation_steps = 1
    value = trainer._compute_loss(trainer.model, inputs)
    value.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return value.item(), grads, inputs["advantages"]


def ftjob_side(tok, done, settings: GrpoSpec) -> tuple[float, dict, torch.Tensor]:
    impl = attention.implementation("sdpa")  # the trainer's packed attention
    policy = perturbed(AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32,
                                                            attn_implementation=impl))  # fmt: skip
    loss.install(policy)
    reference = AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float32, attn_implementation=impl
    )
    loss.install(reference)
    goal = grpo.Grpo(settings, seed=0, prompt_field="prompt", log_every=1, method="full")
    goal.engine = KvSampling(
        8, settings.temperature, 1.0, (tok.eos_token_id,), tok.pad_token_id, False
    )
    adv, summed = grpo_loss.advantages(torch.tensor(SCORES), torch.tensor(WEIGHTS), G,
                                       settings.scale_rewards)  # fmt: skip
    rows = [{"prompt_ids": tok(p)["input_ids"]} for p in PROMPTS for _ in range(G)]
    goal.settings = GrpoSpec(**{**settings.__dict__, "beta": 0.0})  # the reference comes below
    rolled = goal._rolled(policy, rows, done, adv, summed, torch.tensor(SCORES), _Dist())
    goal.settings = settings
    if settings.beta:
        with torch.no_grad():
            rolled = grpo.replace(rolled, ref=goal.logps(reference, rolled, torch.device("cpu")))
    policy.train()
    total, _ = goal.loss(policy, rolled, torch.device("cpu"))
    value = total / goal.count(rolled)
    value.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    return value.item(), grads, adv


@pytest.mark.parametrize(
    "settings",
    [
        GrpoSpec(loss_type="dapo"),
        GrpoSpec(loss_type="grpo"),
        GrpoSpec(loss_type="dapo", beta=0.1, epsilon_high=0.28),
        GrpoSpec(loss_type="dapo", temperature=0.7),
        GrpoSpec(loss_type="grpo", beta=0.04, scale_rewards="batch"),
        GrpoSpec(loss_type="dr_grpo", num_iterations=2, scale_rewards="none"),
    ],
    ids=["dapo", "grpo", "dapo-beta", "dapo-temperature", "grpo-beta-batch", "dr_grpo-iterations"],
)
def test_loss_and_gradients_equal_trl_grpo_trainer(tmp_path, settings):
    settings = GrpoSpec(**{**settings.__dict__, "max_completion_length": 8})
    tok = AutoTokenizer.from_pretrained(TINY)
    done = completions(tok)
    ours, our_grads, our_adv = ftjob_side(tok, done, settings)
    theirs, their_grads, their_adv = trl_side(tok, done, settings, tmp_path)
    torch.testing.assert_close(our_adv, their_adv, rtol=0, atol=1e-6)
    assert abs(ours - theirs) <= 1e-6, (ours, theirs)
    assert ours != 0.0  # a loss that says something: the rewards differ within groups
    for name, g in their_grads.items():
        torch.testing.assert_close(
            our_grads[name], g, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
