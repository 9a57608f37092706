"""trainer/model/lora.py: the fused LoRA forward gives peft's values and gradients, and leaves
what it does not fuse to peft.

    python -m pytest tests/unit/test_lora.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from transformers import AutoModelForCausalLM

from ftjob.trainer.model import lora

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj", "lm_head"]


def adapted(bias: bool = False, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    # attention_bias: q/k/v/o with a bias (Qwen's shape), drawn by the seed.
    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, attention_bias=bias)
    # Adapters drawn non-zero (B is zero at peft's start) and scaled by alpha / r = 4.
    settings = dict(r=4, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(base, LoraConfig(**{**settings, **config}))


def forward_backward(net, ids: torch.Tensor, seed: int = 1):
    torch.manual_seed(seed)  # the same dropout masks on both sides
    net.zero_grad()
    logits = net(input_ids=ids, use_cache=False).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}
    return logits.detach(), grads


@pytest.mark.parametrize(("dropout", "bias"), [(0.0, False), (0.1, False), (0.0, True)])
def test_the_fused_forward_gives_peft_s_values_and_gradients(dropout, bias):
    peft_net = adapted(bias, lora_dropout=dropout)
    if bias:  # a base that trains beside its adapters (peft's modules_to_save, say)
        for name, param in peft_net.named_parameters():
            param.requires_grad_(param.requires_grad or "q_proj.base_layer" in name)
    fused_net = copy.deepcopy(peft_net)
    # Every adapted linear layer but the output head (trainer/objectives/loss.py's).
    assert lora.fuse(fused_net) == 4 * 2
    assert type(fused_net.get_output_embeddings()) is LoraLinear
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    want, want_grads = forward_backward(peft_net, ids)
    got, grads = forward_backward(fused_net, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same operations, in order
    assert grads.keys() == want_grads.keys()
    assert any("base_layer.bias" in name for name in grads) == bias
    for name, grad in grads.items():
        # An input's two gradients summed inside a GEMM, not after it: float32's rounding
        # of the largest entry, no more.
        error = (grad - want_grads[name]).abs().max()
        assert error <= 1e-6 * want_grads[name].abs().max(), name
    torch.manual_seed(1)  # forward_backward's dropout masks
    with torch.no_grad():  # outside autograd: the same products without the function
        torch.testing.assert_close(fused_net(input_ids=ids).logits, want, rtol=0, atol=0)
    with fused_net.disable_adapter(), peft_net.disable_adapter(), torch.no_grad():
        base = fused_net(input_ids=ids).logits
        assert torch.equal(base, peft_net(input_ids=ids).logits) and not torch.equal(base, got)


def test_what_it_does_not_fuse_takes_peft_s_forward(monkeypatch):
    calls = []
    monkeypatch.setattr(lora.LoraMatmuls, "apply", lambda *a: calls.append(1))
    monkeypatch.setattr(lora, "_adapted", lambda *a: calls.append(2))
    ids = torch.randint(3, 1000, (1, 8))
    net = adapted(use_dora=True)  # a variant: peft's forward owns it
    lora.fuse(net)
    with torch.no_grad():
        net(input_ids=ids)
    assert not calls
    net = adapted()
    lora.fuse(net)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        net(input_ids=ids)  # autocast casts inside peft's matmuls: peft's forward
    assert not calls
    with pytest.raises(AttributeError):  # the fused path calls it: the stand-in returns None
        net(input_ids=ids)
    assert calls == [1]
    with pytest.raises(AttributeError), torch.no_grad():  # and outside autograd, its products
        net(input_ids=ids)
    assert calls == [1, 2]


def test_the_trainer_builds_its_lora_layers_fused():
    from ftjob.api.jobspec import parse_spec
    from ftjob.trainer.model import load

    spec = parse_spec({
        "model": {"source": str(TINY)},
        "dataset": {"source": "d.jsonl"},
        "method": {"type": "lora", "lora": {"targetModules": ["q_proj", "lm_head"]}},
        "training": {"maxSteps": 1},
    })  # fmt: skip
    net = load._adapters(AutoModelForCausalLM.from_pretrained(TINY), spec)
    adapted = [m for m in net.modules() if isinstance(m, LoraLinear)]
    assert type(net.get_output_embeddings()) is LoraLinear  # peft's own, for loss.py
    fused = [m for m in adapted if type(m).__name__ == "FusedLoraLinear"]
    assert len(fused) == len(adapted) - 1 == 2  # each layer's q_proj
