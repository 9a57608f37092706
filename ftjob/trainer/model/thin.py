"""A decode step's linear layers with the weight as the GEMM's left operand, on CPU.

Sampling runs the network on one token a completion: each linear layer multiplies a thin
[rows, in] activation by its [out, in] weight, transposed. CPU BLAS (MKL, in torch's wheels)
picks its kernel by the operands' shapes and layouts, and for some thin shapes computes the
same product faster as ``(W @ x^T)^T``, the weight on the left (float32, one thread, the
median of alternating runs): 1.1-1.6x at 16 to 32 rows for every weight measured (0.5 to 180
MB); at 8 rows 1.2-1.7x for a weight of 2.9 MB or more but 2x slower for 1 MB or less; below 8
rows 2-3x slower. :func:`turned` is that table; :func:`linears` gives a network's linear layers
the turned product while it samples (bench --suite kernels: a 190M LoRA model's sampling).
The rule reads shapes only, never a clock, so a resumed run samples what the first run did
(the two orientations' values can differ in the last bit). Other dtypes (bf16 takes oneDNN's
kernels on CPU) and GPUs keep torch's own: nothing here was measured there. The table is
MKL's: where gemm.py sends float32 products to oneDNN (AVX-512 CPUs that are not Intel's),
oneDNN's product is faster than either orientation from 4 rows up, and :func:`linears` leaves
those layers (gemm.Linear, not plain ``nn.Linear``) as they are.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ftjob.trainer.model import gemm

# The activation's rows (tokens) for which the weight-on-the-left GEMM was the faster: any
# weight measured, and a weight of BIG bytes or more (drawn between 1 MB, slower at 8 rows,
# and 2.9 MB, faster).
ROWS = range(16, 33)
BIG_ROWS = range(8, 33)
BIG = 2 << 20


def turned(rows: int, weight: torch.Tensor) -> bool:
    """Whether a [rows, in] float32 activation times ``weight`` transposed is faster with the
    weight on the left (the module's table)."""
    big = weight.numel() * weight.element_size() >= BIG
    return rows in ROWS or (big and rows in BIG_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``(weight @ x^T)^T`` where :func:`turned` says so,
    for plain float32 CPU tensors outside autograd and outside torch.compile (whose kernels
    are inductor's to choose)."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if not (gemm.plain_cpu_float32(x, weight) and turned(rows, weight)):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1]).t()
    y = torch.mm(weight, x2) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x2)
    # Back to row-major [rows, out] (a copy of rows x out values): what the consumers expect.
    return y.t().contiguous().view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def linears(net: nn.Module):
    """Inside: ``net``'s plain ``nn.Linear`` layers compute with :func:`linear`."""
    swapped = [m for m in net.modules() if type(m) is nn.Linear]
    for m in swapped:
        m.__class__ = _Thin
    try:
        yield
    finally:
        for m in swapped:
            m.__class__ = nn.Linear


class _Thin(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
