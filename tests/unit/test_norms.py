"""trainer/model/norms.py: the written-out RMSNorm gives transformers' values and gradients,
and leaves a norm of other code alone.

    python -m pytest tests/unit/test_norms.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from ftjob.trainer.model import norms

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"


def values_and_grads(norm, x: torch.Tensor, trains: bool):
    x = x.detach().requires_grad_()
    norm.weight.requires_grad_(trains)
    out = norm(x)
    wrt = (x, norm.weight) if trains else (x,)
    return out.detach(), torch.autograd.grad(out, wrt, out.detach().cos().to(out.dtype))


def assert_rounding(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal to the dtype's rounding of the largest entry (the sums run in another order)."""
    assert got.dtype == want.dtype
    error = (got.float() - want.float()).abs().max()
    assert error <= torch.finfo(dtype).eps * 4 * want.float().abs().max()


def trained(net) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The tiny model's loss on a fixed batch, and every parameter's gradient."""
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    loss = net(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in net.named_parameters()}


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm])
@pytest.mark.parametrize(("dtype", "weight_dtype"), [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),  # FSDP's bf16 compute
    (torch.bfloat16, torch.float32),  # an fp32 weight that trains, bf16 activations
])  # fmt: skip
@pytest.mark.parametrize("trains", [False, True])
def test_the_written_out_norm_gives_transformers_values_and_gradients(
    cls, dtype, weight_dtype, trains
):
    torch.manual_seed(0)
    reference = cls(96, eps=1e-5).to(weight_dtype)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
    fused = copy.deepcopy(reference)
    assert norms.fuse(fused) == 1
    x = (torch.randn(3, 11, 96) * 4).to(dtype)
    want, want_grads = values_and_grads(reference, x, trains)
    got, grads = values_and_grads(fused, x, trains)
    assert torch.equal(got, want)  # the forward's operations, in order
    for grad, expected in zip(grads, want_grads, strict=True):
        assert_rounding(grad, expected, dtype)


def test_the_tiny_model_trains_alike_and_a_norm_of_other_code_is_left_alone():
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    fused = copy.deepcopy(reference)
    assert norms.fuse(fused) == 2 * 2 + 1  # two per decoder layer and the final one
    (want, want_grads), (got, grads) = (trained(net) for net in (reference, fused))
    assert torch.equal(got, want)
    for name, grad in grads.items():
        assert_rounding(grad, want_grads[name], torch.float32)
    gemma = torch.nn.Sequential(GemmaRMSNorm(8))  # 1 + weight: other code
    assert norms.fuse(gemma) == 0 and type(gemma[0]) is GemmaRMSNorm
