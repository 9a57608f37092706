"""Next-token loss through the output head, without ever holding a micro-batch's logits.

The head's output is the largest activation of a step: 4 x 2,048 tokens x a 128k vocabulary
are 2 GiB in bf16, and the usual ``logits.float()`` before the cross-entropy adds 4 GiB more,
plus the fp32 log-softmax autograd keeps for backward. Here the head computes its logits
``LOSS_CHUNK_TOKENS`` tokens at a time and turns each chunk into its loss *and its
gradients* (with respect to the hidden states and the head's weight) at once, keeping only
those gradients for the backward pass: Liger's fused linear cross-entropy, in plain torch, so
the same code runs on CPU and GPU.

DPO and GRPO ask for each token's log-probability instead of a sum (:func:`token_logps`); its
gradient comes from above, so that path keeps one log-normaliser a token and computes each
chunk's logits again in backward (one more matmul a chunk, still never the whole logits). A head
adapted by peft's LoRA (``lm_head`` in targetModules) computes the same way from its merged
weight, W + scaling * B @ A, when its adapters have no dropout; with dropout it keeps whole
logits.

Only the positions that are learned reach the head's matmuls: a chat micro-batch learns from
its assistant turns alone (28% of the bundled chat data's tokens), and a GRPO or DPO batch from
its completions, so the rest of the logits would be computed only to be multiplied by zero. The
caller says how many targets are learned (a host count from collate), so selecting them never
waits for the device (``torch.nonzero_static``).

The head stays the model's own ``nn.Linear`` (same parameter, same name, so checkpoints,
FSDP and the export see nothing new); :func:`install` gives it a forward that computes the
loss when the caller has set targets on it (:func:`token_loss`), and plain logits otherwise.

    python -m pytest tests/unit/test_loss.py -q
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ftjob.plan.modelshape import LOSS_CHUNK_TOKENS
from ftjob.trainer.data.batches import next_tokens
from ftjob.trainer.data.tokenize import IGNORE
from ftjob.trainer.model import attention, gemm


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, training: bool):  # noqa: D102
        # Under no_grad (evaluation) nothing will call backward: compute the loss alone.
        wants = [training and need for need in ctx.needs_input_grad[:2]]
        grad_hidden = torch.empty_like(hidden) if wants[0] else None
        # fp32 so that the chunks' contributions add up as one matmul would.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if wants[1]
            else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.size(0), chunk):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            logits = gemm.linear(h, weight).float()  # this chunk only, in fp32
            learn = t != IGNORE
            index = t.clamp(min=0).unsqueeze(1)
            norm = torch.logsumexp(logits, dim=-1)
            total += ((norm - logits.gather(1, index).squeeze(1)) * learn).sum()
            if grad_hidden is None and grad_weight is None:
                continue  # evaluation: the loss is all that is asked
            # d loss / d logits = softmax - one-hot, on the tokens that are learned
            grad = logits.sub_(norm.unsqueeze(1)).exp_()
            grad.scatter_add_(1, index, torch.full_like(index, -1, dtype=grad.dtype))
            grad = (grad * learn.unsqueeze(1)).to(h.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = gemm.mm(grad, weight)
            if grad_weight is not None:
                grad_weight += gemm.mm(grad.t(), h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: D102 - autograd's API
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def _learned_rows(targets: torch.Tensor, learned: int | None) -> torch.Tensor | None:
    """The indices of ``targets`` [N] that are not IGNORE, given how many there are (``learned``,
    a host number: nothing waits for the device to count them); None where every row is
    learned or the count is not known, and the head takes all rows."""
    if learned is None or learned >= targets.numel():
        return None
    return torch.nonzero_static(targets != IGNORE, size=learned).squeeze(1)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = LOSS_CHUNK_TOKENS,
    learned: int | None = None,
) -> torch.Tensor:
    """Summed next-token loss of ``hidden`` [N, h] through a head ``weight`` [V, h] (fp32);
    with ``learned`` (how many targets are not IGNORE), over those rows alone."""
    rows = _learned_rows(targets, learned)
    if rows is not None:  # autograd scatters the rows' gradients back (index_select's backward)
        hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)
    # forward() runs with grad mode off: whether backward will come is asked here.
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, torch.is_grad_enabled())


class _LinearLogProbs(torch.autograd.Function):
    """Each token's log-probability of its target under ``hidden @ weight.T``, chunk by chunk.

    A per-token result takes any gradient from above (DPO weighs each row by its pair's
    loss), so the gradients cannot be taken in forward as :class:`_LinearCrossEntropy` does:
    forward keeps one log-normaliser a token, and backward computes each chunk's logits again
    from the hidden states and the weight (one more matmul a chunk; never the whole logits).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, entropy):  # noqa: D102
        logps = torch.zeros(hidden.size(0), dtype=torch.float32, device=hidden.device)
        norms = torch.zeros_like(logps)
        for start in range(0, hidden.size(0), chunk):
            logits, t = _chunk_logits(hidden, weight, start, chunk), targets[start : start + chunk]
            norm = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            logps[start : start + chunk] = (picked - norm) * (t != IGNORE)
            norms[start : start + chunk] = norm
            if entropy is not None:  # H = log Z - sum p z, from the logits already at hand
                mean = ((logits - norm.unsqueeze(1)).exp_() * logits).sum(-1)  # p from log Z
                entropy[start : start + chunk] = (norm - mean) * (t != IGNORE)
        ctx.save_for_backward(hidden, weight, targets, norms)
        ctx.chunk = chunk
        # Backward recomputes under the precision forward ran in (autocast on one process).
        kind = hidden.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        return logps

    @staticmethod
    def backward(ctx, grad_logps):  # noqa: D102 - autograd's API
        hidden, weight, targets, norms = ctx.saved_tensors
        kind, enabled, dtype = ctx.autocast
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.size(0), ctx.chunk):
                end = start + ctx.chunk
                h, t = hidden[start:end], targets[start:end]
                g = grad_logps[start:end] * (t != IGNORE)
                # d logp / d logits = one-hot - softmax, times the token's gradient
                grad = _chunk_logits(hidden, weight, start, ctx.chunk)
                grad = grad.sub_(norms[start:end].unsqueeze(1)).exp_().mul_(-g.unsqueeze(1))
                grad.scatter_add_(1, t.clamp(min=0).unsqueeze(1), g.unsqueeze(1))
                grad = grad.to(h.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = gemm.mm(grad, weight)
                if grad_weight is not None:
                    grad_weight += gemm.mm(grad.t(), h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _chunk_logits(hidden, weight, start: int, chunk: int) -> torch.Tensor:
    """One chunk's logits, in fp32."""
    return gemm.linear(hidden[start : start + chunk], weight).float()


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = LOSS_CHUNK_TOKENS,
    entropy: torch.Tensor | None = None,
    learned: int | None = None,
) -> torch.Tensor:
    """[N] fp32: each token's log-probability of its target through a head ``weight`` [V, h]
    (0 where the target is IGNORE); the full [N, V] logits never exist. ``entropy`` [N] fp32,
    if given, is filled with each labelled position's entropy of the whole distribution (no
    gradient flows through it). With ``learned`` (how many targets are not IGNORE) the head
    computes those rows alone."""
    rows = _learned_rows(targets, learned)
    if rows is None:
        return _LinearLogProbs.apply(hidden, weight, targets, chunk, entropy)
    some = None if entropy is None else entropy.new_zeros(rows.numel())
    logps = _LinearLogProbs.apply(
        hidden.index_select(0, rows), weight, targets.index_select(0, rows), chunk, some
    )
    if entropy is not None:
        entropy.zero_().index_copy_(0, rows, some)
    return logps.new_zeros(targets.numel()).index_copy(0, rows, logps)


class _Asked:
    """What a loss head is asked for: with ``targets`` set, their summed loss, or
    (``per_token``) each target's log-probability shaped as the targets, instead of logits."""

    targets: torch.Tensor | None = None
    per_token: bool = False
    temperature: float = 1.0  # GRPO's log-probabilities are those of the sampling temperature
    entropy: torch.Tensor | None = None  # per_token: filled with each position's entropy
    learned: int | None = None  # how many targets are not IGNORE (a host number), if known

    def _loss(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat, targets = hidden.flatten(0, -2), self.targets.flatten()
        if self.temperature != 1.0:
            weight = weight / self.temperature  # logits / T, the logits never whole
        if self.per_token:
            ent = None if self.entropy is None else self.entropy.view(-1)
            every = linear_logprobs(flat, weight, targets, entropy=ent, learned=self.learned)
            return every.view(self.targets.shape)
        return linear_cross_entropy(flat, weight, targets, learned=self.learned)


class _LossHead(_Asked, gemm.Linear):
    """The plain output head, asked for a loss (:class:`_Asked`); else gemm.py's products."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:  # evaluation by other code, generation, the export's checks
            return super().forward(hidden)
        return self._loss(hidden, self.weight)


@functools.cache
def _adapted(lora_linear: type) -> type:
    """peft's LoRA linear layer as an output head asked for a loss: the same logits peft
    computes, base(x) + scaling * B(A(x)), taken as x @ (W + scaling * B @ A).T chunk by chunk;
    exact because :func:`_mergeable` lets in no dropout (nor DoRA, biases, merged weights)."""

    class _AdaptedLossHead(_Asked, lora_linear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if self.targets is None:
                return super().forward(x, *args, **kwargs)
            weight = self.base_layer.weight
            if not self.disable_adapters:  # DPO's reference turns them off
                for name in self.active_adapters:
                    b, a = self.lora_B[name].weight, self.lora_A[name].weight
                    weight = weight + (b @ a) * self.scaling[name]
            return self._loss(x, weight)

    return _AdaptedLossHead


def _mergeable(head: nn.Module) -> bool:
    """A peft LoRA head whose logits are those of one merged weight."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(head) is not LoraLinear or head.merged:
        return False
    base = head.base_layer
    return (
        type(base) in gemm.LINEARS
        and base.bias is None
        and all(isinstance(d, nn.Identity) for d in head.lora_dropout.values())
        and not any(head.use_dora.values())
        and all(b.bias is None for b in head.lora_B.values())
    )


def install(model: nn.Module) -> bool:
    """Give the model's output head the loss forward (before sharding); False if its head is
    neither a plain bias-free linear layer nor such a layer adapted by LoRA without dropout,
    which keeps plain logits."""
    head = model.get_output_embeddings()
    if type(head) in gemm.LINEARS and head.bias is None:
        head.__class__ = _LossHead
        return True
    if _mergeable(head):
        head.__class__ = _adapted(type(head))
        return True
    return False


@contextlib.contextmanager
def _targets(head: nn.Module, targets: torch.Tensor, learned: int | None, **asked):
    """``head`` asked for the loss of ``targets`` (and :class:`_Asked`'s other fields) for one
    forward, then for plain logits again."""
    head.targets, head.learned = targets, learned
    for name, value in asked.items():
        setattr(head, name, value)
    try:
        yield
    finally:
        for name in ("targets", "learned", "per_token", "temperature", "entropy"):
            vars(head).pop(name, None)  # back to the class's defaults


def model_inputs(net: nn.Module, on) -> dict:
    """The forward's arguments for a ``data.Batch`` already on the device."""
    # No attention mask: the documents' boundaries travel as cu_seqlens
    # (ftjob.trainer.model.attention).
    inputs = dict(input_ids=on.input_ids, position_ids=on.position_ids, use_cache=False)
    inputs.update(attention.model_kwargs(on, net.config._attn_implementation))
    return inputs


def token_loss(net: nn.Module, batch, device: torch.device) -> tuple[torch.Tensor, int]:
    """Sum of next-token losses over the batch's labelled tokens, and their count (a host
    number from collate: reading it never waits for the device). A context-parallel slice
    brings its targets, shifted over the whole sequence (trainer/data/context_slice.py)."""
    on = batch.to(device)
    targets = next_tokens(on.labels) if on.targets is None else on.targets
    inputs = model_inputs(net, on)
    head = net.get_output_embeddings()
    if isinstance(head, _Asked):
        with _targets(head, targets, batch.labelled):
            return net(**inputs).logits, batch.labelled
    logits = net(**inputs).logits
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss, batch.labelled


def sequence_logps(net: nn.Module, inputs: dict, on) -> torch.Tensor:
    """[N] fp32: each of the ``data.Batch`` ``on``'s sequences' (its spans) summed
    log-probability of its response tokens (DPO's), through the installed head chunk by
    chunk."""
    return span_view(token_logps(net, inputs, on.labels, learned=on.labelled), on.spans).sum(1)


def span_view(every: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """[B, S] per-position log-probabilities of the next token -> [N, C]: sequence i's
    response token j, predicted at flattened position spans[i][0] + j (0 past its length).
    One gather whatever the layout: rows of their own, or branches of a shared prompt."""
    starts = torch.tensor([start for start, _ in spans], dtype=torch.long)
    lengths = torch.tensor([n for _, n in spans], dtype=torch.long)
    j = torch.arange(max((n for _, n in spans), default=0))
    at = (starts.unsqueeze(1) + j).clamp(max=every.numel() - 1)
    kept = j < lengths.unsqueeze(1)
    return every.reshape(-1)[at.to(every.device)] * kept.to(every.device)


def token_logps(
    net: nn.Module, inputs: dict, labels: torch.Tensor, temperature: float = 1.0,
    entropy: torch.Tensor | None = None, learned: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """[B, S] fp32: at each position, the log-probability of the next labelled token under
    logits / ``temperature`` (GRPO's), 0 where the next token is not labelled; through the
    installed head chunk by chunk, or the model's whole logits where it has none. ``entropy``
    [B, S] fp32, if given, is filled with each such position's entropy of the next-token
    distribution (TRL's ``entropy``; no gradient). ``learned``: how many positions have a
    labelled next token (``data.Batch.labelled``); the head then computes those alone."""
    head = net.get_output_embeddings()
    targets = next_tokens(labels)
    if isinstance(head, _Asked):
        asked = dict(per_token=True, temperature=temperature, entropy=entropy)
        with _targets(head, targets, learned, **asked):
            return net(**inputs).logits
    logits = net(**inputs).logits.float() / temperature
    every = torch.log_softmax(logits, dim=-1)
    labelled = targets != IGNORE
    if entropy is not None:
        entropy.copy_(-(every.exp() * every).sum(-1).detach() * labelled)
    return every.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * labelled
