"""Shared prefixes: a DPO pair's prompt, and a GRPO group's, run once (data.Batch.stems).

The shared layout must give every response token the log-probability, and every weight the
gradient, that the layout of one row a sequence gives, on the trainer's packed attention; and
it must fail to where a branch does not see its prompt.

    python -m pytest tests/unit/test_shared_prefix.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ftjob.trainer.data import batches as data
from ftjob.trainer.data import pairs
from ftjob.trainer.model import attention
from ftjob.trainer.objectives import grpo
from ftjob.trainer.objectives.loss import model_inputs, sequence_logps, span_view, token_logps

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
PAD = 0


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float32, attn_implementation=attention.implementation("sdpa")
    )
    return model.train()


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PAIRS = [  # prompts of 1 token (nothing to share) to 40, responses of 1 to 9
    {"prompt_ids": ids(40, 1), "chosen_ids": ids(3, 2), "rejected_ids": ids(9, 3)},
    {"prompt_ids": ids(1, 4), "chosen_ids": ids(5, 5), "rejected_ids": ids(1, 6)},
    {"prompt_ids": ids(12, 7), "chosen_ids": ids(7, 8), "rejected_ids": ids(2, 9)},
]


def logps_and_grads(net, batch: data.Batch, per_token: bool):
    net.zero_grad()
    inputs = model_inputs(net, batch)
    if per_token:
        got = span_view(token_logps(net, inputs, batch.labels, learned=batch.labelled), batch.spans)
    else:
        got = sequence_logps(net, inputs, batch)
    (got * torch.linspace(0.5, 1.5, got.numel()).view(got.shape)).sum().backward()
    return got.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}


def same(net, shared: data.Batch, plain: data.Batch, per_token: bool) -> None:
    a, grads_a = logps_and_grads(net, shared, per_token)
    b, grads_b = logps_and_grads(net, plain, per_token)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_pairs_prompt_runs_once_with_the_same_logps_and_gradients(net):
    shared = data.collate(pairs.rows(PAIRS, shared=True), PAD)
    plain = data.collate(pairs.rows(PAIRS, shared=False), PAD)
    assert shared.input_ids.shape[0] == 3 and plain.input_ids.shape[0] == 6
    # The prompts of more than one token run once: 39 + 11 tokens saved, counted as shared.
    assert shared.shared == 39 + 11 and shared.tokens + shared.shared == plain.tokens
    same(net, shared, plain, per_token=False)


def test_a_branch_continues_its_prompts_positions():
    batch = data.collate(pairs.rows(PAIRS[:1], shared=True), PAD)
    # prompt 40 + chosen 3, then the branch: the prompt's last token again, then rejected 9.
    assert batch.lengths == (43, 10) and batch.stems == (0, 39)
    assert batch.position_ids[0].tolist() == list(range(43)) + list(range(39, 49))
    assert batch.input_ids[0, 43] == PAIRS[0]["prompt_ids"][-1]


def test_a_groups_prompt_runs_once_with_the_same_token_logps_and_gradients(net):
    prompts = [ids(20, 10)] * 3 + [ids(6, 11)] * 2
    completions = [ids(n, 20 + n) for n in (4, 1, 7, 3, 5)]
    shared = data.collate(grpo.sequences(prompts, completions, shared=True), PAD)
    plain = data.collate(grpo.sequences(prompts, completions, shared=False), PAD)
    assert shared.input_ids.shape[0] == 2 and shared.shared == 2 * 19 + 5
    same(net, shared, plain, per_token=True)


def test_the_comparison_fails_when_a_branch_does_not_see_its_prompt(net, monkeypatch):
    shared = data.collate(pairs.rows(PAIRS, shared=True), PAD)
    plain = data.collate(pairs.rows(PAIRS, shared=False), PAD)
    real = attention._documents
    # Stems dropped: each branch attends to itself only (its positions still continue).
    monkeypatch.setattr(attention, "_documents", lambda cu: (real(cu)[0], ()))
    with pytest.raises(AssertionError):
        same(net, shared, plain, per_token=False)
