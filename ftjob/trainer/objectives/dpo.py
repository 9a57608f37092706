"""Direct preference optimization (training.objective dpo).

A micro-batch is whole preference pairs, chosen and rejected in one forward, the prompt run
once a pair where the trainer's packed attention runs (trainer/data/pairs.py); the loss is
trainer/objectives/preference.py's, the mean over the step's pairs, and its metrics are the
ones api/objectives.py declares for DPO. The reference (LoRA and QLoRA) is the same network
with its adapters disabled (:func:`adapters_off`); a full fine-tune's is the initial model's
log-probabilities, computed once before training and stored with the data
(trainer/objectives/reference.py), which each batch carries. No second model in memory either
way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.distributed as dist

from ftjob.api import objectives
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import pairs
from ftjob.trainer.objectives import preference, reference
from ftjob.trainer.objectives.loss import model_inputs, sequence_logps
from ftjob.trainer.objectives.offline import Offline
from ftjob.trainer.objectives.reference import adapters_off


@dataclass(frozen=True)
class Dpo(Offline):
    """Direct preference optimization against the adapter-free network, or (``stored``, a
    full fine-tune) against the initial model's stored log-probabilities."""

    beta: float
    loss_type: str
    stored: bool = False
    label_smoothing: float = 0.0
    # A pair's rejected response branches off its prompt (model.attention sdpa: the trainer's
    # packed attention, which alone reads shared prefixes).
    shared: bool = False
    unit: str = "preference pairs"
    declared: ClassVar[objectives.Objective] = objectives.DPO

    @classmethod
    def of(cls, spec: FineTuneJobSpec) -> Dpo:
        """A full fine-tune's reference is stored log-probabilities (trainer/objectives/
        reference.py attaches them to the data before training)."""
        settings = spec.training.dpo_settings()
        return cls(
            beta=settings.beta,
            loss_type=settings.loss_type,
            stored=spec.method.type == "full",
            label_smoothing=settings.label_smoothing or 0.0,
            shared=spec.model.attention == "sdpa",
        )

    def collate(self, rows: list[dict], pad_id: int) -> data.Batch:
        batch = data.collate(pairs.rows(rows, self.shared), pad_id)
        if "reference" not in rows[0]:
            return batch
        # The chosen responses then the rejected ones, as the sequences are (pairs.rows).
        chosen, rejected = zip(*(r["reference"] for r in rows), strict=True)
        return replace(batch, reference=torch.tensor(chosen + rejected, dtype=torch.float32))

    def policy_logps(self, net, batch: data.Batch, device) -> torch.Tensor:
        """[2B] response log-probabilities of the batch's pairs under ``net`` as it is."""
        on = batch.to(device)
        return sequence_logps(net, model_inputs(net, on), on)

    def count(self, batch: data.Batch) -> int:
        """What the step's loss is a mean over: pairs (half the sequences)."""
        return len(batch.spans) // 2

    def pairs(self, net, batch: data.Batch, device) -> preference.Pairs:
        on = batch.to(device)
        inputs = model_inputs(net, on)
        if self.stored:
            if on.reference is None:
                raise RuntimeError("a full fine-tune's DPO batch came without its reference")
            reference = on.reference
        else:
            # The reference first, under no_grad: nothing of it waits for the policy's backward.
            with torch.no_grad(), adapters_off(net):
                reference = sequence_logps(net, inputs, on)
        policy = sequence_logps(net, inputs, on)
        return preference.dpo(
            policy,
            reference,
            beta=self.beta,
            loss_type=self.loss_type,
            tokens=torch.tensor([n for _, n in on.spans], device=policy.device),
            label_smoothing=self.label_smoothing,
        )

    def loss(self, net, batch: data.Batch, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's summed pair losses, and its metric sums (preference.SUMS)."""
        result = self.pairs(net, batch, device)
        return result.losses.sum(), result.sums()

    def before_training(self, spec, net, ds: data.Data, d, log, folder) -> None:
        """A full fine-tune's reference: the loaded model's log-probabilities of every pair,
        stored on the volume (or reused from it) before any checkpoint is resumed."""
        if self.stored:
            reference.attach(spec, net, ds, d, self, log=log)

    def step_metrics(self, sums: list[float]) -> dict[str, float]:
        """A logged step's rewards, accuracy and margin from its reduced sums (the loss is
        reported on its own)."""
        return {k: v for k, v in preference.means(sums).items() if k != "loss"}

    @torch.no_grad()
    def evaluate(self, net, ds: data.Data, d, micro_batch: int) -> tuple[float, dict]:
        """DPO's loss, and its rewards, reward accuracy and margin, over the whole eval set
        (all ranks). Every rank runs the same number of forwards (FSDP needs all of them); a
        rank short of pairs repeats its first one and counts none of it."""
        net.eval()
        n = len(ds.eval)
        mine = list(range(d.rank, n, d.world_size))
        total = torch.zeros(len(preference.SUMS), dtype=torch.float64, device=d.device)
        for b in range(math.ceil(n / d.world_size / micro_batch)):
            indices = mine[b * micro_batch : (b + 1) * micro_batch]
            rows = ds.rows(indices or mine[:1] or [0], "eval")
            result = self.pairs(net, self.collate(rows, ds.pad_id), d.device)
            if indices:
                total += result.sums().to(torch.float64)
        dist.all_reduce(total)
        net.train()
        means = preference.means(total.tolist())
        return means.pop("loss"), means
