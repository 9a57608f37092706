"""peft's LoRA linear layers with the adapter's output added inside a GEMM.

peft's vanilla LoRA forward is ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides
its three matmuls, a multiply and an add over the whole [tokens, out] output, and that
multiply again in the backward, memory-bound passes over the largest tensors a LoRA layer
makes. ``torch.addmm(base(x), A(x), B.T, alpha=scaling)`` does the scaling and the add in the
second matmul's own write (BLAS's alpha and beta), in the same order: the same values
(tests/unit/test_lora.py, bit for bit in fp32 on CPU) for two fewer passes forward and one
backward (measured: 3.6% of a 190M LoRA step's CPU time, seq 512, one thread).

The layer stays peft's (:func:`fuse` changes only its class's forward): the same parameters
and names for checkpoints, FSDP and the export. Anything but one plain adapter (disabled or
merged adapters, DoRA and other variants, a bias on lora_B, mixed dtypes without autocast)
takes peft's own forward. The output head is left to trainer/objectives/loss.py, which gives
an adapted head its chunked loss.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def fuse(model: nn.Module) -> int:
    """Give every peft LoRA linear layer of ``model`` but its output head the fused forward;
    how many there were."""
    from peft.tuners.lora import Linear as LoraLinear

    head = model.get_output_embeddings()
    fused = 0
    for module in model.modules():
        if type(module) is LoraLinear and module is not head:
            module.__class__ = _fused(LoraLinear)
            fused += 1
    return fused


@functools.cache
def _fused(lora_linear: type) -> type:
    class FusedLoraLinear(lora_linear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            name = None if args or kwargs else _plain_adapter(self, x)
            if name is None:
                return super().forward(x, *args, **kwargs)
            result = self.base_layer(x)
            h = self.lora_A[name](self.lora_dropout[name](x))
            b, scaling = self.lora_B[name].weight, self.scaling[name]
            if result.dtype != h.dtype and not torch.is_autocast_enabled(x.device.type):
                return result + (h @ b.t()) * scaling  # peft's sum, in its dtypes
            out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]),
                              b.t(), alpha=scaling)  # fmt: skip
            return out.view(result.shape)

    return FusedLoraLinear


def _plain_adapter(layer, x: torch.Tensor) -> str | None:
    """The one active adapter's name where peft's forward would be the plain sum, else None."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant:
        return None
    if layer.lora_B[name].bias is not None:
        return None
    same = x.dtype == layer.lora_A[name].weight.dtype
    return name if same or torch.is_autocast_enabled(x.device.type) else None
