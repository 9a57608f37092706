"""Sampling completions from the policy as it is now, in the trainer's own processes.

:class:`Sampling` is the seam: GRPO asks it for completions of token-id prompts and gets token
ids back. :class:`KvSampling` is today's engine: batched, with transformers' KV cache, on the
network that trains (plain module, FSDP2 shards, LoRA and QLoRA alike), drawing every token
from a ``torch.Generator`` that GRPO seeds from (seed, generation batch, rank): the same step
samples the same completions after any resume, with nothing to store (bit-exact on CPU).

A faster engine (vLLM colocated, as TRL's ``vllm_mode: colocate``) would be another
:class:`Sampling`: it needs the policy's current weights (gathered from the shards after each
optimizer step and loaded into the engine: ``load_weights`` on its model runner), a seed per
request for the same resume guarantee, and the completions' token ids; the loss still takes
its log-probabilities from the training network (trainer/objectives/grpo.py).

    python -m pytest tests/unit/test_grpo.py -q
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ftjob.trainer.model import attention, thin

# Tokens drawn between two checks of whether every completion has ended: the check reads the
# device from the host (and under FSDP all-reduces across ranks), which on a GPU waits for
# every queued kernel; once a token, it left the device idle between tokens. Checking every
# CHECK_EVERY tokens costs at most CHECK_EVERY - 1 forwards of a batch already done, whose
# draws are padding and cut (the completions are the same for any value).
CHECK_EVERY = 8


class Sampling(Protocol):
    """An engine that completes prompts."""

    def complete(
        self, net, prompts: list[list[int]], generator: torch.Generator
    ) -> list[list[int]]:
        """Each prompt's completion (token ids, ending with end-of-sequence unless cut at the
        length limit). Under FSDP every rank calls it together."""


@dataclass(frozen=True)
class KvSampling:
    """Token by token with a KV cache: a repetition penalty, temperature, top-k, nucleus
    (top-p) and min-p sampling, as TRL's generation settings name them; stops at
    end-of-sequence or ``max_new`` tokens."""

    max_new: int
    temperature: float
    top_p: float
    eos: tuple[int, ...]  # the tokens that end a completion (TRL's eos_token_ids)
    pad: int
    synced: bool  # FSDP: every rank runs forward as often as the longest rank does (not DDP)
    top_k: int = 0  # 0: every token
    min_p: float | None = None
    repetition_penalty: float = 1.0  # 1: none

    @torch.no_grad()
    def complete(
        self, net, prompts: list[list[int]], generator: torch.Generator
    ) -> list[list[int]]:
        from transformers import DynamicCache

        device = next(net.parameters()).device
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        ends = torch.tensor(self.eos, device=device)
        out: list[torch.Tensor] = []
        cache = DynamicCache()
        was_training = net.training
        net.eval()  # no dropout while sampling
        try:
            with _cached_attention(net), _gathered_once(net), thin.linears(net):
                ids, mask, positions, logits = _prefilled(net, prompts, self.pad, cache, device)
                for n in range(1, self.max_new + 1):
                    token = self._draw(logits[:, -1], generator, ids)
                    token = torch.where(done, torch.full_like(token, self.pad), token)
                    out.append(token)
                    if self.repetition_penalty != 1.0:  # what the penalty looks back on
                        ids = torch.cat([ids, token.unsqueeze(1)], dim=1)
                    done |= torch.isin(token, ends)
                    if (n % CHECK_EVERY == 0 and self._finished(done)) or n == self.max_new:
                        break
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                    positions = positions[:, -1:] + 1
                    logits = net(
                        input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True,
                    ).logits  # fmt: skip
        finally:
            net.train(was_training)
        return _trimmed(torch.stack(out, dim=1).tolist() if out else [[]] * len(prompts), self.eos)

    def _draw(self, logits: torch.Tensor, generator: torch.Generator, seen=None):
        """One token a row, from :meth:`probabilities`."""
        probs = self.probabilities(logits, seen)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    def probabilities(self, logits: torch.Tensor, seen: torch.Tensor | None = None):
        """What each row samples from (unnormalised): the repetition penalty on the tokens
        ``seen`` [B, T] (the left-padded prompt and the completion so far, as transformers'
        processor reads its input ids), then temperature, top-k, top-p and min-p, in the order
        of transformers' logits processors and sampling warpers (what TRL's generation
        applies)."""
        logits = logits.float()
        if self.repetition_penalty != 1.0 and seen is not None:
            picked = logits.gather(-1, seen)
            picked = torch.where(picked < 0, picked * self.repetition_penalty,
                                 picked / self.repetition_penalty)  # fmt: skip
            logits = logits.scatter(-1, seen, picked)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if 0 < self.top_k < probs.shape[-1]:
            kth = probs.topk(self.top_k, dim=-1).values[..., -1:]
            probs = probs.masked_fill(probs < kth, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        if self.top_p < 1.0:
            # Keep the most likely tokens whose mass reaches top_p (at least the first one).
            ordered, order = probs.sort(dim=-1, descending=True)
            before = ordered.cumsum(-1) - ordered
            ordered = ordered.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        if self.min_p:  # relative to the most likely token left
            probs = probs.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), 0.0)
        return probs

    def _finished(self, done: torch.Tensor) -> bool:
        # Under FSDP a rank that stopped early would leave the others waiting in their next
        # forward's all-gather: all stop together, when every rank's rows are done.
        left = torch.tensor([float((~done).sum())])
        if self.synced:
            dist.all_reduce(left)
        return left.item() == 0


def _prefilled(net, prompts: list[list[int]], pad: int, cache, device):
    """The prompts' first forward, each distinct prompt once (a GRPO group's completions share
    theirs), then its cache rows and last logits repeated for each of its completions: the
    left-padded (ids, mask, positions) of every prompt, and [B, 1, V] logits."""
    distinct = list(dict.fromkeys(tuple(p) for p in prompts))
    ids, mask = _left_padded(distinct, pad, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = net(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
        use_cache=True, logits_to_keep=1,
    ).logits  # fmt: skip
    if len(distinct) < len(prompts):
        where = {p: i for i, p in enumerate(distinct)}
        rows = torch.tensor([where[tuple(p)] for p in prompts], device=device)
        cache.reorder_cache(rows)
        ids, mask, positions, logits = ids[rows], mask[rows], positions[rows], logits[rows]
    return ids, mask, positions, logits


def _left_padded(prompts, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _trimmed(rows: list[list[int]], eos: tuple[int, ...]) -> list[list[int]]:
    """Each completion up to and including its first end-of-sequence token (TRL's mask)."""
    out = []
    for row in rows:
        ends = [i for i, t in enumerate(row) if t in eos]
        out.append(row[: ends[0] + 1] if ends else row)
    return out


def stop_tokens(tok, net) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's end-of-sequence and those of the
    model's generation config (a chat model's end of turn, e.g. Llama 3's <|eot_id|>), as
    TRL's eos_token_ids."""
    found = [tok.eos_token_id]
    config = getattr(net, "generation_config", None)
    more = getattr(config, "eos_token_id", None)
    found += more if isinstance(more, list) else [more]
    return tuple(dict.fromkeys(t for t in found if t is not None))


@contextlib.contextmanager
def _cached_attention(net):
    """transformers' sdpa while sampling: ftjob's packed attention takes no KV cache (it
    runs documents without a mask); the weights and the math are the same."""
    config = net.config
    kept = config._attn_implementation
    if kept == attention.NAME:
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = kept


@contextlib.contextmanager
def _gathered_once(net):
    """Under FSDP2, every sharded module gathered once for the whole sampling rather than once
    per token: the forwards of a completion keep their parameters whole (the root already
    does), and one reshard each at the end frees them. The planner counts the whole model
    gathered beside the KV cache. Nothing to do for a plain module."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in net.modules() if isinstance(m, FSDPModule)]
    kept = [_reshards_after_forward(m) for m in sharded]
    for m in sharded:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, reshard in zip(sharded, kept, strict=True):
            m.reshard()
            m.set_reshard_after_forward(reshard, recurse=False)


def _reshards_after_forward(module) -> bool:
    """Whether an FSDP2 module frees its gathered parameters after forward (full sharding's
    layers do; grad-op's and the root do not): FSDP2 keeps it as the mesh it reshards to."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    return any(g.post_forward_mesh_info is not None for g in groups)
