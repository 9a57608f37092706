"""trainer/objectives/loss.py: the chunked loss through the head equals the plain one, and never
holds
a micro-batch's fp32 logits.

    python -m pytest tests/unit/test_loss.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import whole_logits
from transformers import AutoModelForCausalLM

from ftjob.trainer.data import batches as data
from ftjob.trainer.data.tokenize import IGNORE
from ftjob.trainer.model import gemm
from ftjob.trainer.objectives import loss

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"


def test_chunked_loss_and_gradients_equal_the_plain_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(300, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (300,))
    targets[::7] = IGNORE
    chunked = loss.linear_cross_entropy(hidden, weight, targets, chunk=64)
    chunked.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE, reduction="sum")
    plain.backward()
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-5)


def saved_for_backward(compute) -> list[torch.Size]:
    """The shapes autograd keeps from ``compute()``'s forward until its backward."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: shapes.append(t.shape) or t, lambda t: t
    ):
        out = compute()
    out.backward()
    return shapes


def test_no_logits_are_kept_for_backward_and_only_one_chunk_exists_at_a_time(monkeypatch):
    """Peak memory of the loss is one chunk of logits, not the whole micro-batch's: nothing of
    [tokens x vocab] is kept for backward (the plain loss keeps it: the control), and the
    largest logits the forward makes are one chunk's."""
    hidden = torch.randn(4096, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (4096,))
    plain = saved_for_backward(
        lambda: F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    )
    assert torch.Size([4096, 1000]) in plain  # the control: the plain loss keeps its logits
    made = []
    real = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: (made.append(t.shape), real(t))[1])
    kept = saved_for_backward(lambda: loss.linear_cross_entropy(hidden, weight, targets, 1024))
    assert kept and all(s.numel() <= 4096 * 8 for s in kept)  # the gradients of hidden / head
    assert max(s.numel() for s in made) == 1024 * 1000


def tiny() -> torch.nn.Module:
    """The tiny model in float32 with the trainer's products (gemm.py: oneDNN's on some CPUs):
    plain logits and the installed head's chunks multiply in the same library."""
    net = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    gemm.fuse(net)
    return net


def batch(pad_id: int) -> data.Batch:
    g = torch.Generator().manual_seed(1)
    rows = []
    for lengths in ([20, 30, 14], [64], [10, 5]):
        ids = torch.randint(5, 200, (sum(lengths),), generator=g).tolist()
        labels = list(ids)
        labels[0] = IGNORE
        rows.append({"input_ids": ids, "labels": labels, "seq_lengths": lengths})
    return data.collate(rows, pad_id)


def test_token_loss_through_the_installed_head_equals_plain_logits():
    plain = tiny()
    fused = copy.deepcopy(plain)
    assert loss.install(fused)
    b = batch(plain.config.pad_token_id or 0)
    got, count = loss.token_loss(fused, b, torch.device("cpu"))
    want, _ = loss.token_loss(plain, b, torch.device("cpu"))  # head not installed: logits
    assert count == b.labelled > 0
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    got.backward()
    want.backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation: the loss alone, the same number
        assert loss.token_loss(fused, b, torch.device("cpu"))[0].item() == pytest.approx(
            want.item(), rel=1e-5
        )


def test_a_flat_micro_batch_trains_as_the_padded_one():
    """SFT's one row of real tokens (collate flat=True): the padded rows' loss, count and
    gradients, under ftjob's packed attention (documents stay apart in either layout)."""
    from ftjob.trainer.model import attention

    net = AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float32, attn_implementation=attention.implementation("sdpa")
    )
    assert loss.install(net)
    pad = net.config.pad_token_id or 0
    rows = []
    for lengths, first in (([20, 30, 14], IGNORE), ([64], 7), ([10, 5], IGNORE)):
        ids = list(range(5, 5 + sum(lengths)))
        rows.append({"input_ids": ids, "labels": [first, *ids[1:]], "seq_lengths": lengths})
    results = []
    for flat in (False, True):
        b = data.collate(rows, pad, flat=flat)
        got, count = loss.token_loss(net, b, torch.device("cpu"))
        got.backward()
        results.append((got.item(), count, [p.grad.clone() for p in net.parameters()]))
        net.zero_grad(set_to_none=True)
    (padded, n, grads), (flat, m, flat_grads) = results
    assert m == n > 0 and flat == pytest.approx(padded, rel=1e-5)
    for g, h in zip(grads, flat_grads, strict=True):
        torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-6)


def plain_logprobs(hidden, weight, targets) -> torch.Tensor:
    picked = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(
        1, targets.clamp(min=0).unsqueeze(1)
    )
    return picked.squeeze(1) * (targets != IGNORE)


def head_case(scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """300 tokens' hidden states, a 50-token head at ``scale`` and targets, every 7th
    ignored; hidden states and head take gradients."""
    torch.manual_seed(0)
    hidden = torch.randn(300, 16, requires_grad=True)
    weight = (scale * torch.randn(50, 16)).requires_grad_()
    targets = torch.randint(0, 50, (300,))
    targets[::7] = IGNORE
    return hidden, weight, targets


def test_chunked_log_probabilities_and_their_gradients_equal_the_plain_ones():
    """Per token, with any gradient from above (DPO weighs each row by its pair's loss); at a
    trained model's scale (logits of order 1), where fp32 holds 1e-6."""
    hidden, weight, targets = head_case(0.1)
    above = torch.randn(300)
    chunked = loss.linear_logprobs(hidden, weight, targets, chunk=64)
    (chunked * above).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain = plain_logprobs(hidden, weight, targets)
    (plain * above).sum().backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    assert (chunked[::7] == 0).all()  # an ignored target adds nothing
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-6, atol=1e-6)
    # The weight's gradient sums 300 tokens' terms, in 5 chunks here and in one matmul there:
    # the order alone moves an element by ~sqrt(300) x fp32's 6e-8 x the terms' size (~1e-6),
    # and the BLAS kernels, which pick the order, differ by CPU (one machine's was 1.5e-6 off).
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-6, atol=1e-5)


def test_chunked_entropy_is_each_distributions_own_and_leaves_the_gradients_alone():
    """GRPO's entropy metric, taken chunk by chunk beside the log-probabilities: each labelled
    position's entropy of the softmax over the whole vocabulary (torch's Categorical), 0
    where nothing is labelled; asking for it changes neither the values nor the gradients."""
    hidden, weight, targets = head_case(0.5)
    entropy = torch.zeros(300)
    with_it = loss.linear_logprobs(hidden, weight, targets, chunk=64, entropy=entropy)
    with_it.sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    without = loss.linear_logprobs(hidden, weight, targets, chunk=64)
    without.sum().backward()
    assert torch.equal(with_it, without)
    assert torch.equal(grads[0], hidden.grad) and torch.equal(grads[1], weight.grad)
    expected = torch.distributions.Categorical(logits=(hidden @ weight.t()).detach()).entropy()
    torch.testing.assert_close(entropy, expected * (targets != IGNORE), rtol=1e-5, atol=1e-5)
    assert (entropy[::7] == 0).all() and (entropy[1::7] > 0).all()


def test_log_probabilities_keep_no_logits_for_backward_and_make_one_chunk_at_a_time(
    monkeypatch,
):
    """Forward and the backward's recomputation alike: one chunk of fp32 logits at a time,
    and nothing of [tokens x vocab] kept between them (the plain path keeps it: the control)."""
    hidden = torch.randn(4096, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (4096,))
    plain = saved_for_backward(lambda: plain_logprobs(hidden, weight, targets).sum())
    assert torch.Size([4096, 1000]) in plain
    made = []
    real = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: (made.append(t.shape), real(t))[1])
    kept = saved_for_backward(lambda: loss.linear_logprobs(hidden, weight, targets, 1024).sum())
    assert kept and all(s.numel() <= 4096 * 8 for s in kept)  # hidden, weight, per token
    assert made.count(torch.Size([1024, 1000])) == 2 * 4  # 4 chunks, forward and backward
    assert max(s.numel() for s in made) == 1024 * 1000


def test_the_head_computes_only_the_learned_rows_with_the_same_values_and_gradients(
    monkeypatch,
):
    """Told how many targets are learned (a chat batch's assistant turns), the loss, the
    per-token log-probabilities and the entropy equal the all-rows ones, gradients too, while
    the head's logits are made for the learned rows alone (the control: all rows without)."""
    hidden, weight, targets = head_case(0.3)
    targets[40:] = IGNORE  # a prompt-heavy batch: 35 of 300 targets learned
    learned = int((targets != IGNORE).sum())
    made = []  # the rows of every chunk of logits (tokens x vocabulary) the head makes
    real = torch.Tensor.float
    vocab = weight.shape[0]
    monkeypatch.setattr(
        torch.Tensor,
        "float",
        lambda t: (made.append(t.shape[0] * (t.shape[-1] == vocab)), real(t))[1],
    )

    def run(compute, count):
        made.clear()
        hidden.grad = weight.grad = None
        out = compute(count)
        (out * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum().backward()
        return out.detach(), hidden.grad.clone(), weight.grad.clone(), sum(made)

    def summed(count):
        return loss.linear_cross_entropy(hidden, weight, targets, chunk=64, learned=count)

    entropies = {}

    def per_token(count):
        entropies[count] = torch.full((300,), 7.0)  # stale values the call must overwrite
        return loss.linear_logprobs(hidden, weight, targets, chunk=64,
                                    entropy=entropies[count], learned=count)  # fmt: skip

    for compute in (summed, per_token):
        *every, rows_all = run(compute, None)
        *some, rows_learned = run(compute, learned)
        for a, b in zip(every, some, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert rows_all >= 300 and rows_learned == rows_all * learned // 300
    torch.testing.assert_close(entropies[None], entropies[learned], rtol=1e-6, atol=1e-6)
    assert (entropies[learned][40:] == 0).all()


def test_token_loss_tells_the_head_how_many_targets_each_batch_learns():
    """data.Batch.labelled, which the head selects by, is the count of the targets the loss
    takes: a row's next tokens, first labels masked, and a padded row."""
    b = batch(0)
    assert b.labelled == int((data.next_tokens(b.labels) != IGNORE).sum())
    assert b.labelled < b.labels.numel()


def pair_batch(pad_id: int) -> data.Batch:
    """Two preference pairs as DPO collates them: chosen rows, then rejected rows, with the
    prompt's labels masked."""
    g = torch.Generator().manual_seed(2)
    rows = []
    for i, length in enumerate((24, 40, 31, 17)):
        ids = torch.randint(5, 200, (length,), generator=g).tolist()
        labels = [IGNORE] * 6 + ids[6:]
        rows.append({"input_ids": ids, "labels": labels, "seq_lengths": [length],
                     "spans": [(i, 5, length - 6)]})  # fmt: skip
    return data.collate(rows, pad_id)


def test_dpo_log_probabilities_through_the_installed_head_equal_plain_logits():
    """DPO's per-row log-probabilities (policy and reference) and their gradients, chunked
    through the head, equal whole_logits.response_logps of the model's whole logits."""

    plain = tiny()
    fused = copy.deepcopy(plain)
    assert loss.install(fused)
    b = pair_batch(plain.config.pad_token_id or 0)
    inputs = loss.model_inputs(fused, b)
    got = loss.sequence_logps(fused, inputs, b)
    want = whole_logits.response_logps(plain(**loss.model_inputs(plain, b)).logits, b.labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    weights = torch.tensor([0.5, -1.0, 2.0, 0.25])  # a pair loss's gradient, row by row
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)


def adapted(dropout: float):
    """The tiny model with LoRA on its attention and output head, adapters drawn non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                        target_modules=["q_proj", "v_proj", "lm_head"])  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    return get_peft_model(base, config)


def test_a_lora_head_takes_the_chunked_loss_with_equal_values_and_gradients():
    """SFT's loss and DPO's log-probabilities, policy and adapter-off reference, through a
    LoRA-adapted head (no dropout): equal to peft's own logits, gradients of the adapters too."""
    from ftjob.trainer.objectives import reference

    plain = adapted(dropout=0.0)
    fused = copy.deepcopy(plain)
    assert loss.install(fused)
    assert not isinstance(plain.get_output_embeddings(), type(fused.get_output_embeddings()))
    b = pair_batch(plain.config.pad_token_id or 0)
    got, _ = loss.token_loss(fused, b, torch.device("cpu"))
    want, _ = loss.token_loss(plain, b, torch.device("cpu"))  # peft's head: whole logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    inputs = loss.model_inputs(fused, b)
    with torch.no_grad(), reference.adapters_off(fused), reference.adapters_off(plain):
        torch.testing.assert_close(
            loss.sequence_logps(fused, inputs, b),
            whole_logits.response_logps(plain(**inputs).logits, b.labels),
            rtol=1e-6, atol=1e-6,
        )  # fmt: skip
    policy = loss.sequence_logps(fused, inputs, b)
    reference = whole_logits.response_logps(plain(**inputs).logits, b.labels)
    torch.testing.assert_close(policy, reference, rtol=1e-6, atol=1e-6)
    # As a step weighs them: the mean over labelled tokens; a DPO pair loss's gradient per
    # row, beta (0.1) x a sigmoid at most.
    weights = torch.tensor([0.05, -0.1, 0.08, -0.02])
    (got / b.labelled + (policy * weights).sum()).backward()
    (want / b.labelled + (reference * weights).sum()).backward()
    trained = 0
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        if p.requires_grad:
            trained += "lm_head" in name
            # Back through every layer, fp32 sums in another order (the head's chunks) differ
            # by ~1e-5 of a gradient, as in the full model's test above; a wrong gradient is
            # off by far more.
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert trained == 2  # the head's A and B


def test_a_lora_head_with_dropout_keeps_whole_logits():
    """Dropout between A and the input makes no single merged weight: not installed."""
    model = adapted(dropout=0.1)
    assert not loss.install(model)
