"""A module's class swapped in place for a subclass of it: how the written-out layers
(norms.py, rotary.py) take over transformers' own, keeping each module's parameters, buffers
and names, so that checkpoints, sharding and the export see nothing new."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap(model: nn.Module, subclass: Callable[[type], type | None]) -> int:
    """Give every module of ``model`` the class ``subclass(its class)`` where that is not
    None; how many there were."""
    swapped = 0
    for module in model.modules():
        new = subclass(type(module))
        if new is not None:
            module.__class__ = new
            swapped += 1
    return swapped
