"""Next-token training (training.objective sft): the summed next-token loss over the labelled
tokens, and no metric beside it (api/objectives.py declares none)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from ftjob.api import objectives
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import context_slice
from ftjob.trainer.model import context
from ftjob.trainer.objectives.loss import token_loss
from ftjob.trainer.objectives.offline import Offline


@dataclass(frozen=True)
class NextToken(Offline):
    """Next-token loss (SFT)."""

    declared: ClassVar[objectives.Objective] = objectives.SFT
    unit: str = "sequences"  # what a data set holds, in the log

    @classmethod
    def of(cls, spec: FineTuneJobSpec) -> NextToken:
        return cls()

    def collate(self, rows: list[dict], pad_id: int) -> data.Batch:
        # One row of the micro-batch's real tokens: no padding runs through the model, for
        # the same loss (measured: 1.2% of the tokens the packed bench jobs ran were padding,
        # 29% of an unpacked micro-batch of 4 of the same data). Its length varies from step
        # to step: under training.compile the layers recompile once, with a dynamic length.
        return data.collate(rows, pad_id, flat=True)

    def count(self, batch: data.Batch) -> int:
        """What the step's loss is a mean over: labelled tokens (a host number)."""
        return batch.labelled

    def loss(self, net, batch: data.Batch, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The micro-batch's summed loss, and no metric sums."""
        return token_loss(net, batch, device)[0], None

    def before_training(self, spec, net, ds: data.Data, d, log, folder) -> None:
        """Nothing to compute from the loaded model before the first step."""

    def step_metrics(self, sums: list[float]) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def evaluate(self, net, ds: data.Data, d, micro_batch: int) -> tuple[float, dict]:
        """Mean next-token loss over the whole eval set (all ranks), and no other metric."""
        net.eval()
        total = torch.zeros((), dtype=torch.float64, device=d.device)
        labelled = 0
        for batch in _eval_batches(ds, d, micro_batch):
            part, count = token_loss(net, batch, d.device)
            total += part
            labelled += count  # a host count: the loop never waits for the device
        device = d.device
        sums = torch.stack(
            [total, torch.tensor(float(labelled), dtype=torch.float64, device=device)]
        )
        dist.all_reduce(sums)
        net.train()
        return float(sums[0] / sums[1]), {}


def _eval_batches(ds: data.Data, d, micro_batch: int) -> list[data.Batch]:
    """This rank's eval batches: with context parallelism (:func:`context.active`) its group
    reads one share of the eval set, and each rank keeps its slice of every sequence."""
    cp = context.active()
    if cp is None:
        return data.eval_batches(ds, d.rank, d.world_size, micro_batch)
    batches = data.eval_batches(ds, d.rank // cp.size, d.world_size // cp.size, micro_batch)
    return [context_slice.cut(b, cp.rank, cp.size, ds.pad_id) for b in batches]
