"""Llama's rotary position embedding with its forward and backward written out: two passes over
q and k each way, where autograd's graph of transformers' code makes about eleven.

transformers' ``apply_rotary_pos_emb`` (Llama's, and the same code in Qwen2/3, Mistral and
others) computes ``q * cos + rotate_half(q) * sin``: a negation, a concatenation, two products
and a sum forward; backward, autograd adds zero-filled copies for the two slices and sums the
paths. Split into halves it is a rotation, ``(x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)``, whose
gradient is the transposed rotation: :class:`Rotate` computes each half with one product and
one multiply-add, forward and backward (tests/unit/test_rotary.py: values and gradients to the
dtype's rounding; ~1.9x faster on a 24M model's layer on CPU).

An attention whose forward calls Llama's code gets the same forward (its own code, unchanged)
with :func:`apply_rotary_pos_emb` in that code's globals; other rotary code (partial rotary,
interleaved pairs) is left as it is: :func:`fuse` compares the code, not the name.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from ftjob.trainer.model.swap import swap


def fuse(model: nn.Module) -> int:
    """Give every attention module of ``model`` whose forward calls Llama's rotary code
    :func:`apply_rotary_pos_emb` instead; how many there were."""
    return swap(model, lambda m: _fused(type(m)) if _calls_llama_rotary(type(m)) else None)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' function of the same name (and signature), written out."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    # Traced by torch.compile (training.compile), transformers' operations: inductor fuses
    # them whole, which no eager code matches (and dynamo takes no out= into a half). Tables
    # that learn keep autograd's graph of them too.
    if torch.compiler.is_compiling() or cos.requires_grad or sin.requires_grad:
        return _operations(q, cos, sin), _operations(k, cos, sin)
    return Rotate.apply(q, cos, sin), Rotate.apply(k, cos, sin)


def _operations(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as transformers writes it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _calls_llama_rotary(cls: type) -> bool:
    """Whether ``cls.forward`` calls a function ``apply_rotary_pos_emb`` whose code, and that
    of the ``rotate_half`` it calls, are transformers' Llama ones (modular transformers copies
    them verbatim into each model's file)."""
    forward = getattr(cls, "forward", None)
    names = getattr(forward, "__globals__", {})
    if "apply_rotary_pos_emb" not in getattr(getattr(forward, "__code__", None), "co_names", ()):
        return False
    found = names.get("apply_rotary_pos_emb"), names.get("rotate_half")
    reference = _reference()
    return all(
        _code(f) is not None and _code(f) == _code(r) for f, r in zip(found, reference, strict=True)
    )


def _code(function) -> tuple | None:
    code = getattr(function, "__code__", None)
    return None if code is None else (code.co_code, code.co_consts, code.co_names)


@functools.cache
def _reference() -> tuple:
    from transformers.models.llama import modeling_llama

    return modeling_llama.apply_rotary_pos_emb, modeling_llama.rotate_half


@functools.cache
def _fused(attention: type) -> type:
    """``attention`` whose forward is its own code, reading :func:`apply_rotary_pos_emb` from
    a copy of its module's globals (the module itself, and every other model, keep theirs)."""
    forward = attention.forward
    names = {**forward.__globals__, "apply_rotary_pos_emb": apply_rotary_pos_emb}
    rebound = types.FunctionType(
        forward.__code__, names, forward.__name__, forward.__defaults__, forward.__closure__
    )
    rebound.__kwdefaults__ = forward.__kwdefaults__
    fused = type(f"Rotary{attention.__name__}", (attention,), {"forward": rebound})
    fused.__qualname__ = fused.__name__
    return fused


class Rotate(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` for x [..., D] and tables broadcast to it, in the
    dtype the two would promote to, as transformers' code computes it; the tables take no
    gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, cos.dtype))
        _rotate(x, cos, sin, out, sign=1)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dx = torch.empty_like(grad)
        _rotate(grad, cos, sin, dx, sign=-1)  # the transpose: the rotation the other way
        return dx.to(ctx.dtype), None, None


def _rotate(x, cos, sin, out, sign: int) -> None:
    """``out`` = (x1 c1 - x2 s1, x2 c2 + x1 s2) for sign 1; sign -1 is its transpose,
    (x1 c1 + x2 s2, x2 c2 - x1 s1)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, c1, out=first)
    first.addcmul_(x2, s1 if sign > 0 else s2, value=-sign)
    torch.mul(x2, c2, out=second)
    second.addcmul_(x1, s2 if sign > 0 else s1, value=sign)
