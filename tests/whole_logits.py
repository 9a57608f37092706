"""DPO's log-probabilities computed the plain way, from a model's whole logits, one row a
sequence: what the tests hold the trainer's chunked, span-gathered path
(trainer/objectives/loss.py) and TRL's DPO trainer against."""

from __future__ import annotations

import torch

from ftjob.trainer.data.tokenize import IGNORE


def response_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens, each predicted from the
    position before it: [N, S, V] logits and [N, S] labels -> [N] (fp32)."""
    targets = labels[:, 1:]
    learn = targets != IGNORE
    scores = logits[:, :-1].float()
    picked = scores.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = picked - torch.logsumexp(scores, dim=-1)
    return (logp * learn).sum(dim=1)


def response_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each row's number of response tokens: [N, S] labels -> [N]."""
    return (labels != IGNORE).sum(dim=1)
