"""A module's class swapped in place for a subclass of it: how the written-out layers
(lora.py, norms.py, rotary.py) take over peft's and transformers' own, keeping each module's
parameters, buffers and names, so that checkpoints, sharding and the export see nothing new."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap(model: nn.Module, subclass: Callable[[nn.Module], type | None]) -> int:
    """Give every module of ``model`` the class ``subclass(module)`` where that is not None;
    how many there were."""
    swapped = 0
    for module in model.modules():
        new = subclass(module)
        if new is not None:
            module.__class__ = new
            swapped += 1
    return swapped
