"""What a job trains for: the interface every objective has, and which one a spec names.

The loop, checkpoints, resume and progress are the same for every objective
(trainer/step.py, trainer/train.py); an objective says how rows become micro-batches, what a
step's loss averages over, the loss itself and the metrics beside it, which api/objectives.py
declares. A new objective is its declaration there, its module here and one entry in
:data:`OBJECTIVES`.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from ftjob.api import objectives
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.trainer.data import batches as data
from ftjob.trainer.objectives.dpo import Dpo
from ftjob.trainer.objectives.grpo import Grpo
from ftjob.trainer.objectives.next_token import NextToken


class Objective(Protocol):
    """What the loop asks of an objective (:class:`NextToken`, :class:`Dpo`, :class:`Grpo`)."""

    declared: ClassVar[objectives.Objective]  # its name and the metrics it reports
    unit: str  # what a data set holds, in the log

    @classmethod
    def of(cls, spec: FineTuneJobSpec) -> Objective:
        """The objective with the spec's settings."""

    def sampler(self, n: int, spec: FineTuneJobSpec, world: int) -> data.Sampler:
        """Which rows a rank reads at (step, micro-batch), as a pure function of them."""

    def collate(self, rows: list[dict], pad_id: int) -> data.Batch: ...

    def rollout(self, net, micro: list, step: int, d) -> list[data.Batch]:
        """The step's micro-batches as the loss takes them: the collated ones as they are,
        or (GRPO) with completions sampled from ``net`` and scored."""

    def held(self) -> dict | None:
        """What this rank holds between steps that a resume needs (plain lists and tensors):
        a checkpoint keeps it beside the rank's RNG streams."""

    def restore(self, held: dict | None) -> None:
        """:meth:`held` as the checkpoint resumed from kept it (None: nothing kept)."""

    def count(self, batch: data.Batch) -> int:
        """What the step's loss is a mean over (a host number)."""

    def loss(self, net, batch: data.Batch, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The micro-batch's summed loss, and its metric sums (None without metrics)."""

    def before_training(self, spec, net, ds: data.Data, d, log, folder) -> None: ...

    def step_metrics(self, sums: list[float]) -> dict[str, float]:
        """A logged step's metrics, by their declared keys, from its reduced sums."""

    def evaluate(self, net, ds: data.Data, d, micro_batch: int) -> tuple[float, dict]:
        """The eval set's mean loss and metrics (by their declared keys), over all ranks."""


# training.objective -> the trainer's objective, built from the spec.
OBJECTIVES = {o.declared.name: o.of for o in (NextToken, Dpo, Grpo)}


def of(spec: FineTuneJobSpec) -> Objective:
    """The job's objective."""
    return OBJECTIVES[spec.training.objective](spec)
