"""The DPO objective in plain torch: response log-probabilities, the loss and its rewards.

A micro-batch of B pairs is 2B sequences, the chosen ones then the rejected
(trainer/data/pairs.py), and its labels are the response tokens. The policy and the reference
each give every sequence the sum of its response tokens' log-probabilities; a pair's implicit
rewards are beta times the policy's log-ratio to the reference, and the loss pushes the chosen
reward above the rejected one:

* sigmoid (the DPO paper): -log sigmoid(beta * ((c - c_ref) - (r - r_ref))); with label
  smoothing e (conservative DPO, for labels wrong with probability e), the mix
  -(1 - e) log sigmoid(beta * d) - e log sigmoid(-beta * d) of it and the reversed pair's;
* ipo: ((c - c_ref) / |c| - (r - r_ref) / |r| - 1 / (2 beta))^2, the log-ratios averaged
  over each response's tokens, as TRL computes it (the IPO authors' normalized form).

Reward accuracy is the share of pairs whose chosen reward is the higher, the margin their
mean difference. ``tests/unit/test_preference.py`` checks all of them against TRL's DPO
trainer on the same model and batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftjob.api.objectives import DPO

LOSS_TYPES = ("sigmoid", "ipo")
# The sums a step adds over micro-batches and ranks, in this order (see Pairs.sums): the
# loss, then each metric api/objectives.py declares for DPO (chosen and rejected rewards,
# correct pairs, margins), then the pairs; divided by the pairs, they are the metrics.
SUMS = ("loss", *(m.key for m in DPO.metrics), "pairs")


@dataclass(frozen=True)
class Pairs:
    """Per-pair results of one micro-batch: losses (with gradient) and rewards (without)."""

    losses: torch.Tensor  # [B]
    chosen_rewards: torch.Tensor  # [B]
    rejected_rewards: torch.Tensor  # [B]

    @property
    def loss(self) -> torch.Tensor:
        return self.losses.mean()

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracy(self) -> torch.Tensor:
        return (self.chosen_rewards > self.rejected_rewards).float().mean()

    def sums(self) -> torch.Tensor:
        """[SUMS] over this micro-batch's pairs, detached: added over micro-batches and ranks,
        then divided by the pair count, they give the step's means (in SUMS's order)."""
        return torch.stack(
            [
                self.losses.detach().sum(),
                self.chosen_rewards.sum(),
                self.rejected_rewards.sum(),
                (self.chosen_rewards > self.rejected_rewards).float().sum(),
                self.margins.sum(),
                torch.tensor(float(self.losses.numel()), device=self.losses.device),
            ]
        ).float()


def means(sums: torch.Tensor | list[float]) -> dict[str, float]:
    """The step's metrics from summed :meth:`Pairs.sums`: mean loss, rewards, accuracy and
    margin over all its pairs."""
    # A logged step's sums arrive as host numbers: only a tensor is read (evaluation's own).
    numbers = sums.tolist() if isinstance(sums, torch.Tensor) else sums
    values = dict(zip(SUMS, numbers, strict=True))
    n = max(values.pop("pairs"), 1.0)
    return {k: v / n for k, v in values.items()}


def dpo(
    policy: torch.Tensor,
    reference: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    tokens: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> Pairs:
    """DPO over a micro-batch: ``policy`` and ``reference`` are [2B] response log-probs
    (the chosen responses then the rejected); ``tokens`` [2B] response lengths (ipo only);
    ``label_smoothing`` (sigmoid only) the share of pairs taken as mislabelled."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss type {loss_type!r}: ftjob computes {LOSS_TYPES}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError("label smoothing applies to the sigmoid loss only")
    chosen, rejected = policy.chunk(2)
    ref_chosen, ref_rejected = reference.detach().chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if loss_type == "sigmoid":
        d = beta * (chosen_ratio - rejected_ratio)
        losses = -F.logsigmoid(d)
        if label_smoothing:
            losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-d)
    else:
        if tokens is None:
            raise ValueError("the ipo loss needs each response's token count")
        chosen_n, rejected_n = tokens.to(policy.dtype).clamp(min=1.0).chunk(2)
        losses = (chosen_ratio / chosen_n - rejected_ratio / rejected_n - 1 / (2 * beta)) ** 2
    return Pairs(
        losses=losses,
        chosen_rewards=beta * chosen_ratio.detach(),
        rejected_rewards=beta * rejected_ratio.detach(),
    )
