"""What the objectives that train on the data set's own rows share (SFT, DPO): a sampler over
those rows, and micro-batches taken as collated. GRPO differs in both (its rows are prompts,
and its micro-batches are rollouts sampled from the policy)."""

from __future__ import annotations

from ftjob.api.spec import FineTuneJobSpec
from ftjob.trainer.data import batches as data


class Offline:
    """The sampler and the rollout of an objective whose data is what it trains on."""

    def sampler(self, n: int, spec: FineTuneJobSpec, world: int) -> data.Sampler:
        t = spec.training
        return data.Sampler(n, t.seed, world, t.micro_batch_size, t.gradient_accumulation)

    def rollout(self, net, micro: list[data.Batch], step: int, d) -> list[data.Batch]:
        return micro
