"""Llama's RMSNorm with its backward written out: three passes that write a tensor the size of
the activations (and a dot product that only reads them) where autograd's graph of the
forward's operations writes about eight.

transformers' RMSNorm forward (Llama's, and the same code in Qwen2/3, Mistral, Phi-3 and
others) is five element-wise operations; autograd differentiates each on its own, writing a
tensor the size of the layer's input at every step (the mean's expand and divide, the power's
two multiplies, the sums of the two paths). :class:`RmsNorm` keeps the forward operation for
operation (the same values, bit for bit) and computes the input's gradient from the saved
input and 1/rms: a multiply, a dot product, a multiply and a multiply-add
(tests/unit/test_norms.py: gradients to float32's rounding). A norm whose forward is other
code (Gemma's 1 + weight, OLMo-2's) keeps it: :func:`fuse` compares the code, not the name.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ftjob.trainer.model.swap import swap


def fuse(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` whose forward is Llama's code :class:`RmsNorm`; how
    many there were."""
    return swap(model, lambda m: _fused(type(m)) if _llama_code(type(m)) else None)


def _llama_code(cls: type) -> bool:
    """Whether ``cls.forward`` is transformers' LlamaRMSNorm.forward, copied or not (modular
    transformers copies it verbatim into each model's file)."""
    forward = getattr(cls, "forward", None)
    code, reference = getattr(forward, "__code__", None), _reference()
    if code is None or reference is None:
        return False
    return (code.co_code, code.co_consts, code.co_names) == reference


@functools.cache
def _reference() -> tuple | None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    code = LlamaRMSNorm.forward.__code__
    return code.co_code, code.co_consts, code.co_names


@functools.cache
def _fused(norm: type) -> type:
    class FusedRMSNorm(norm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return RmsNorm.apply(hidden_states, self.weight, self.variance_epsilon)

    FusedRMSNorm.__name__ = FusedRMSNorm.__qualname__ = f"Fused{norm.__name__}"
    return FusedRMSNorm


class RmsNorm(torch.autograd.Function):
    """``weight * (x / rms(x))``, x normalized in float32 and cast back to its dtype, as
    transformers computes it; the backward in closed form:
    dx = (g - x_hat * mean(g * x_hat)) / rms, g being the normalized input's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        x32 = x.to(torch.float32)
        # autograd's own casts: the product in the output's dtype, then the input's.
        g = (grad * weight).to(x.dtype).to(torch.float32)
        # mean(g * x_hat) / rms = dot(g, x) / (n * rms^2) / rms
        coef = torch.linalg.vecdot(g, x32).unsqueeze(-1) * rstd.pow(3) / x.shape[-1]
        dx = torch.addcmul(g * rstd, x32, coef, value=-1).to(x.dtype)
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = (grad * (x32 * rstd).to(x.dtype)).sum_to_size(weight.shape)
            dweight = dweight.to(weight.dtype)
        return dx, dweight, None
