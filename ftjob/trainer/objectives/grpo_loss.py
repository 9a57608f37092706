"""GRPO's arithmetic, as TRL 1.16's GRPOTrainer does it: group advantages from rewards, and the
clipped per-token loss with its three aggregations. Pure tensor functions; the exactness
test (tests/unit/test_grpo_exact.py) compares them, through the objective, with TRL's own.

The aggregations are written as a sum and a count, so that the step's loss is the sum over
every micro-batch of every rank divided by the count over all of them (trainer/step.py):
grpo counts completions (the mean of each completion's token mean), dapo completion tokens
(the token mean over the generation batch), dr_grpo completions x maxCompletionLength. With
TRL's equal micro-batches this is the loss TRL's accumulation and data-parallel averaging
give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation with Bessel's correction, NaNs left out (TRL's ``nanstd``)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, torch.nan))
    out = torch.sqrt(variance * correction)
    return out.squeeze(dim) if dim is not None else out.reshape(())


def advantages(
    per_func: torch.Tensor, weights: torch.Tensor, generations: int, scale: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], rewards [N]) of a generation batch's completions, groups of
    ``generations`` in a row: the weighted sum of the rewards (NaN where a reward does not
    apply; NaN for a completion no reward applies to, whose advantage is 0), minus its group's
    mean, divided by the group's (or the batch's, or no) standard deviation plus 1e-4."""
    rewards = (per_func * weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    grouped = rewards.view(-1, generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(generations)
    out = rewards - mean
    if scale != "none":
        out = out / (std + 1e-4)
    return torch.nan_to_num(out, nan=0.0), rewards


def zero_spread(rewards: torch.Tensor, generations: int, scale: str) -> float:
    """The share of a generation batch's completions whose rewards' spread is 0, the one
    advantages divide by (the group's, or the batch's under ``batch``): they teach nothing
    (TRL's frac_reward_zero_std)."""
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, generations), dim=1).repeat_interleave(generations)
    return float(torch.isclose(std, torch.zeros_like(std)).float().mean())


def lengths(tokens: torch.Tensor, cut: torch.Tensor) -> dict[str, float]:
    """A generation batch's completion lengths as TRL logs them: the shortest and longest of
    all, and the mean, shortest and longest of those that ended with a stop token (not
    ``cut`` at the length limit; 0 where none did, as TRL's)."""
    ended = tokens[~cut].float()
    if ended.numel() == 0:
        ended = torch.zeros(1)
    return {
        "completionMinLength": float(tokens.min()),
        "completionMaxLength": float(tokens.max()),
        "terminatedLength": float(ended.mean()),
        "terminatedMinLength": float(ended.min()),
        "terminatedMaxLength": float(ended.max()),
    }


@dataclass(frozen=True)
class Clip:
    """The settings of the per-token loss."""

    loss_type: str  # grpo | dapo | dr_grpo
    epsilon_low: float
    epsilon_high: float
    beta: float
    max_completion_length: int
    sequence: bool = False  # one importance ratio per completion (GSPO), not per token


@dataclass(frozen=True)
class Terms:
    """A micro-batch's summed loss, what the step's loss is a mean over (a host number: see
    :func:`count`), and its per-token metric sums."""

    loss: torch.Tensor
    clipped: torch.Tensor  # tokens whose ratio was clipped (TRL's region clip)
    kl: torch.Tensor  # summed per-token KL (0 when beta is 0)
    low: torch.Tensor  # of them, tokens clipped at 1 - epsilon (advantage negative)
    high: torch.Tensor  # and at 1 + epsilonHigh (advantage positive)


def token_terms(
    logps: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip: Clip,
) -> Terms:
    """``logps``, ``old``, ``ref``, ``mask``: [B, C] per completion token; ``adv``: [B].
    ``old`` None: the completions were sampled from these very weights (numIterations 1), and
    the ratio is 1 with the gradient of ``logps`` (TRL's ``per_token_logps.detach()``)."""
    adv = adv.unsqueeze(1)
    old = logps.detach() if old is None else old
    log_ratio = logps - old
    if clip.sequence:  # [B, 1]: the mean of a completion's token log-ratios (TRL's, GSPO's)
        weights = mask.to(log_ratio.dtype)
        log_ratio = ((log_ratio * weights).sum(-1) / weights.sum(-1).clamp(min=1.0)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip.epsilon_low, 1 + clip.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros((), device=logps.device)
    if clip.beta != 0.0:
        diff = ref - logps
        # Times the ratio, as TRL's default use_bias_correction_kl: its value is 1 on-policy,
        # its gradient is not (the unbiased reverse-KL gradient, DeepSeek-V3.2).
        per_token_kl = (torch.exp(diff) - diff - 1) * ratio
        per_token = per_token + clip.beta * per_token_kl
        kl = (per_token_kl.detach() * mask).sum()
    mask = mask.to(per_token.dtype)
    if clip.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    else:  # dapo, dr_grpo: a token sum; their counts differ
        loss = (per_token * mask).sum()
    low = (ratio < 1 - clip.epsilon_low) & (adv < 0)
    high = (ratio > 1 + clip.epsilon_high) & (adv > 0)

    def counted(flags: torch.Tensor) -> torch.Tensor:
        # Per completion at the sequence level (TRL counts [B, 1] flags a row each).
        return (flags.to(mask.dtype) if clip.sequence else flags * mask).sum().detach()

    return Terms(loss, counted(low | high), kl, counted(low), counted(high))


def count(loss_type: str, lengths: list[int], max_completion_length: int) -> int:
    """What a micro-batch adds to the step's loss denominator (host ints only)."""
    if loss_type == "grpo":
        return len(lengths)
    if loss_type == "dapo":
        return sum(lengths)
    return len(lengths) * max_completion_length  # dr_grpo
