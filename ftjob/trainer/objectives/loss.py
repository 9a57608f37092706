"""Next-token loss through the output head, without ever holding a micro-batch's logits.

The head's output is the largest activation of a step: 4 x 2,048 tokens x a 128k vocabulary
are 2 GiB in bf16, and the usual ``logits.float()`` before the cross-entropy adds 4 GiB more,
plus the fp32 log-softmax autograd keeps for backward. Here the head computes its logits
``LOSS_CHUNK_TOKENS`` tokens at a time and turns each chunk into its loss *and its
gradients* (with respect to the hidden states and the head's weight) at once, keeping only
those gradients for the backward pass: Liger's fused linear cross-entropy, in plain torch, so
the same code runs on CPU and GPU.

The head stays the model's own ``nn.Linear`` (same parameter, same name, so checkpoints,
FSDP and the export see nothing new); :func:`install` gives it a forward that computes the
loss when the caller has set targets on it (:func:`token_loss`), and plain logits otherwise.

    python -m pytest tests/unit/test_loss.py -q
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ftjob.plan.modelshape import LOSS_CHUNK_TOKENS
from ftjob.trainer.data.tokenize import IGNORE
from ftjob.trainer.model import attention


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
            logits = (h @ weight.t()).float()  # this chunk only, in fp32
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
                grad_hidden[start : start + chunk] = grad @ weight
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).float()
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


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = LOSS_CHUNK_TOKENS,
) -> torch.Tensor:
    """Summed next-token loss of ``hidden`` [N, h] through a head ``weight`` [V, h] (fp32)."""
    # forward() runs with grad mode off: whether backward will come is asked here.
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, torch.is_grad_enabled())


class _LossHead(nn.Linear):
    """The output head with one addition: given targets, it returns their summed loss."""

    targets: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:  # evaluation by other code, generation, the export's checks
            return super().forward(hidden)
        return linear_cross_entropy(hidden.flatten(0, -2), self.weight, self.targets.flatten())


def install(model: nn.Module) -> bool:
    """Give the model's output head the loss forward (before sharding); False if its head is
    not a plain bias-free linear layer (e.g. adapted by peft), which keeps plain logits."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    head.__class__ = _LossHead
    return True


@contextlib.contextmanager
def _targets(head: nn.Module, targets: torch.Tensor):
    head.targets = targets
    try:
        yield
    finally:
        head.targets = None


def model_inputs(net: nn.Module, on) -> dict:
    """The forward's arguments for a ``data.Batch`` already on the device."""
    # No attention mask: the documents' boundaries travel as cu_seqlens
    # (ftjob.trainer.model.attention).
    inputs = dict(input_ids=on.input_ids, position_ids=on.position_ids, use_cache=False)
    inputs.update(attention.model_kwargs(on, net.config._attn_implementation))
    return inputs


def token_loss(net: nn.Module, batch, device: torch.device) -> tuple[torch.Tensor, int]:
    """Sum of next-token losses over the batch's labelled tokens, and their count (a host
    number from collate: reading it never waits for the device)."""
    on = batch.to(device)
    # Each position predicts the next token; a row's last position predicts nothing.
    targets = torch.full_like(on.labels, IGNORE)
    targets[:, :-1] = on.labels[:, 1:]
    inputs = model_inputs(net, on)
    head = net.get_output_embeddings()
    if isinstance(head, _LossHead):
        with _targets(head, targets):
            return net(**inputs).logits, batch.labelled
    logits = net(**inputs).logits
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss, batch.labelled
