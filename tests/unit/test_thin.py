"""trainer/model/thin.py: a sampled token's linear products with the weight on the left, on
CPU, for the rows where that is the faster GEMM in MKL, and the same values; where oneDNN is
the faster library (trainer/model/gemm.py), its product instead.

    python -m pytest tests/unit/test_thin.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ftjob.trainer.model import gemm, thin


def mm_shapes(fn) -> list[list[list[int]]]:
    """The operand shapes of every GEMM ``fn`` runs (mm or addmm: the last two operands)."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return [e.input_shapes[-2:] if e.name == "aten::mm" else e.input_shapes[1:3]
            for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "out", "turned"),
    [(4, 40, False), (8, 40, False), (8, 11000, True), (16, 40, True), (32, 40, True),
     (33, 11000, False)],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_a_thin_product_turns_around_where_it_is_faster_and_keeps_its_values(
    rows, out, turned, bias
):
    torch.manual_seed(0)
    layer = nn.Linear(48, out, bias=bias)  # 40 x 48: 7.7 kB; 11000 x 48: 2.1 MB
    x = torch.randn(rows, 1, 48)  # one token of each of `rows` completions
    with torch.no_grad():
        want, got = F.linear(x, layer.weight, layer.bias), thin.linear(x, layer.weight, layer.bias)
        shapes = mm_shapes(lambda: thin.linear(x, layer.weight, layer.bias))
    assert got.shape == want.shape == (rows, 1, out) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert shapes == [[[out, 48], [48, rows]] if turned else [[rows, 48], [48, out]]]


def test_under_autograd_or_for_a_tensor_subclass_it_is_torchs_own_linear():
    layer = nn.Linear(48, 40)
    x = torch.randn(16, 48, requires_grad=True)
    assert mm_shapes(lambda: thin.linear(x, layer.weight, layer.bias)) == [[[16, 48], [48, 40]]]

    class Tagged(torch.Tensor):  # stands for a DTensor or QLoRA's NF4 weight
        pass

    with torch.no_grad():
        tagged = layer.weight.detach().as_subclass(Tagged)
        assert mm_shapes(lambda: thin.linear(x, tagged, None)) == [[[16, 48], [48, 40]]]
        half = layer.to(torch.bfloat16)  # oneDNN's kernels on CPU: not measured
        assert mm_shapes(lambda: thin.linear(x.detach().bfloat16(), half.weight, None)) == [
            [[16, 48], [48, 40]]
        ]


def test_linears_swaps_a_networks_plain_linear_layers_for_the_sampling_only():
    class Custom(nn.Linear):  # another class's forward is its own
        pass

    net = nn.Sequential(nn.Linear(48, 40), nn.ReLU(), Custom(40, 8))
    x = torch.randn(16, 48)
    with torch.no_grad():
        want = net(x)
        with thin.linears(net):
            assert mm_shapes(lambda: net(x)) == [[[40, 48], [48, 16]], [[16, 40], [40, 8]]]
            got = net(x)
        with pytest.raises(RuntimeError), thin.linears(net):
            raise RuntimeError("a failed sampling")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert [type(m) for m in net] == [nn.Linear, nn.ReLU, Custom]


def test_a_compiled_network_samples_through_its_own_linear():
    net = nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 8))
    compiled = torch.compile(net, backend="eager", dynamic=True)
    with torch.no_grad(), thin.linears(net):
        for rows in (16, 8, 4):  # traced with a symbolic row count
            x = torch.randn(rows, 48)
            torch.testing.assert_close(
                compiled(x), net[2](net[1](F.linear(x, net[0].weight, net[0].bias)))
            )


def test_where_onednn_is_the_faster_library_sampling_keeps_its_product(monkeypatch):
    """A CPU job's layers where gemm.py's rule holds are gemm.Linear (load.build fuses them):
    thin.linears leaves them be, and a sampled token's products are oneDNN's."""
    monkeypatch.setattr(gemm, "onednn", lambda: True)
    net = nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 48))
    plain = copy.deepcopy(net)
    assert gemm.fuse(net) == 2
    x = torch.randn(16, 1, 48)
    with torch.no_grad(), thin.linears(net), torch.profiler.profile() as prof:
        assert [type(m) for m in net] == [gemm.Linear, nn.ReLU, gemm.Linear]
        got = net(x)
    names = [
        e.name for e in prof.events() if e.name.startswith(("aten::mm", "aten::addmm", "mkldnn"))
    ]
    assert names == ["mkldnn::_linear_pointwise"] * 2
    torch.testing.assert_close(got, plain(x), rtol=1e-5, atol=1e-5)
