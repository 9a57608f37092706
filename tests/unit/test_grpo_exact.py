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

from ftjob.api import objectives
from ftjob.api.jobspec.training import GrpoSpec
from ftjob.trainer.model import attention
from ftjob.trainer.objectives import grpo, grpo_loss, kl_reference, loss
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


def trl_trainer(tok, done, settings: GrpoSpec, tmp_path, micro: int):
    """TRL's GRPOTrainer on the perturbed tiny model, its generation replaced by ``done``,
    micro-batches of ``micro`` completions; and its scored inputs for the whole batch."""
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
        output_dir=str(tmp_path), num_generations=G, per_device_train_batch_size=micro,
        gradient_accumulation_steps=len(done) // micro,
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
    return trainer, inputs


def trl_side(tok, done, settings: GrpoSpec, tmp_path, step: bool = False):
    trainer, inputs = trl_trainer(tok, done, settings, tmp_path, micro=len(done))
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
    clip["entropy"] = trainer._metrics["train"]["entropy"][-1]
    return value.item(), grads, inputs["advantages"], clip


def ftjob_policy(tok, settings: GrpoSpec):
    """The perturbed tiny model with the trainer's attention and head, and a Grpo objective
    on ``settings`` (its micro-batches: :func:`rolled`)."""
    impl = attention.implementation("sdpa")  # the trainer's packed attention
    policy = perturbed(AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32,
                                                            attn_implementation=impl))  # fmt: skip
    loss.install(policy)
    goal = grpo.Grpo(settings, seed=0, prompt_field="prompt", log_every=1)
    goal.engine = KvSampling(
        8, settings.temperature, 1.0, (tok.eos_token_id,), tok.pad_token_id, False
    )
    return policy, goal


def rolled(tok, policy, goal, done, at: slice) -> grpo.Rolled:
    """The completions ``done[at]`` as a micro-batch: their advantages among all six, their
    sampling-time log-probabilities (numIterations > 1) and, for beta > 0, their
    log-probabilities under TRL's reference, the tiny model as loaded: through the trainer's
    seam, a full fine-tune's frozen copy (kl_reference.FrozenCopy)."""
    settings = goal.settings
    adv, summed = grpo_loss.advantages(torch.tensor(SCORES), torch.tensor(WEIGHTS), G,
                                       settings.scale_rewards)  # fmt: skip
    rows = [{"prompt_ids": tok(p)["input_ids"]} for p in PROMPTS for _ in range(G)]
    if settings.beta:  # the trainer's seam, with its full fine-tune's frozen copy
        reference = AutoModelForCausalLM.from_pretrained(
            TINY, dtype=torch.float32, attn_implementation=attention.implementation("sdpa")
        )
        loss.install(reference)
        goal.reference = kl_reference.FrozenCopy(reference.eval().requires_grad_(False))
    return goal._rolled(policy, rows[at], done[at], adv[at], summed[at],
                        torch.tensor(SCORES)[at], _Dist())  # fmt: skip


def ftjob_side(tok, done, settings: GrpoSpec, step: bool = False):
    policy, goal = ftjob_policy(tok, settings)
    adv = grpo_loss.advantages(torch.tensor(SCORES), torch.tensor(WEIGHTS), G,
                               settings.scale_rewards)[0]  # fmt: skip
    rolled_ = rolled(tok, policy, goal, done, slice(None))
    policy.train()
    if step:
        perturbed(policy, seed=1, scale=STEP)
    total, sums = goal.loss(policy, rolled_, torch.device("cpu"))
    value = total / goal.count(rolled_)
    value.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    goal.rewards = type("Rewards", (), {"names": ["r0", "r1"]})()  # what step_metrics reads
    got = goal.step_metrics(sums.tolist())
    names = {"region_mean": "clipRatio", "low_mean": "clipRatioLow", "high_mean": "clipRatioHigh",
             "entropy": "entropy"}  # fmt: skip
    return value.item(), grads, adv, {k: got[name] for k, name in names.items()}


def test_every_metric_is_reported_under_a_name_trls_grpo_trainer_logs():
    """A dashboard built on TRL's GRPO runs reads ftjob's: each GRPO metric's tracker name is
    one TRL 1.16's GRPOTrainer logs (its own source says so: several are logged in the
    generation this file's comparisons replace)."""
    import inspect

    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer)
    for m in objectives.GRPO.metrics:
        name = m.tracker.removeprefix("train/")
        assert f'_metrics[mode]["{name}"]' in source, (m.key, name)


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
    ours, our_grads, our_adv, our_metrics = ftjob_side(tok, done, settings)
    theirs, their_grads, their_adv, metrics = trl_side(tok, done, settings, tmp_path)
    same(ours, our_grads, our_adv, theirs, their_grads, their_adv)
    # The mean entropy of the trained tokens' distributions (TRL's entropy), at the temperature.
    assert our_metrics["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)


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
    for k, share in our_clipped.items():  # clipRatio, clipRatioLow, clipRatioHigh, entropy
        assert share == pytest.approx(clip[k], abs=1e-6), (k, our_clipped, clip)


# A step of MICRO micro-batches of two completions each: the six completions' token counts per
# micro-batch differ (13, 11, 8), so a loss scaled by any one micro-batch's count, or by their
# number, is told apart from one scaled by the step's.
MICRO = 3


def trl_accumulated(tok, done, settings: GrpoSpec, tmp_path) -> tuple[float, dict]:
    """TRL's step over MICRO micro-batches: its generation batch split as its own
    _prepare_inputs splits it (split_tensor_dict), each slice's _compute_loss backpropagated
    with the accumulation its Trainer sets; the summed loss and the accumulated gradients."""
    from trl.trainer.utils import split_tensor_dict

    trainer, inputs = trl_trainer(tok, done, settings, tmp_path, micro=len(done) // MICRO)
    perturbed(trainer.model, seed=1, scale=STEP)
    trainer.current_gradient_accumulation_steps = MICRO
    total = 0.0
    for part in split_tensor_dict(inputs, MICRO):
        value = trainer._compute_loss(trainer.model, part)
        value.backward()
        total += value.item()
    return total, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def ftjob_step(tok, done, settings: GrpoSpec, tmp_path) -> tuple[float, dict]:
    """ftjob's step (trainer/step.py's train_step, in a process group of one) over the same
    completions in MICRO micro-batches: the loss it returns, and the gradients its optimizer
    was handed (read in the optimizer's step pre-hook)."""
    import torch.distributed as dist

    from ftjob.trainer import step

    policy, goal = ftjob_policy(tok, settings)
    n = len(done) // MICRO
    micro = [rolled(tok, policy, goal, done, slice(i, i + n)) for i in range(0, len(done), n)]
    policy.train()
    perturbed(policy, seed=1, scale=STEP)
    weights = list(policy.parameters())
    optimizer = torch.optim.SGD(weights, lr=0.0)
    names = {id(p): name for name, p in policy.named_parameters()}
    grads = {}
    optimizer.register_step_pre_hook(
        lambda *_: grads.update({names[id(p)]: p.grad.clone() for p in weights})
    )
    ckpt = type("Ckpt", (), {"before_update": lambda self: None})()  # no checkpoint to wait on
    run = type("Run", (), {"net": policy, "weights": weights, "optimizer": optimizer,
                           "reduce_last": None, "ckpt": ckpt})()  # fmt: skip
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)  # fmt: skip
    try:
        value, _, _ = step.train_step(run, micro, _Dist(), 0.0, goal)
    finally:
        dist.destroy_process_group()
    return value.item(), grads


@pytest.mark.parametrize(
    "settings",
    [
        GrpoSpec(loss_type="dapo", epsilon_high=0.28),
        GrpoSpec(loss_type="grpo", beta=0.04),
        GrpoSpec(loss_type="dr_grpo", mask_truncated_completions=True),
    ],
    ids=["dapo", "grpo-beta", "dr_grpo-masked"],
)
def test_a_step_of_several_micro_batches_equals_trls_accumulation(tmp_path, settings):
    """The step's scaling against TRL's gradient accumulation: the same six completions, in
    three micro-batches of unequal token counts, on the second iteration (ratios away from 1),
    through ftjob's own train_step and TRL's per-slice losses: the step's loss and the
    gradients the optimizer receives are equal."""
    settings = GrpoSpec(**{**settings.__dict__, "max_completion_length": 8, "num_iterations": 2})
    tok = AutoTokenizer.from_pretrained(TINY)
    done = completions(tok)
    ours, our_grads = ftjob_step(tok, done, settings, tmp_path)
    theirs, their_grads = trl_accumulated(tok, done, settings, tmp_path)
    assert abs(ours - theirs) <= 1e-6 and ours != 0.0, (ours, theirs)
    for name, g in their_grads.items():
        torch.testing.assert_close(
            our_grads[name], g, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
