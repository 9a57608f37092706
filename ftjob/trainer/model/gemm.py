"""float32 matrix products on CPU through oneDNN where torch's BLAS would run them at half speed.

torch's CPU wheels multiply float32 matrices with MKL (``torch.mm``, ``F.linear`` and their
derivatives). MKL chooses its kernels by the CPU's vendor: on a CPU that is not Intel's it runs
its AVX2 kernels even where the CPU has AVX-512 (AMD's Zen 5 here; Zen 4's too, not
measured), and no environment variable changes that any more (MKL_ENABLE_INSTRUCTIONS,
MKL_DEBUG_CPU_TYPE, MKL_CBWR: measured, no effect). oneDNN, in the same wheels
(``torch.ops.mkldnn._linear_pointwise``, inductor's CPU linear), chooses by instruction set.
On an AMD EPYC with AVX-512 (Zen 5, one thread, 512 rows):
MKL 103-108 GFLOP/s, oneDNN 213-249 for each product a linear layer's forward and backward
make (``x W^T``, ``dy W``, ``dy^T x``; transposed views are taken as they are, no copy), and
faster at every thin shape sampling makes from 4 rows up.

:func:`onednn` is that rule: it reads the CPU, never a clock, so every run on a machine computes
the same values (the two libraries' sums differ in the last bits). :func:`fuse` gives a
network's plain linear layers :class:`Linear` (oneDNN forward and backward); LoRA's layers
(lora.py) and the chunked head (objectives/loss.py) take :func:`linear` and :func:`mm` for
their own products; sampling keeps the layers' (thin.py turns plain ``nn.Linear`` only).
Only plain float32 CPU tensors outside torch.compile and autocast qualify (:func:`takes`);
everything else, GPUs and Intel's CPUs among it, keeps torch's own products: nothing else was
measured. A product oneDNN refuses (short of memory for its working space, say) is torch's,
with a warning.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ftjob.trainer.model.swap import swap

_CPUINFO = Path("/proc/cpuinfo")
# How oneDNN (through torch's ideep) says it cannot make a product, whatever the cause.
_REFUSED = "could not create a primitive"


@functools.cache
def onednn() -> bool:
    """Whether this CPU multiplies float32 faster in oneDNN than in torch's MKL: it has
    AVX-512 (as torch's own dispatch sees it), is not Intel's, and torch has oneDNN's linear."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return avx512 and _vendor() not in ("", "GenuineIntel")


def _vendor() -> str:
    """The CPU's vendor as Linux names it (``AuthenticAMD``, ``GenuineIntel``); "" elsewhere."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return ""
    line = next((x for x in text.splitlines() if x.startswith("vendor_id")), "")
    return line.partition(":")[2].strip()


def takes(*tensors: torch.Tensor | None) -> bool:
    """Whether a product of these operands (None: an absent bias) goes to oneDNN: the rule
    holds, each is a plain float32 CPU tensor, and neither torch.compile (whose kernels are
    inductor's to choose) nor CPU autocast (which casts what F.linear gets) is on."""
    if torch.compiler.is_compiling() or not onednn() or torch.is_autocast_enabled("cpu"):
        return False
    return plain_cpu_float32(*tensors)


def plain_cpu_float32(*tensors: torch.Tensor | None) -> bool:
    """Each is a plain (no subclass) float32 CPU tensor, or None (an absent bias)."""
    return all(
        t is None
        or (type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.float32 and t.is_cpu)
        for t in tensors
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN where :func:`takes` says so. Not
    differentiable: for no-grad code and autograd functions' own forward and backward."""
    return _onednn(x, weight, bias) if takes(x, weight, bias) else F.linear(x, weight, bias)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two matrices, as :func:`linear` (oneDNN takes ``b.t()`` as it is)."""
    return _onednn(a, b.t(), None) if takes(a, b) else torch.mm(a, b)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    try:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except RuntimeError as e:
        if not str(e).startswith(_REFUSED):
            raise  # torch's own words already (its allocator's, when memory is short)
        # oneDNN's refusal names no cause: an operand it has no kernel for (an empty inner
        # dimension), a shape torch would refuse in clearer words, or memory short of its
        # working space before any tensor is asked for (a container's limit). torch's product
        # runs instead, and says what is wrong if anything is: under a memory limit its
        # allocator's words, which the termination record names HostOOM.
        warnings.warn(f"oneDNN refused a float32 product ({e}); torch's own runs", stacklevel=2)
        return F.linear(x, weight, bias)


class Products(torch.autograd.Function):
    """``F.linear`` with :func:`linear`'s products forward and backward, in torch's own
    derivative formulas (the input's gradient ``dy W``, the weight's ``dy^T x``)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias = bias is not None
        return _onednn(x, weight, bias)  # Linear.forward asked takes() already

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])
        return (
            mm(dy2, weight).view(x.shape) if need[0] else None,
            mm(dy2.t(), x.reshape(-1, x.shape[-1])) if need[1] else None,
            dy2.sum(0) if need[2] and ctx.bias else None,
        )


class Linear(nn.Linear):
    """An ``nn.Linear`` whose products are :class:`Products` where :func:`takes` its operands."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not takes(x, self.weight, self.bias):
            return super().forward(x)
        return Products.apply(x, self.weight, self.bias)


# A plain linear layer, as lora.py (an adapter's base) and objectives/loss.py (the head) take it.
LINEARS = (nn.Linear, Linear)


def fuse(model: nn.Module) -> int:
    """Where :func:`onednn` holds, give every plain ``nn.Linear`` of ``model`` the class
    :class:`Linear` (parameters, names and checkpoints unchanged); how many there were."""
    if not onednn():
        return 0
    return swap(model, lambda m: Linear if type(m) is nn.Linear else None)
