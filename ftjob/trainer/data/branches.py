"""Rows whose sequences share a prompt: the prompt runs once, each further response a branch
(data.batches.Batch's stems) that reads the prompt's keys and values. DPO's pairs and GRPO's
groups both build them here; batches.collate lays them out."""

from __future__ import annotations

from ftjob.trainer.data.tokenize import IGNORE


def branched(prompt: list[int], responses: list[list[int]], indices: list[int]) -> dict:
    """One row for :func:`collate`: ``prompt`` with each of ``responses`` after it, sequence
    ``indices[k]`` being prompt + responses[k], labels on the responses only.

    The first response follows the prompt; each later one is a branch (:class:`Batch`)
    holding a copy of the prompt's last token, at its position and seeing what it sees, so
    that the branch's own first position predicts the response's first token and the prompt
    runs once. With one response this is the plain row prompt + response. A prompt of one
    token has nothing to share: its branches are plain documents; an empty one, nothing to
    predict a response's first token from (the span starts at its second)."""
    stem = max(len(prompt) - 1, 0)
    first = responses[0]
    row = {"input_ids": prompt + first, "labels": [IGNORE] * len(prompt) + first,
           "seq_lengths": [len(prompt) + len(first)], "stems": [0],
           "spans": [(indices[0], stem, len(first) - (not prompt))]}  # fmt: skip
    for index, response in zip(indices[1:], responses[1:], strict=True):
        row["spans"].append((index, len(row["input_ids"]), len(response)))
        row["input_ids"] += prompt[-1:] + response
        row["labels"] += [IGNORE] * len(prompt[-1:]) + response
        row["seq_lengths"].append(len(prompt[-1:]) + len(response))
        row["stems"].append(stem)
    return row
