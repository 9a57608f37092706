"""PURE: which ranks are persistently slower than the gang (``runPolicy.stragglerMargin``).

On every log step each rank's own step time -- its mean since the last log, the wait for the
other ranks at the start of each step left out (:func:`ftjob.trainer.step.train_step`) --
reaches every rank in the log step's one all-reduce (:meth:`ftjob.trainer.step.Tally.reduce`).
A rank slower than ``(1 + margin) x`` the median on ``CONSECUTIVE`` log steps in a row is a
straggler until a log step finds it within the margin again.

Why the wait is left out: in a sharded step every rank waits for the slowest at each
collective, so wall times are equal on all ranks; the rank that is slow is the one that
makes the others wait, i.e. the one whose own time is longest. The limit: the wait is
measured on the host, at the step's first collective, which sums host numbers (gloo) on GPUs
too; a GPU's host runs ahead of its kernels, so on GPUs a rank slowed on its host (data,
Python) is named, and one slowed only inside its kernels is not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

CONSECUTIVE = 3


@dataclass
class Stragglers:
    margin: float
    nodes: list[str]  # node name of each rank
    streak: dict[int, int] = field(default_factory=dict)
    named: list[dict] = field(default_factory=list)

    def observe(self, seconds: list[float]) -> bool:
        """Take one log step's per-rank step times; True if the named set changed."""
        median = statistics.median(seconds)
        now: list[dict] = []
        for rank, own in enumerate(seconds):
            slow = median > 0 and own > (1 + self.margin) * median
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            if self.streak[rank] >= CONSECUTIVE:
                now.append({"rank": rank, "node": self.nodes[rank], "stepSeconds": round(own, 4),
                            "medianSeconds": round(median, 4)})  # fmt: skip
        changed = [s["rank"] for s in now] != [s["rank"] for s in self.named]
        self.named = now
        return changed

    def describe(self) -> str:
        if not self.named:
            return "stragglers: none (every rank within the margin of the median step time)"
        return "straggler: " + "; ".join(
            f"rank {s['rank']} (node {s['node']}) takes {s['stepSeconds']:.3f} s per step, "
            f"{s['stepSeconds'] / s['medianSeconds']:.2f}x the median {s['medianSeconds']:.3f} s"
            for s in self.named
        )
