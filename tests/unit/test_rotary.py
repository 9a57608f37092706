"""trainer/model/rotary.py: the written-out rotary embedding gives transformers' values and
gradients, in the model as alone, and leaves other rotary code alone.

    python -m pytest tests/unit/test_rotary.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_norms import assert_rounding, trained
from transformers import AutoModelForCausalLM
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXConfig
from transformers.models.llama import modeling_llama

from ftjob.trainer.model import rotary

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"


@pytest.mark.parametrize(("dtype", "table_dtype"), [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),  # FSDP's bf16 compute
    (torch.bfloat16, torch.float32),  # autocast: bf16 q and k, fp32 tables, fp32 results
])  # fmt: skip
def test_the_written_out_rotation_gives_transformers_values_and_gradients(dtype, table_dtype):
    torch.manual_seed(0)
    # q and k as attention makes them: [B, S, H, D] projections seen as [B, H, S, D]
    q = torch.randn(2, 11, 4, 16).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 11, 2, 16).to(dtype).transpose(1, 2).requires_grad_()
    angles = torch.randn(2, 11, 8)
    # tables whose halves differ (transformers' repeat them): each half must be its own
    cos = torch.cat([angles.cos(), (angles * 0.5).cos()], -1).to(table_dtype)
    sin = torch.cat([angles.sin(), (angles * 0.5).sin()], -1).to(table_dtype)
    results = []
    for apply in (modeling_llama.apply_rotary_pos_emb, rotary.apply_rotary_pos_emb):
        q.grad = k.grad = None
        out = apply(q, k, cos, sin)
        torch.autograd.backward(out, [o.detach().cos() for o in out])
        results.append([*out, q.grad, k.grad])
    for want, got in zip(*results, strict=True):
        assert_rounding(got, want, dtype)
    # Tables that learn (and torch.compile's tracing) take transformers' operations themselves.
    cos.requires_grad_()
    ours = rotary.apply_rotary_pos_emb(q, k, cos, sin)
    theirs = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert ours[0].grad_fn is not None and "Rotate" not in type(ours[0].grad_fn).__name__


def test_the_tiny_model_trains_alike_and_other_rotary_code_is_left_alone():
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    fused = copy.deepcopy(reference)
    assert rotary.fuse(fused) == 2  # one attention per decoder layer
    assert type(fused.model.layers[0].self_attn).__name__ == "RotaryLlamaAttention"
    assert modeling_llama.apply_rotary_pos_emb is not rotary.apply_rotary_pos_emb  # untouched
    (want, want_grads), (got, grads) = (trained(net) for net in (reference, fused))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        assert_rounding(grad, want_grads[name], torch.float32)
    config = GPTNeoXConfig(hidden_size=32, num_attention_heads=4)
    neox = torch.nn.Sequential(GPTNeoXAttention(config, 0))
    assert rotary.fuse(neox) == 0 and type(neox[0]) is GPTNeoXAttention  # partial rotary
