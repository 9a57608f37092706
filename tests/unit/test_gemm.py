"""trainer/model/gemm.py: float32 CPU products through oneDNN where the CPU is one MKL runs at
half speed; the same values and gradients as torch's linear, and torch's own everywhere else.

The rule is pinned both ways here (``monkeypatch`` on ``gemm.onednn``): every x86 wheel of
torch has oneDNN, so the oneDNN path runs on any CI machine, whatever its CPU.

    python -m pytest tests/unit/test_gemm.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ftjob.trainer.model import gemm


def ops(fn) -> list[str]:
    """The matrix products ``fn`` runs: torch's (MKL) and oneDNN's."""
    names = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")
    with torch.profiler.profile() as prof:
        fn()
    return [e.name for e in prof.events() if e.name in names]


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setattr(gemm, "onednn", lambda: True)


@pytest.mark.parametrize(
    ("vendor", "capability", "want"),
    [("AuthenticAMD", "AVX512", True), ("GenuineIntel", "AVX512", False),
     ("AuthenticAMD", "AVX2", False), ("", "AVX512", False)],
)  # fmt: skip
def test_the_rule_reads_the_cpu_vendor_and_torchs_instruction_set(
    monkeypatch, tmp_path, vendor, capability, want
):
    cpuinfo = tmp_path / "cpuinfo"
    if vendor:  # else unreadable, as on a system without /proc
        cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2\n")
    monkeypatch.setattr(gemm, "_CPUINFO", cpuinfo)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    gemm.onednn.cache_clear()
    try:
        assert gemm.onednn() is want
    finally:
        gemm.onednn.cache_clear()


def test_the_vendor_is_read_from_the_kernels_own_cpuinfo():
    """The file the rule reads in production, as this machine's kernel writes it."""
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        assert gemm._vendor() in ("AuthenticAMD", "GenuineIntel", "HygonGenuine", "CentaurHauls")
    else:  # Arm's cpuinfo has no vendor_id line: the rule keeps torch's own products
        assert gemm._vendor() == ""


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trains", [True, False])  # a frozen weight: the input's gradient only
def test_a_linear_layer_in_onednn_gives_torchs_values_and_gradients(onednn, bias, trains):
    torch.manual_seed(0)
    plain = nn.Linear(96, 40, bias=bias).requires_grad_(trains)
    layer = nn.Linear(96, 40, bias=bias).requires_grad_(trains)
    layer.load_state_dict(plain.state_dict())
    assert gemm.fuse(nn.Sequential(layer)) == 1 and type(layer) is gemm.Linear
    x = torch.randn(3, 24, 96)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = plain(x1)
    products = ops(lambda: layer(x2).mul(torch.linspace(-1, 1, 40)).sum().backward())
    want.mul(torch.linspace(-1, 1, 40)).sum().backward()
    assert products == ["mkldnn::_linear_pointwise"] * (3 if trains else 2)
    torch.testing.assert_close(layer(x2), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(layer.parameters(), plain.parameters(), strict=True):
        assert (mine.grad is None) == (not trains)
        if trains:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)


def test_mm_takes_transposed_operands_as_they_are(onednn):
    a, b = torch.randn(64, 32), torch.randn(48, 32)
    for left, right in ((a, b.t()), (a.t().contiguous().t(), b.t()), (b, a.t())):
        assert ops(lambda left=left, right=right: gemm.mm(left, right)) == [
            "mkldnn::_linear_pointwise"
        ]
        torch.testing.assert_close(gemm.mm(left, right), left @ right, rtol=1e-5, atol=1e-5)


def test_what_oneDNN_does_not_take_is_torchs_own_product(onednn):
    layer = nn.Linear(48, 40)
    gemm.fuse(nn.Sequential(layer))
    x = torch.randn(16, 48)

    class Tagged(torch.Tensor):  # stands for a DTensor or QLoRA's NF4 weight
        pass

    with torch.no_grad():
        assert ops(lambda: layer(x)) == ["mkldnn::_linear_pointwise"]
        assert ops(lambda: gemm.linear(x.double(), layer.weight.double())) == ["aten::mm"]
        assert "mkldnn::_linear_pointwise" not in ops(
            lambda: gemm.linear(x, layer.weight.detach().as_subclass(Tagged))
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert ops(lambda: layer(x)) == ["aten::addmm"]  # autocast's cast, then torch's
    compiled = torch.compile(layer, backend="eager")
    with torch.no_grad():
        compiled(x)  # traced here: the graph holds torch's linear, which runs below
        assert ops(lambda: compiled(x)) == ["aten::addmm"]
    torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias))


def test_fuse_swaps_plain_linear_layers_only_where_the_rule_holds(monkeypatch):
    class Custom(nn.Linear):  # another class's forward is its own (float8's, say)
        pass

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Custom(8, 4))
    keys = list(net.state_dict())
    monkeypatch.setattr(gemm, "onednn", lambda: False)
    assert gemm.fuse(net) == 0 and type(net[0]) is nn.Linear
    monkeypatch.setattr(gemm, "onednn", lambda: True)
    assert gemm.fuse(net) == 1
    assert [type(m) for m in net] == [gemm.Linear, nn.ReLU, Custom]
    assert list(net.state_dict()) == keys  # checkpoints and exports see nothing new


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_trainer_builds_its_layers_with_onednns_products_and_its_loss_head(onednn, method):
    net = _built(method, gpus=0)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is gemm.Linear for m in linears)
    if method == "lora":  # the adapters' products still added inside the base's (lora.py)
        adapted = [m for m in net.modules() if type(m).__name__ == "FusedLoraLinear"]
        assert adapted and all(type(m.base_layer) is gemm.Linear for m in adapted)
    from ftjob.trainer.objectives import loss

    assert loss.install(net)  # the head takes the chunked loss, its chunks oneDNN's products


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_gpu_jobs_layers_stay_torchs_on_any_host(onednn, method):
    """A GPU job multiplies in cuBLAS: its layers keep torch's class even where the host CPU
    is one the rule takes (an AMD host of GPUs), so its step is the one measured before."""
    net = _built(method, gpus=1)
    assert not any(isinstance(m, gemm.Linear) for m in net.modules())
    assert any(type(m) is nn.Linear for m in net.modules())


def _built(method: str, gpus: int) -> nn.Module:
    """The trainer's model (load.build, on the meta device) of the bundled tiny model."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from ftjob.api.jobspec import parse_spec
    from ftjob.trainer.model import load

    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
    spec = parse_spec({
        "model": {"source": str(tiny)},
        "dataset": {"source": "d.jsonl"},
        "method": {"type": method},
        "training": {"maxSteps": 1},
        "resources": {"gpusPerNode": gpus},
    })  # fmt: skip
    return load.build(spec, AutoTokenizer.from_pretrained(tiny)).model


def test_a_product_oneDNN_refuses_is_torchs_own(onednn):
    """oneDNN's refusal ("could not create a primitive") names no cause; torch's product runs
    instead: its values where it has them, its own words where the operands are wrong. (Memory
    short of oneDNN's working space is the case that matters: test_status's host-oom run.)"""
    x, w = torch.randn(5, 0), torch.randn(40, 0)  # an empty inner dimension: zeros
    with pytest.raises(RuntimeError, match="could not create a primitive"):
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    with pytest.warns(UserWarning, match="oneDNN refused"):
        assert torch.equal(gemm.linear(x, w), torch.zeros(5, 40))
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="cannot be multiplied"):
        gemm.mm(torch.randn(5, 96), torch.randn(95, 40))
