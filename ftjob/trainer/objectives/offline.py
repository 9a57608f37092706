"""What the objectives that train on the data set's own rows share (SFT, DPO): a sampler over
those rows, micro-batches taken as collated, and nothing held between steps. GRPO differs in
all three (its rows are prompts, its micro-batches rollouts sampled from the policy, which it
holds for numIterations steps)."""

from __future__ import annotations

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.trainer.data import batches as data


class Offline:
    """The sampler, rollout and held state of an objective whose data is what it trains on."""

    def sampler(self, n: int, spec: FineTuneJobSpec, world: int) -> data.Sampler:
        t = spec.training
        return data.Sampler(n, t.seed, world, t.micro_batch_size, spec.accumulation)

    def rollout(self, net, micro: list[data.Batch], step: int, d) -> list[data.Batch]:
        return micro

    def held(self) -> None:
        return None

    def restore(self, held: None) -> None:
        pass
