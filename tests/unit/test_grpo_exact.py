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


def perturbed(model, seed: int = 0, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


# Between sampling and the loss, a change of the weights as an optimizer step makes one: the
# second iteration of numIterations 2 takes the ratio to the sampling-time log-probabilities
# away from 1, far enough that both clipping bounds bind on some tokens.
STEP = 0.1


def trl_side(tok, done, settings: GrpoSpec, tmp_path, step: bool = False):
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
        mask_truncated_completions=settings.mask_truncated_completions,
        importance_sampling_level=settings.importance_sampling_level,
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
    summed = grpo_loss.advantages(torch.tensor(SCORES), torch.tensor(WEIGHTS), G,
                                  settings.scale_rewards)[1]  # fmt: skip
    zero = grpo_loss.zero_spread(summed, G, settings.scale_rewards)
    assert zero == trainer._metrics["train"]["frac_reward_zero_std"][-1]
    if step:
        perturbed(trainer.model, seed=1, scale=STEP)
    value = trainer._compute_loss(trainer.model, inputs)
    value.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    clip = {k.split("/")[1]: v[-1] for k, v in trainer._metrics["train"].items()
            if k.startswith("clip_ratio/")}  # fmt: skip
    return value.item(), grads, inputs["advantages"], clip


def ftjob_side(tok, done, settings: GrpoSpec, step: bool = False):
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
    if step:
        perturbed(policy, seed=1, scale=STEP)
    total, sums = goal.loss(policy, rolled, torch.device("cpu"))
    value = total / goal.count(rolled)
    value.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    goal.rewards = type("Rewards", (), {"names": ["r0", "r1"]})()  # what step_metrics reads
    got = goal.step_metrics(sums.tolist())
    names = {"region_mean": "clipRatio", "low_mean": "clipRatioLow", "high_mean": "clipRatioHigh"}
    return value.item(), grads, adv, {k: got[name] for k, name in names.items()}


@pytest.mark.parametrize(
    "settings",
    [
        GrpoSpec(loss_type="dapo"),
        GrpoSpec(loss_type="grpo"),
        GrpoSpec(loss_type="dapo", beta=0.1, epsilon_high=0.28),
        GrpoSpec(loss_type="dapo", temperature=0.7),
        GrpoSpec(loss_type="grpo", beta=0.04, scale_rewards="batch"),
        GrpoSpec(loss_type="dr_grpo", num_iterations=2, scale_rewards="none"),
        GrpoSpec(loss_type="dapo", mask_truncated_completions=True),
        GrpoSpec(loss_type="grpo", importance_sampling_level="sequence"),
    ],
    ids=[
        "dapo",
        "grpo",
        "dapo-beta",
        "dapo-temperature",
        "grpo-beta-batch",
        "dr_grpo-iterations",
        "dapo-masked",
        "grpo-sequence",
    ],  # fmt: skip
)
def test_loss_and_gradients_equal_trl_grpo_trainer(tmp_path, settings):
    settings = GrpoSpec(**{**settings.__dict__, "max_completion_length": 8})
    tok = AutoTokenizer.from_pretrained(TINY)
    done = completions(tok)
    ours, our_grads, our_adv, _ = ftjob_side(tok, done, settings)
    theirs, their_grads, their_adv, _ = trl_side(tok, done, settings, tmp_path)
    same(ours, our_grads, our_adv, theirs, their_grads, their_adv)


def same(ours, our_grads, our_adv, theirs, their_grads, their_adv) -> None:
    torch.testing.assert_close(our_adv, their_adv, rtol=0, atol=1e-6)
    assert abs(ours - theirs) <= 1e-6, (ours, theirs)
    assert ours != 0.0  # a loss that says something: the rewards differ within groups
    for name, g in their_grads.items():
        torch.testing.assert_close(
            our_grads[name], g, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    "settings",
    [
        GrpoSpec(loss_type="dapo", epsilon_high=0.28),
        GrpoSpec(loss_type="grpo", epsilon=0.1),
        GrpoSpec(loss_type="dr_grpo", beta=0.04, epsilon=0.15, epsilon_high=0.2),
        GrpoSpec(loss_type="dapo", epsilon=0.05, epsilon_high=0.1, mask_truncated_completions=True),
        GrpoSpec(loss_type="grpo", epsilon=0.01, importance_sampling_level="sequence"),
    ],
    ids=["dapo-clip-higher", "grpo", "dr_grpo-beta", "dapo-masked", "grpo-sequence"],
)
def test_with_the_ratio_away_from_1_both_bounds_clip_as_trls(tmp_path, settings):
    """The second iteration of numIterations 2, after the weights moved: ratios leave
    [1 - epsilon, 1 + epsilonHigh] both ways, on tokens whose advantage makes each bound bind
    (TRL's own low and high clip ratios say so), and the loss, its gradients and the clipped
    shares (all, low and high: TRL's region, low and high means) still equal TRL's. With the
    ratio at 1, min and max, or the two epsilons, are indistinguishable; here each is."""
    settings = GrpoSpec(**{**settings.__dict__, "max_completion_length": 8, "num_iterations": 2})
    tok = AutoTokenizer.from_pretrained(TINY)
    done = completions(tok)
    ours, our_grads, our_adv, our_clipped = ftjob_side(tok, done, settings, step=True)
    theirs, their_grads, their_adv, clip = trl_side(tok, done, settings, tmp_path, step=True)
    assert clip["low_mean"] > 0 and clip["high_mean"] > 0, clip
    same(ours, our_grads, our_adv, theirs, their_grads, their_adv)
    for k, share in our_clipped.items():  # clipRatio, clipRatioLow, clipRatioHigh
        assert share == pytest.approx(clip[k], abs=1e-6), (k, our_clipped, clip)
