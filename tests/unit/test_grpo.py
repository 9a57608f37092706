"""GRPO's pieces: which prompts a step completes, sampling with the KV cache, the prompts
records, the completion layout the loss reads, and what the planner counts.

    python -m pytest tests/unit/test_grpo.py -q
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from example_jobs import example
from transformers import AutoModelForCausalLM, AutoTokenizer

from ftjob.api.contract import TrainerError
from ftjob.api.jobspec.data import DatasetSpec
from ftjob.plan import estimate, layout
from ftjob.plan.modelshape import known_model
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import records
from ftjob.trainer.data.records import DataError
from ftjob.trainer.gang import termination
from ftjob.trainer.model import attention
from ftjob.trainer.objectives import grpo, grpo_loss, loss
from ftjob.trainer.objectives.generate import KvSampling
from ftjob.trainer.rewards.errors import RewardError

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"


def test_a_step_completes_whole_groups_and_numiterations_steps_reuse_them():
    r = grpo.Rollouts(n=50, seed=7, world=2, micro=4, accumulation=3, generations=8,
                      iterations=2)  # fmt: skip
    step = [r.indices(0, m, rank) for rank in range(2) for m in range(3)]
    drawn = Counter(i for part in step for i in part)
    assert r.prompts == 3 and len(drawn) == 3 and set(drawn.values()) == {8}
    # A group spans ranks: rank 0's last micro-batch and rank 1's first share a prompt.
    assert step[2][-1] == step[3][0]
    assert [r.indices(1, m, k) for k in range(2) for m in range(3)] == step  # iteration 2
    later = {i for k in range(2) for m in range(3) for i in r.indices(2, m, k)}
    assert later.isdisjoint(drawn)  # the next generation batch: the next prompts
    again = grpo.Rollouts(50, 7, 2, 4, 3, 8, 2)
    assert [again.indices(0, m, k) for k in range(2) for m in range(3)] == step
    assert r.steps_for(1.0) == 2 * 17  # ceil(50 / 3) generation batches, 2 steps each


@pytest.fixture(scope="module")
def tiny():
    tok = AutoTokenizer.from_pretrained(TINY)
    net = AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float32, attn_implementation=attention.implementation("sdpa")
    )
    loss.install(net)
    return tok, net.eval()


def greedy_without_cache(net, prompt: list[int], n: int, eos: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = net(input_ids=x, position_ids=torch.arange(len(ids)).unsqueeze(0)).logits
        ids.append(int(logits[0, -1].argmax()))
        if ids[-1] == eos:
            break
    return ids[len(prompt) :]


def test_sampling_with_the_kv_cache_on_left_padded_prompts_equals_a_plain_forward(tiny):
    tok, net = tiny
    long, short = tok("Question: What is 3 * 8?\nAnswer:")["input_ids"], tok("Hi")["input_ids"]
    # A temperature this low makes each draw the argmax: the cached, padded, batched path
    # must pick what a forward of each prompt alone, without a cache, picks; a prompt that
    # repeats (a GRPO group) is run once and its cache shared by its rows.
    engine = KvSampling(10, 1e-4, 1.0, (tok.eos_token_id,), tok.pad_token_id, synced=False)
    for prompts in ([long, short], [short, long, short, short]):
        got = engine.complete(net, prompts, torch.Generator().manual_seed(0))
        want = [greedy_without_cache(net, p, 10, tok.eos_token_id) for p in prompts]
        assert got == want
    # The packed attention is back for training.
    assert net.config._attn_implementation == attention.NAME


def test_a_seeded_generator_samples_the_same_completions_and_another_seed_others(tiny):
    tok, net = tiny
    prompts = [tok("Question: What is 3 * 8?\nAnswer:")["input_ids"]] * 4
    engine = KvSampling(12, 1.0, 0.9, (tok.eos_token_id,), tok.pad_token_id, synced=False)
    first = engine.complete(net, prompts, torch.Generator().manual_seed(5))
    assert engine.complete(net, prompts, torch.Generator().manual_seed(5)) == first
    assert engine.complete(net, prompts, torch.Generator().manual_seed(6)) != first
    assert len({tuple(c) for c in first}) > 1  # a group's completions differ
    for c in first:  # ended by end-of-sequence, or cut at the limit
        assert (c[-1] == tok.eos_token_id and tok.eos_token_id not in c[:-1]) or len(c) == 12


def test_a_penalised_greedy_completion_is_transformers_generate_s(tiny):
    """The penalty looks back on the prompt and on every token drawn so far: at top-k 1 the
    completions equal transformers' greedy generate with the same repetition_penalty
    (TRL's generation), which differ from the unpenalised ones."""
    tok, net = tiny
    prompts = [tok(p)["input_ids"] for p in ("Question: What is 3 * 8?\nAnswer:", "Say 7 7 7:")]
    engine = KvSampling(10, 1.0, 1.0, (tok.eos_token_id,), tok.pad_token_id, synced=False,
                        top_k=1, repetition_penalty=4.0)  # fmt: skip
    got = engine.complete(net, prompts, torch.Generator().manual_seed(0))
    from ftjob.trainer.objectives import generate

    for prompt, ours in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        with generate._cached_attention(net):  # transformers' sdpa, which takes a KV cache
            out = net.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               repetition_penalty=4.0, max_new_tokens=10,
                               pad_token_id=tok.pad_token_id)  # fmt: skip
        want = out[0, len(prompt) :].tolist()
        assert ours == want[: len(ours)] and len(ours) in (len(want), 10)
    plain = replace(engine, repetition_penalty=1.0)
    assert plain.complete(net, prompts, torch.Generator().manual_seed(0)) != got


def test_top_p_keeps_the_most_likely_tokens_that_reach_it():
    engine = KvSampling(1, 1.0, 0.5, eos=(0,), pad=0, synced=False)
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    draws = {int(engine._draw(logits, torch.Generator().manual_seed(s))) for s in range(50)}
    assert draws == {1}


@pytest.mark.parametrize("shared", [False, True])
def test_the_loss_reads_each_completion_token_where_it_is_predicted(shared):
    # Two completions of prompt [7, 8, 9], one of prompt [5, 6].
    prompts, completions = [[7, 8, 9], [7, 8, 9], [5, 6]], [[1, 2], [3, 4, 4], [1]]
    b = data.collate(grpo.sequences(prompts, completions, shared), pad_id=0)
    every = torch.arange(float(b.input_ids.numel())).view(b.input_ids.shape)  # flat position
    view = grpo.span_view(every, b.spans)
    ids = b.input_ids.reshape(-1)
    for i, c in enumerate(completions):  # each token is the one after where it is predicted
        at = view[i, : len(c)].long()
        assert ids[at + 1].tolist() == c and view[i, len(c) :].eq(0).all()
    assert b.tokens == (12 if shared else 14) and b.tokens + b.shared == 14


def test_a_prompts_record_keeps_its_fields_for_the_rewards_and_refuses_an_empty_prompt():
    ds = DatasetSpec(source="p.jsonl", format="prompts")
    got = records.normalize({"prompt": "2 + 2 =", "answer": 4}, ds, "p.jsonl line 1")
    assert got["prompt"] == "2 + 2 =" and got["prompt_messages"] is None
    assert '"answer": 4' in got["record"]
    chat = records.normalize({"prompt": [{"role": "user", "content": "hi"}]}, ds, "line 2")
    assert chat["prompt"] is None and chat["prompt_messages"][0]["content"] == "hi"
    with pytest.raises(DataError, match="line 3: field 'prompt' is empty"):
        records.normalize({"prompt": "  "}, ds, "p.jsonl line 3")
    with pytest.raises(DataError, match="has no field 'prompt'.*question"):
        records.normalize({"question": "2 + 2 ="}, ds, "p.jsonl line 4")


# The DPO example's own settings, unset (a null is an unset field).
UNSET = {"training.dpo": None, "dataset.evalFraction": None, "dataset.evalSplit": None}


def grpo_job(**edits):
    base = {
        **UNSET,
        "training.objective": "grpo",
        "dataset.format": "prompts",
        "dataset.maxSeqLength": 1024,
        "training.microBatchSize": 8,
        "training.grpo": {"maxCompletionLength": 512, "rewards": [{"type": "exactMatch"}]},
    }
    return example("llama3-8b-lora-dpo.yaml", **{**base, **edits})


def test_the_plan_counts_the_kv_cache_of_a_sampled_micro_batch_and_the_sampling_time():
    spec = grpo_job()
    shape = known_model(spec.model.source)
    # 8 rows x 1,024 tokens x 32 layers x (K and V) x 1,024 (8 KV heads of 128) x bf16 = 1 GiB
    assert estimate.kv_cache_bytes(spec, shape, 2) == 2**30
    sft = example("llama3-8b-lora-dpo.yaml", **{**UNSET, "training.objective": "sft",
                  "dataset.format": "chat", "dataset.maxSeqLength": 1024,
                  "training.microBatchSize": 8})  # fmt: skip
    assert layout.estimate(spec, shape).step_seconds > layout.estimate(sft, shape).step_seconds
    slower = grpo_job(**{"training.grpo": {"maxCompletionLength": 1000,
                                            "rewards": [{"type": "exactMatch"}]}})  # fmt: skip
    peak = 312e12
    assert estimate.generation_seconds(slower, shape, peak) > estimate.generation_seconds(
        spec, shape, peak
    )
    assert any("GRPO" in note for note in layout.estimate(spec, shape).notes)


def full_grpo(beta: float, **edits):
    """A full fine-tune of the 8B model with GRPO, recomputation pinned (auto would trade it
    against memory): with ``beta``, the KL term's reference."""
    grpo = {"maxCompletionLength": 512, "rewards": [{"type": "exactMatch"}], "beta": beta}
    full = {"method.type": "full", "method.lora": None, "output.mergeAdapter": None,
            "training.activationCheckpointing": "all", "training.grpo": grpo}  # fmt: skip
    return grpo_job(**{**full, **edits})


def test_the_plan_counts_a_full_fine_tunes_frozen_reference_laid_out_as_the_policy():
    """beta > 0 under a full fine-tune holds a frozen copy of the starting model in the
    compute precision (trainer/objectives/kl_reference.py): each GPU holds its shard where the
    policy is sharded, all of it where the policy is whole (DDP), none of it on the GPU under
    cpuOffload (its shards in CPU memory). A LoRA job's reference holds nothing."""
    from ftjob.plan import describe, options

    shape = known_model(grpo_job().model.source)
    held = shape.params * 2  # bf16
    for sharding, on_gpu in (("full", held / 8), ("none", held)):
        edits = {"parallelism.sharding": sharding}
        without = layout.estimate(full_grpo(0.0, **edits), shape)
        kl = layout.estimate(full_grpo(0.04, **edits), shape)
        assert (without.reference, kl.reference) == (0.0, on_gpu)
        assert kl.per_device - without.per_device == pytest.approx(on_gpu)
    edits = {"parallelism.sharding": "full", "parallelism.cpuOffload": True}
    without = layout.estimate(full_grpo(0.0, **edits), shape)
    offloaded = layout.estimate(full_grpo(0.04, **edits), shape)
    assert offloaded.reference == 0.0 and offloaded.per_device == without.per_device
    # Each of the node's 8 processes keeps its shard in CPU memory beside the policy's.
    grown = offloaded.cpu_phases["training"] - without.cpu_phases["training"]
    assert grown == pytest.approx(held)
    lora = grpo_job(**{"training.grpo": {"maxCompletionLength": 512, "beta": 0.04,
                                         "rewards": [{"type": "exactMatch"}]}})  # fmt: skip
    assert lora.training.grpo.beta and layout.estimate(lora, shape).reference == 0.0
    spec = full_grpo(0.04, **{"parallelism.sharding": "full"})
    text = "\n".join(describe.describe(spec, options.plan(spec, shape)))
    assert "weights 3.7 GiB + reference 1.9 GiB + gradients" in text
    assert "reference   a frozen copy of the starting model in bf16" in text


def test_the_model_card_says_grpo_its_rewards_and_the_final_mean_reward():
    from ftjob.trainer.state import push

    spec = example("tiny-grpo.yaml")
    card = push.model_card(spec, {"trainedSteps": 60}, {"loss": 0.0, "reward": 0.4921875})
    assert "trained by GRPO on its own completions (8 a prompt, dapo loss" in card
    assert "rewards: answer" in card
    assert "- **Final train mean reward:** 0.4922" in card
    assert "- grpo" in card


def test_each_reward_has_its_mean_and_spread_under_trls_tracker_names():
    from ftjob.api.jobspec.training import GrpoSpec
    from ftjob.trainer.report import trackers

    nan = float("nan")
    scores = torch.tensor([[1.0, nan], [0.0, 2.0], [0.5, 4.0]])
    goal = grpo.Grpo(GrpoSpec(), seed=0, prompt_field="prompt", log_every=1)
    goal.rewards = type("R", (), {"names": ["right", "steps"]})()
    # 3 completions of 12 tokens, all trained: 3 clipped, 1 low and 2 high; one cut at the limit.
    named = {"reward": 1.5, "rewardSquares": 1.25, "scored": 3, "tokens": 12, "completions": 3,
             "clipped": 3, "kl": 0, "clippedLow": 1, "clippedHigh": 2, "truncated": 1,
             "trained": 12, "entropy": 30.0}  # fmt: skip
    sums = [named[k] for k in grpo.SUMS] + grpo._function_sums(scores).tolist()
    assert "zeroStdRatio" not in goal.step_metrics(sums)  # no generation batch sampled yet
    # What the step's rollout found over every rank's completions: 3, 12 (cut) and 6 tokens.
    tokens, cut = torch.tensor([3.0, 12.0, 6.0]), torch.tensor([False, True, False])
    goal._generated = {"zeroStdRatio": 0.5, **grpo_loss.lengths(tokens, cut)}
    got = goal.step_metrics(sums)
    assert got["reward"] == 0.5 and got["completionLength"] == 4.0 and got["entropy"] == 2.5
    # A later log step on the same generation batch (numIterations > 1): its loss-time
    # figures only; the batch's were reported once.
    again = goal.step_metrics(sums)
    assert set(again) == {"clipRatio", "clipRatioLow", "clipRatioHigh", "entropy"}
    assert (got["clipRatio"], got["clipRatioLow"], got["clipRatioHigh"]) == (0.25, 1 / 12, 1 / 6)
    assert got["truncatedRatio"] == pytest.approx(1 / 3)
    assert got["rewards"]["right"] == {"mean": 0.5, "std": pytest.approx(0.5)}
    assert got["rewards"]["steps"] == {"mean": 3.0, "std": pytest.approx(2**0.5)}  # NaN left out
    snap = {"step": 7, "loss": 0.0, **got}
    step, values = trackers.measured("step", snap)
    assert step == 7 and values["train/reward"] == 0.5
    assert values["train/completions/clipped_ratio"] == pytest.approx(1 / 3)
    assert values["train/clip_ratio/low_mean"] == 1 / 12
    assert values["train/frac_reward_zero_std"] == 0.5
    assert values["train/entropy"] == 2.5
    assert values["train/completions/min_length"] == 3
    assert values["train/completions/max_length"] == 12
    assert values["train/completions/mean_terminated_length"] == 4.5
    assert values["train/completions/min_terminated_length"] == 3
    assert values["train/completions/max_terminated_length"] == 6
    # None ended with a stop token: TRL's zeros, not NaN.
    assert set(grpo_loss.lengths(tokens, torch.ones(3, dtype=torch.bool)).values()) == {0.0, 3, 12}
    assert values["train/rewards/steps/mean"] == 3.0
    assert values["train/rewards/right/std"] == pytest.approx(0.5)
    # An evaluation's, under eval/ (progress.evaluated keeps them as evalRewards).
    step, values = trackers.measured("eval", {"evalStep": 9, "evalRewards": got["rewards"]})
    assert step == 9 and values["eval/rewards/steps/mean"] == 3.0


def test_a_completion_ends_at_the_first_of_the_models_stop_tokens(tiny):
    from ftjob.trainer.objectives import generate

    tok, net = tiny
    assert generate.stop_tokens(tok, net) == (tok.eos_token_id,)
    net.generation_config.eos_token_id = [tok.eos_token_id, 7]  # a chat model's end of turn
    try:
        assert generate.stop_tokens(tok, net) == (tok.eos_token_id, 7)
    finally:
        net.generation_config.eos_token_id = tok.eos_token_id
    assert generate._trimmed([[5, 7, 9, 2], [5, 6]], (2, 7)) == [[5, 7], [5, 6]]


@pytest.mark.parametrize(
    "error, reason",
    [
        (RewardError("reward 'f' raised ValueError: broken (f.py:3)", fix="fix f.py"), "BadSpec"),
        (ValueError("score() needs one prompt per completion"), "Internal"),
        (MemoryError(), "HostOOM"),
    ],
)
def test_a_failed_reward_is_raised_in_one_form_with_the_reason_its_own_record_names(
    tmp_path, error, reason
):
    """Every rank raises the failed rank's error in the same words and with the reason that
    rank's own record would name (a bug of ours is not the user's spec)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)  # fmt: skip
    try:
        with pytest.raises(TrainerError) as raised:
            grpo._fail_together(error, 0, SimpleNamespace(world_size=1, rank=0))
    finally:
        dist.destroy_process_group()
    assert str(raised.value).startswith(f"a reward failed on rank 0: {error}")
    assert raised.value.reason == reason and raised.value.__cause__ is error
    assert termination.classify(raised.value)[0] == reason  # what the record says
    assert raised.value.fix == getattr(error, "fix", None)


@pytest.mark.parametrize(
    ("shape", "micro", "accumulation"),
    [
        ({"gpusPerNode": 1}, 1, 8),  # one GPU: a step is one group, a completion at a time
        ({"gpusPerNode": 1}, 2, 4),
        ({"gpusPerNode": 8}, 1, 1),  # 8 GPUs: one completion each, one group a step
        ({"nodes": 2, "gpusPerNode": 8}, 1, 1),
        ({"gpusPerNode": 0, "processesPerNode": 3}, 1, 8),  # 3 x 8 = 24: 3 whole groups
    ],
)
def test_unset_accumulation_is_derived_so_a_step_holds_whole_groups(shape, micro, accumulation):
    """A GRPO job that sets only its objective, prompts and rewards runs as TRL's defaults do
    (8 completions a prompt) on any shape: gradientAccumulation, unset, is the fewest
    micro-batches that make the step's completions whole groups. Set, it is the user's, and
    one that splits a group is refused, naming the way out."""
    from ftjob.api.jobspec import parse_spec
    from ftjob.api.schema import SpecError

    raw = {"model": {"source": "hf://org/m"},
           "dataset": {"source": "p.jsonl", "format": "prompts"},
           "resources": shape,
           "checkpoint": {"volume": {"claimName": "shared"}},
           "training": {"objective": "grpo", "maxSteps": 100, "microBatchSize": micro,
                        "grpo": {"rewards": [{"type": "exactMatch"}]}}}  # fmt: skip
    spec = parse_spec(raw)
    assert spec.training.gradient_accumulation is None and spec.accumulation == accumulation
    assert spec.global_batch_size % spec.training.grpo.num_generations == 0
    world = spec.resources.world_size
    r = grpo.Rollouts(64, 0, world, micro, spec.accumulation, 8, 1)
    step = Counter(i for k in range(world) for m in range(accumulation) for i in r.indices(0, m, k))
    assert set(step.values()) == {8}  # every prompt of the step: its whole group
    if accumulation > 1:  # here one micro-batch of every process splits a group
        raw["training"]["gradientAccumulation"] = 1  # set: the user's, and checked
        with pytest.raises(SpecError, match="leave gradientAccumulation unset"):
            parse_spec(raw)


def test_sampling_reads_the_device_once_every_check_every_tokens_and_samples_the_same(
    tiny, monkeypatch
):
    """Whether every completion has ended is read from the device every CHECK_EVERY tokens,
    not after each one (on a GPU each read waits for the queued kernels and idles the device
    between tokens); the completions are those of a check after every token."""
    from ftjob.trainer.objectives import generate

    tok, net = tiny
    prompts = [tok("Question: What is 3 * 8?\nAnswer:")["input_ids"]] * 4
    engine = KvSampling(40, 1.0, 1.0, (tok.eos_token_id,), tok.pad_token_id, synced=False)
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or item(t))
    got = engine.complete(net, prompts, torch.Generator().manual_seed(3))
    longest = max(len(c) for c in got)
    assert len(reads) == math.ceil(longest / generate.CHECK_EVERY) <= 40 // generate.CHECK_EVERY
    monkeypatch.setattr(generate, "CHECK_EVERY", 1)
    reads.clear()
    assert engine.complete(net, prompts, torch.Generator().manual_seed(3)) == got
    assert len(reads) == longest


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p", "penalty"),
    [(1.0, 5, 1.0, None, 1.0), (0.7, 0, 0.9, None, 1.0), (1.0, 0, 1.0, 0.05, 1.0),
     (0.8, 20, 0.95, 0.02, 1.0), (1.0, 0, 1.0, None, 1.3), (0.7, 10, 0.9, None, 0.8)],
)  # fmt: skip
def test_top_k_top_p_min_p_and_the_repetition_penalty_keep_what_transformers_keeps(
    temperature, top_k, top_p, min_p, penalty
):
    """The sampling distribution equals the one transformers' own processors and warpers
    (TRL's generation) give, in their order: the repetition penalty on the tokens seen so far
    (prompt and completion, repeats among them), temperature, top-k, top-p, min-p."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    seen = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    engine = KvSampling(1, temperature, top_p, eos=(0,), pad=0, synced=False, top_k=top_k,
                        min_p=min_p, repetition_penalty=penalty)  # fmt: skip
    warpers = LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1 else []
    )
    warpers += [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    want = torch.softmax(warpers(seen, logits.clone()), dim=-1)
    got = engine.probabilities(logits, seen)
    if penalty != 1:  # the penalty moved what the seen tokens are drawn with
        assert not torch.allclose(engine.probabilities(logits), got)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got / got.sum(-1, keepdim=True), want, rtol=0, atol=1e-6)
    if (top_k, top_p, min_p) != (0, 1.0, None):
        assert (got > 0).sum() < got.numel()  # something was left out


def test_the_share_of_completions_whose_group_does_not_spread_is_trls():
    """TRL's frac_reward_zero_std: completions in groups (or, under scaleRewards batch, a
    batch) whose rewards are all alike; a NaN (no reward applied) is left out of the spread."""
    nan = float("nan")
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 2.0, nan, 2.0])
    assert grpo_loss.zero_spread(rewards, 3, "group") == pytest.approx(2 / 3)
    assert grpo_loss.zero_spread(rewards, 3, "none") == pytest.approx(2 / 3)
    assert grpo_loss.zero_spread(rewards, 3, "batch") == 0.0
    assert grpo_loss.zero_spread(torch.ones(6), 3, "batch") == 1.0
