"""peft's LoRA linear layers as one autograd function that writes the adapter into the base's
GEMMs.

peft's vanilla LoRA forward is ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides its
three matmuls, a multiply and an add over the whole [tokens, out] output forward, and in the
backward an add of the input's two gradients (the base's and the adapter's) over the whole
[tokens, in] input: memory-bound passes over the largest tensors a LoRA layer makes.
:class:`LoraMatmuls` adds the adapter's product inside the GEMM that already writes each of
those tensors (BLAS's alpha and beta: ``y.addmm_(h, B.T, alpha=scaling)`` forward,
``dx.addmm_(dh, A)`` backward), with the products peft's autograd computes, in the same order
(tests/unit/test_lora.py: values bit for bit, gradients to float32's rounding, on CPU).

The layer stays peft's (:func:`fuse` changes only its class's forward): the same parameters
and names for checkpoints, FSDP and the export. The function needs one plain adapter on a plain
``nn.Linear`` with plain tensors (not QLoRA's NF4, not a DTensor) in one dtype and no
autocast; anything else (disabled or merged adapters, DoRA and other variants, a bias on
lora_B, a quantized or float8 base, mixed dtypes) takes peft's own forward. The output head
is left to trainer/objectives/loss.py, which gives an adapted head its chunked loss.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ftjob.trainer.model import gemm
from ftjob.trainer.model.swap import swap


def fuse(model: nn.Module) -> int:
    """Give every peft LoRA linear layer of ``model`` but its output head the fused forward;
    how many there were."""
    from peft.tuners.lora import Linear as LoraLinear

    head = model.get_output_embeddings()
    return swap(
        model, lambda m: _fused(LoraLinear) if type(m) is LoraLinear and m is not head else None
    )


@functools.cache
def _fused(lora_linear: type) -> type:
    class FusedLoraLinear(lora_linear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            name = None if args or kwargs else _plain_adapter(self, x)
            if name is None:
                return super().forward(x, *args, **kwargs)
            base = self.base_layer
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            dropped = self.lora_dropout[name](x)  # x itself where the dropout is nn.Identity
            if not torch.is_grad_enabled():  # sampling, evaluation: the products, no function
                return _adapted(base(x), dropped, a, b, self.scaling[name])
            return LoraMatmuls.apply(x, dropped, base.weight, base.bias, a, b, self.scaling[name])

    return FusedLoraLinear


def _plain_adapter(layer, x: torch.Tensor) -> str | None:
    """The one active adapter's name where peft's forward would be the plain sum on a plain
    linear base, every operand in x's dtype and no autocast to change it; else None."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant:
        return None
    if layer.lora_B[name].bias is not None or type(layer.base_layer) not in gemm.LINEARS:
        return None
    if torch.is_autocast_enabled(x.device.type):
        return None
    weights = (layer.base_layer.weight, layer.lora_A[name].weight, layer.lora_B[name].weight)
    # A tensor subclass (QLoRA's NF4, a DTensor) has its own matmuls: F.linear dispatches them.
    plain = all(type(w) in (nn.Parameter, torch.Tensor) for w in weights)
    return name if plain and all(w.dtype == x.dtype for w in weights) else None


class LoraMatmuls(torch.autograd.Function):
    """``x W^T + bias + scaling * (dropped A^T) B^T``, dropped being x after the adapter's
    dropout (x itself without one), in autograd's own products (torch's mm_mat1_backward and
    mm_mat2_backward for row-major inputs and transposed weights)."""

    @staticmethod
    def forward(ctx, x, dropped, weight, bias, a, b, scaling):
        x2 = x.reshape(-1, x.shape[-1])
        d2 = x2 if dropped is x else dropped.reshape(-1, dropped.shape[-1])
        y = gemm.linear(x2, weight, bias)
        h = torch.mm(d2, a.t())
        y.addmm_(h, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, d2, weight, a, b, h)
        ctx.scaling, ctx.shared, ctx.shape = scaling, dropped is x, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, d2, weight, a, b, h = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = _scaled(dy2.mm(b), ctx.scaling)
        dx = dx_dropped = None
        if need[0] or need[1]:
            dx = gemm.mm(dy2, weight)
            if ctx.shared:
                dx.addmm_(dh, a)  # the adapter's share, in the GEMM that writes the base's
            else:
                dx_dropped = dh.mm(a).view(ctx.shape)
            dx = dx.view(ctx.shape)
        return (
            dx,
            dx_dropped,
            gemm.mm(dy2.t(), x2) if need[2] else None,
            dy2.sum(0) if need[3] else None,
            dh.t().mm(d2) if need[4] else None,
            _scaled(dy2.t().mm(h), ctx.scaling) if need[5] else None,
            None,
        )


def _adapted(y: torch.Tensor, dropped: torch.Tensor, a, b, scaling: float) -> torch.Tensor:
    """The base layer's output ``y`` with the adapter's product added in the GEMM, as
    :class:`LoraMatmuls` forward; the base's own forward wrote ``y`` (while sampling, the
    weight-on-the-left GEMM of trainer/model/thin.py)."""
    h = torch.mm(dropped.reshape(-1, dropped.shape[-1]), a.t())
    y.view(-1, y.shape[-1]).addmm_(h, b.t(), alpha=scaling)
    return y


def _scaled(t: torch.Tensor, scaling: float) -> torch.Tensor:
    """autograd's maybe_multiply: no pass over t where the factor is one."""
    return t if scaling == 1 else t * scaling
