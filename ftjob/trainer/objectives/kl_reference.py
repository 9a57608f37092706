"""GRPO's reference model (training.grpo.beta > 0): what the KL term compares the policy with.

One seam, :class:`Reference`, gives the network whose log-probabilities are the reference's
for the time of a forward:

* LoRA and QLoRA (:class:`AdaptersOff`): the policy itself with its adapters off, which is
  the starting model; nothing more is held.
* a full fine-tune (:class:`FrozenCopy`): every weight trains, so the starting model is a
  second, frozen copy read from ``model.source`` (:func:`load_copy`), in the compute
  precision and laid out as the policy is (sharded on its mesh, or whole where the policy
  is whole: trainer/model/parallel.py ``frozen``), in eval mode, with no gradient and no
  optimizer state. DPO's full fine-tune stores the starting model's log-probabilities once
  (reference.py); GRPO cannot, as its completions are sampled online.

    python -m pytest tests/e2e/test_grpo_reference.py tests/unit/test_grpo_exact.py -q
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.trainer.model import load as model
from ftjob.trainer.model import parallel
from ftjob.trainer.objectives import loss
from ftjob.trainer.objectives.reference import adapters_off


class Reference(Protocol):
    """The reference of the KL term."""

    def network(self, policy: nn.Module) -> AbstractContextManager[nn.Module]:
        """The network to run the reference forward on, for the time of a ``with``."""


@dataclass(frozen=True)
class AdaptersOff:
    """LoRA and QLoRA: the policy with its adapters off."""

    def network(self, policy: nn.Module) -> AbstractContextManager[nn.Module]:
        return adapters_off(policy)


@dataclass(frozen=True)
class FrozenCopy:
    """A full fine-tune: a frozen copy of the starting model (:func:`load_copy`)."""

    net: nn.Module

    def network(self, policy: nn.Module) -> AbstractContextManager[nn.Module]:
        return contextlib.nullcontext(self.net)


def of(
    spec: FineTuneJobSpec, policy: nn.Module, d: parallel.Dist, tokenizer,
    log: Callable[[str], None] = print,
) -> Reference:  # fmt: skip
    """The job's reference: the policy without its adapters, or for a full fine-tune a
    frozen copy of the starting model, loaded now."""
    if spec.method.type != "full":
        return AdaptersOff()
    began = time.monotonic()
    net, read = load_copy(spec, policy, d, tokenizer)
    mesh = parallel.sharded_on(net)
    laid = f"sharded as the policy over {mesh.size()} ranks" if mesh else "whole, as the policy"
    log(
        f"reference: a frozen copy of {spec.model.source} in {spec.compute_precision()}, "
        f"{laid}; this rank read {read / 2**30:.2f} GiB in {time.monotonic() - began:.1f} s"
    )
    return FrozenCopy(net)


def load_copy(
    spec: FineTuneJobSpec, policy: nn.Module, d: parallel.Dist, tokenizer
) -> tuple[nn.Module, int]:
    """The starting model again, as the policy was loaded (built empty, the loss head
    installed, laid out, then every rank reads its own part of the weights), frozen; and the
    bytes this rank read.

    It is never checkpointed: a resumed run reads it again from ``model.source``, which
    holds the initial weights (a checkpoint holds the policy's, which have moved)."""
    built = model.build(spec, tokenizer, frozen=True)
    loss.install(built.model)  # the chunked head: no whole logits for the reference either
    net = parallel.frozen(built.model, spec, d, policy)
    model.materialize(built, d, spec.parallelism.cpu_offload)
    net.eval()  # no dropout: the starting model's own distribution
    return net, built.read_bytes
