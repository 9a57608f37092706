"""One micro-batch cut into the N contiguous slices of a context-parallel group.

Each rank of the group (trainer/model/context.py) runs every layer but attention on its own
S/N tokens of the same micro-batch. What a slice must carry for that to train exactly as the
whole micro-batch does on one rank:

* its next-token targets, shifted over the whole sequence *before* the cut: a slice's last
  token predicts the next slice's first (shifted after the cut, it would predict nothing);
* the sequence's own positions (RoPE reads them), not positions restarting at the slice;
* the whole micro-batch's document boundaries (``cu_seqlens``, ``lengths``, ``max_seqlen``):
  attention runs over all S tokens after the all-to-all, and needs every document's extent;
* counts whose sums over the group are the micro-batch's: ``labelled`` (what the step's loss
  is a mean over) is the slice's own targets, ``tokens`` and ``attention_sq`` (the step's
  FLOPs) a share each.

S is first padded to a multiple of N: each row gets one more padding document of its own
(its positions restart at 0, no labels), so no real document sees it.

    python -m pytest tests/unit/test_context_parallel.py -q
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ftjob.trainer.data.batches import Batch, next_tokens
from ftjob.trainer.data.tokenize import IGNORE


def cut(batch: Batch, rank: int, n: int, pad_id: int) -> Batch:
    """Slice ``rank`` of ``n`` of a collated micro-batch (on the host, before any device)."""
    if not 0 <= rank < n:
        raise ValueError(f"context-parallel rank {rank} is not one of {n}")
    whole = padded(batch, n, pad_id)
    targets = next_tokens(whole.labels)  # over the whole sequence: before the cut
    width = whole.input_ids.shape[1] // n
    mine = slice(rank * width, (rank + 1) * width)
    own = targets[:, mine].contiguous()
    return replace(
        whole,
        input_ids=whole.input_ids[:, mine].contiguous(),
        labels=whole.labels[:, mine].contiguous(),
        position_ids=whole.position_ids[:, mine].contiguous(),
        targets=own,
        labelled=int((own != IGNORE).sum()),
        tokens=share(batch.tokens, rank, n),
        attention_sq=share(batch.attention_sq, rank, n),
    )


def padded(batch: Batch, n: int, pad_id: int) -> Batch:
    """``batch`` with each row right-padded to a multiple of ``n`` tokens, the padding a
    document of its own (as collate pads rows): itself if it is one already."""
    rows, width = batch.input_ids.shape
    pad = -width % n
    if not pad:
        return batch
    lengths = []
    for row in row_documents(_lengths(batch), width):
        lengths += [*row, pad]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return replace(
        batch,
        input_ids=_extend(batch.input_ids, torch.full((rows, pad), pad_id)),
        labels=_extend(batch.labels, torch.full((rows, pad), IGNORE)),
        position_ids=_extend(batch.position_ids, torch.arange(pad).expand(rows, pad)),
        cu_seqlens=cu,
        max_seqlen=max(batch.max_seqlen, pad),
        lengths=tuple(lengths),
    )


def row_documents(lengths: tuple[int, ...], width: int) -> list[list[int]]:
    """The flattened micro-batch's document lengths, row by row (no document crosses rows)."""
    rows: list[list[int]] = [[]]
    filled = 0
    for length in lengths:
        rows[-1].append(length)
        filled += length
        if filled > width:
            raise ValueError(f"a document crosses the end of a row of {width} tokens")
        if filled == width:
            rows.append([])
            filled = 0
    if filled or rows[-1]:
        raise ValueError(f"the documents' lengths do not fill rows of {width} tokens")
    return rows[:-1]


def share(total: int, rank: int, n: int) -> int:
    """Rank ``rank``'s part of a count split over ``n`` ranks; the parts add up to it."""
    return total // n + (rank < total % n)


def _lengths(batch: Batch) -> tuple[int, ...]:
    if batch.lengths:
        return batch.lengths
    bounds = batch.cu_seqlens.tolist()  # a host tensor: cut runs before the copy to the device
    return tuple(end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True))


def _extend(t: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, tail.to(t.dtype)], dim=1)
