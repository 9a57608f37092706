"""Context parallelism: one micro-batch's sequence over N ranks, attention over all of it.

Activation memory grows with the sequence (16k-128k tokens), and FSDP shards the model's
states, not its activations. Here the N ranks of a context-parallel group hold S/N consecutive
tokens each of the same micro-batch (trainer/data/context_slice.py cuts it), and every layer
but attention runs on those tokens alone. Attention needs the whole sequence: DeepSpeed-Ulysses'
all-to-all over heads turns this rank's q, k, v of [S/N tokens, all heads] into [all S tokens,
heads/N], the packed attention (trainer/model/attention.py) runs over the whole micro-batch's
document boundaries, and a second all-to-all turns its output back to [S/N tokens, all heads].

Why Ulysses rather than a ring (torch's ``context_parallel``, ring attention): the attention is
the same kernel over the whole sequence (torch's varlen flash kernel on GPUs, per-document
SDPA on CPU), so packed documents keep their boundaries exactly, there is no causal load
imbalance to balance away, and the result is the one-rank result.

Traffic per decoder layer and rank, for T = B·S/N local tokens, head size D and b bytes an
element (the compute dtype): four all-to-alls, each sending (and receiving) (N-1)/N of

    q: T·Hq·D·b    k, v: T·Hkv'·D·b each    out: T·Hq·D·b

in forward, and the same four again in backward (the gradients of out, q, k, v); a layer whose
activations are checkpointed runs its forward's four again, recomputed in backward.
Hkv' = Hkv where N divides it, else the K/V heads are repeated to lcm(Hkv, N) first.
Llama-3-8B (Hq 32, Hkv 8, D 128) in bf16 at S = 32k, N = 4: T = 8,192 tokens, q and out
64 MiB, k and v 16 MiB each; 120 MiB leaves each rank in forward and as much in backward, per
layer: 7.5 GiB a micro-batch over its 32 layers (11.25 GiB with every layer checkpointed), so
a group belongs inside a node (NVLink), not across the network.

Limits:
* N must divide the query heads (each rank attends with Hq/N of them): N <= Hq;
* the all-to-alls are collectives of the group in every layer: its ranks run the same
  micro-batch, forward and backward, inside :func:`parallel` (backward too: activation
  checkpointing runs attention again there);
* not yet run under ``training.compile``: the exchange sits inside each compiled decoder layer
  (to keep eager, as :func:`attention.per_document` is, if dynamo breaks on it);
* only the packed attention (``model.attention: sdpa``) knows the group; the boundaries come
  from the batch (``cu_seq_lens_q``), never from the slice's positions;
* gradients: each rank's are those of its own tokens' losses, and the step sums them by the
  reduction it already has: FSDP's or DDP's over every rank of the gang, of which the group's
  ranks are part (each holds other tokens, as a data-parallel rank does), with the step's loss
  divided by the labelled tokens of the whole gang (trainer/step.py). No collective is added.

    python -m pytest tests/unit/test_context_parallel.py -q
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """The context-parallel group this rank belongs to: ``size`` ranks share one micro-batch,
    this one holds its slice number ``rank``."""

    group: dist.ProcessGroup | None  # None: the default group
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> Group:
        return cls(group, dist.get_rank(group), dist.get_world_size(group))


_active: Group | None = None


@contextlib.contextmanager
def parallel(group: Group) -> Iterator[Group]:
    """Attention inside runs over the group's whole sequence (forward and backward)."""
    global _active
    before, _active = _active, group
    try:
        yield group
    finally:
        _active = before


def active() -> Group | None:
    """The group :func:`parallel` made active, or None (every rank its own sequences)."""
    return _active


def kv_repeats(kv_heads: int, n: int) -> int:
    """How many times each K/V head is repeated so that ``n`` ranks split them evenly."""
    return n // math.gcd(kv_heads, n)


def heads_to_sequence(
    cp: Group, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens with every head, q [B, Hq, S/N, D] and k, v [B, Hkv, S/N, D], ->
    every token with this rank's heads: [B, Hq/N, S, D] and [B, Hkv'/N, S, D]."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % cp.size:
        raise ValueError(
            f"context parallel {cp.size} does not divide the model's {heads} attention heads"
        )
    repeats = kv_repeats(kv_heads, cp.size)
    if repeats > 1:
        # Query head h reads K/V head h // (Hq/Hkv) before and after: repeat_interleave keeps
        # the grouping, and each rank receives the K/V heads its query heads read.
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    return _to_sequence(cp, query), _to_sequence(cp, key), _to_sequence(cp, value)


def sequence_to_heads(cp: Group, out: torch.Tensor) -> torch.Tensor:
    """Attention's output, every token with this rank's heads [B, S, H/N, D], -> this rank's
    tokens with every head [B, S/N, H, D]."""
    b, s, h, d = out.shape
    n = cp.size
    # Sequence slice j goes to rank j; what comes back is each rank's heads of our tokens.
    chunks = out.reshape(b, n, s // n, h, d).transpose(0, 1)
    got = _AllToAll.apply(chunks, cp.group)  # [N (their heads), B, S/N, H/N, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def _to_sequence(cp: Group, t: torch.Tensor) -> torch.Tensor:
    b, h, s, d = t.shape
    n = cp.size
    # Head chunk j goes to rank j; what comes back is our heads of each rank's tokens.
    chunks = t.reshape(b, n, h // n, s, d).transpose(0, 1)
    got = _AllToAll.apply(chunks, cp.group)  # [N (their tokens), B, H/N, S/N, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


class _AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to rank j, chunk i of the result came from rank i. The exchange
    is its own adjoint: backward sends each gradient chunk back where its activation came
    from, by the same exchange."""

    @staticmethod
    def forward(ctx, chunks: torch.Tensor, group: dist.ProcessGroup | None):  # noqa: D102
        ctx.group = group
        return _exchange(chunks, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102 - autograd's API
        return _exchange(grad, ctx.group), None


def _exchange(chunks: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    sent = chunks.contiguous()
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)
    return got
