"""Count the reads a piece of torch code makes from the device onto the host.

    with HostReads() as reads:
        loss.item()
    assert reads.count == 1

A read is what makes the host wait for a GPU's queue: a tensor's value turned into a Python
number or list (``item``, ``tolist``, ``bool(t)``, ``float(t)``, ``numpy``), an op whose output
shape depends on the data (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` without its output size), or a copy from a device to the CPU. On a CPU
run every tensor is on the host, so the counter counts what *would* wait on a GPU: every
value read and every data-dependent op, whatever the tensor's device. Memory that is host
memory in every run (numpy arrays, Python numbers) is not a tensor and is not counted.

Two torch hooks see them: a ``TorchFunctionMode`` the Python-level reads (``tolist`` and
``numpy`` reach no aten op on CPU), and a ``TorchDispatchMode`` the aten ops, also those
called from inside torch's own Python code (the optimizer, clip_grad_norm_, FSDP's hooks).
A read seen by both (``item`` -> ``aten._local_scalar_dense``) counts once. Both modes are
thread-local: work on other threads (data prefetch) is not counted.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Python-level reads of a tensor's values.
READ_METHODS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__index__: "index",
}

# aten ops that read values onto the host, or whose output's shape depends on the values.
READ_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.nonzero.default,
    # Not nonzero_static: its output's size is given, and CUDA computes it without a sync
    # (torch >= 2.6; tests/gpu/test_trainer_cuda.py checks it on the device).
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.equal.default,
}


def _bool_index(func, args) -> bool:
    """``t[mask]`` / ``t[mask] = v`` with a boolean mask: a nonzero inside the kernel."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(i is not None and i.dtype == torch.bool for i in indices)


def _unsized_repeat(func, args, kwargs) -> bool:
    return func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None


def _to_host(func, args, kwargs) -> bool:
    """A copy from a device (not the CPU) to the CPU."""
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        return target is not None and torch.device(target).type == "cpu" and args[0].is_cuda
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


class HostReads:
    """A context manager counting host reads (``count``), by kind (``kinds``), with the
    Python stack of each (``where``) for the message of a failing assertion."""

    def __init__(self) -> None:
        self.count = 0
        self.kinds: Counter[str] = Counter()
        self.where: list[str] = []
        self._inside = 0  # inside a counted Python-level read: its aten ops are the same read
        self._function = _FunctionCounter(self)
        self._dispatch = _DispatchCounter(self)

    def note(self, kind: str) -> None:
        self.count += 1
        self.kinds[kind] += 1
        stack = traceback.extract_stack()[:-3]
        here = [f for f in stack if "/torch/" not in f.filename][-3:][::-1]
        self.where.append(kind + " at " + " <- ".join(f"{f.name}:{f.lineno}" for f in here))

    def __enter__(self) -> HostReads:
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = READ_METHODS.get(func)
        if kind is None:
            return func(*args, **(kwargs or {}))
        if not self.reads._inside:
            self.reads.note(kind)
        self.reads._inside += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.reads._inside -= 1


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = (
            func in READ_OPS
            or _bool_index(func, args)
            or _unsized_repeat(func, args, kwargs)
            or _to_host(func, args, kwargs)
        )
        if read and not self.reads._inside:
            self.reads.note(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)
