"""Prepared sequences -> batches whose order is a pure function of (seed, step).

Rank 0 prepares the data once (trainer/data/prepare.py) and every rank memory-maps the result, so
a restarted gang sees exactly the batches the first one would have: the data position saved
in a checkpoint is just the step.

    python -c "from ftjob.trainer.data import batches; help(batches)"

Bad data stops the job before any training, naming the file and the record.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.job.folder import JobFolder
from ftjob.trainer.data.records import DataError
from ftjob.trainer.data.tokenize import IGNORE

if TYPE_CHECKING:  # imported by the phase that uses it: see ftjob/trainer/report/startup.py
    import pyarrow as pa
    from transformers import PreTrainedTokenizerBase

    from ftjob.trainer.data import prepare  # load()'s: pyarrow (and datasets) come with it

__all__ = [
    "IGNORE",
    "Batch",
    "Data",
    "DataError",
    "Sampler",
    "Sequences",
    "collate",
    "eval_batches",
    "load",
    "next_tokens",
]


class Sequences:
    """One split's prepared sequences (input_ids, labels, seq_lengths), memory-mapped.

    Rank 0 wrote them as Arrow stream files (``datasets.Dataset.from_file`` reads them too).
    A rank reads a few rows per step, at random, and copies them into Python lists, so after
    each read it hands the mapped pages back (MADV_DONTNEED; they stay in the node's page
    cache for the next read). Otherwise every row read leaves its pages, and the kernel's
    neighbours of them (fault-around, readahead), in the rank's RSS: a few hundred random
    rows made nearly the whole prepared set resident in each rank, and the madvise costs a
    small part of a read and collate (the data suite's figures: bench/RESULTS.md).
    """

    def __init__(self, table: pa.Table, maps: tuple[mmap.mmap, ...] = ()):
        self.table, self.maps = table, maps

    @classmethod
    def open(cls, folder: Path) -> Sequences:
        import pyarrow as pa

        maps, tables = [], []
        for path in sorted(folder.glob("*.arrow")):
            with path.open("rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            maps[-1].madvise(mmap.MADV_RANDOM)  # no readahead around a row: rows are random
            tables.append(pa.ipc.open_stream(pa.py_buffer(maps[-1])).read_all())  # zero-copy
        return cls(pa.concat_tables(tables), tuple(maps))

    def __len__(self) -> int:
        return self.table.num_rows

    def rows(self, indices) -> list[dict]:
        # Row slices are views of the map; a take() would copy them through Arrow's allocator.
        rows = [self.table.slice(i, 1).to_pylist()[0] for i in indices]
        for memory in self.maps:
            memory.madvise(mmap.MADV_DONTNEED)  # a read-only file map: re-read on next touch
        return rows

    def column(self, name: str) -> list:
        return self.table.column(name).to_pylist()

    def head(self, n: int) -> Sequences:
        return Sequences(self.table.slice(0, n), self.maps)


@dataclass
class Data:
    train: Sequences
    eval: Sequences | None
    pad_id: int
    folder: Path | None = None  # the prepared data's folder on the volume
    # A full fine-tune's DPO reference: each split's [pairs, 2] (chosen, rejected) response
    # log-probabilities under the initial model, memory-mapped (trainer/objectives/reference.py).
    reference: dict[str, np.ndarray] | None = None

    def rows(self, indices: list[int], split: str = "train") -> list[dict]:
        rows = (self.train if split == "train" else self.eval).rows(indices)
        if self.reference is not None:
            stored = self.reference[split]
            for row, i in zip(rows, indices, strict=True):
                row["reference"] = [float(v) for v in stored[i]]
        return rows


def load(
    spec: FineTuneJobSpec,
    tok: PreTrainedTokenizerBase,
    job_dir: Path,
    *,
    is_main: bool = True,
    log: Callable[[str], None] = print,
    on_progress: prepare.Progress | None = None,
) -> Data:
    """The job's prepared train (and eval) sequences, memory-mapped; prepared if missing."""
    from ftjob.trainer.data import prepare

    folder = prepare.prepare(
        spec, tok, JobFolder(job_dir).data, is_main=is_main, log=log, on_progress=on_progress
    )
    train = Sequences.open(folder / "train")
    evaluation = None
    if (folder / "eval").exists():
        evaluation = Sequences.open(folder / "eval")
        cap = spec.dataset.max_eval_sequences
        unit = "preference pairs" if spec.dataset.format == "preference" else "sequences"
        if len(evaluation) > cap:
            log(f"data: evaluating {cap:,} of {len(evaluation):,} eval {unit} "
                "(dataset.maxEvalSequences)")  # fmt: skip
            evaluation = evaluation.head(cap)
        else:
            log(f"data: evaluating all {len(evaluation):,} eval {unit}")
    return Data(train, evaluation, tok.pad_token_id, folder)


# ------------------------------------------------------------------------------ batches


@dataclass(frozen=True)
class Batch:
    """One micro-batch: right-padded rows whose packed documents never see each other (or,
    collated ``flat``, as SFT trains, one row of the rows' real tokens back to back).

    ``position_ids`` restart at 0 for every packed document and for each row's padding (a
    document of its own, with no labels). ``cu_seqlens`` are the same boundaries over the
    micro-batch flattened to one row of B x S tokens, as varlen attention kernels take them
    (trainer/model/attention.py); ``max_seqlen`` is the longest of those documents. The counts are
    host ints, computed from the rows' lengths, so reading them never waits for a device.

    A document may be a *branch* of a shared prefix (``stems``): it attends to the first
    ``stem`` tokens of the nearest plain document before it in its row, then causally to
    itself, its positions continuing from ``stem``. A DPO pair's rejected response, and GRPO's
    second and later completions of a prompt, are such branches: their prompt runs once
    (trainer/data/pairs.py, trainer/objectives/grpo.py).
    """

    input_ids: torch.Tensor  # [B, S] long
    labels: torch.Tensor  # [B, S] long, IGNORE where no loss
    position_ids: torch.Tensor  # [B, S] long
    cu_seqlens: torch.Tensor  # [documents + 1] int32; cu_seqlens[-1] == B * S
    max_seqlen: int
    tokens: int  # real tokens run (no padding; a shared prefix once)
    labelled: int  # next-token targets: (labels[:, 1:] != IGNORE).sum()
    attention_sq: int  # sum of the real documents' length^2 (attention FLOPs)
    # DPO with stored reference log-probabilities (full fine-tune): [rows] fp32, row by row.
    reference: torch.Tensor | None = None
    # The documents' lengths over the flattened batch (cu_seqlens' steps), as host ints:
    # attention that splits by document reads them here, not from the device.
    lengths: tuple[int, ...] = ()
    # A context-parallel slice's next-token targets [B, S/N], shifted over the whole sequence
    # before it was cut (trainer/data/context_slice.py): a slice's last token predicts the
    # next slice's first. None: :func:`next_tokens` of ``labels``.
    targets: torch.Tensor | None = None
    # Each document's shared-prefix length (``lengths``' order; 0: a plain document). Empty:
    # every document is plain.
    stems: tuple[int, ...] = ()
    # Prefix tokens the branches read instead of running them again: tokens + shared are the
    # tokens of the sequences as written (what tokens/s counts, on every layout alike).
    shared: int = 0
    # The objective's sequences (a DPO pair's two, a GRPO completion), in the objective's order:
    # each one's first response token is predicted at flattened position ``start``, the next
    # at start + 1, and so on for ``length`` tokens (trainer/objectives/loss.py span_view).
    spans: tuple[tuple[int, int], ...] = ()

    _TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens", "reference", "targets")

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self._TENSORS if getattr(self, k) is not None}

    def pin(self) -> Batch:
        """This batch in page-locked memory, so that ``to(cuda, non_blocking=True)`` copies
        without the host waiting; itself where there is no CUDA (pinning needs a driver)."""
        if not torch.cuda.is_available():
            return self
        return replace(self, **{k: v.pin_memory() for k, v in self._tensors().items()})

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        """This batch's tensors on ``device``; the host ints stay where they are."""
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self._tensors().items()}
        return replace(self, **moved)


def collate(rows: list[dict], pad_id: int, flat: bool = False) -> Batch:
    """Rows of prepared sequences (input_ids, labels, seq_lengths; optionally stems and
    spans, see :class:`Batch`) -> a right-padded Batch.

    ``flat``: the rows back to back as one row of their real tokens, no padding (TRL's
    padding-free layout): every layer, attention aside, costs per token, and the padding
    was a document of its own that every layer ran. Next-token loss is the same: each row
    starts a document, whose first label is IGNORE (tokenize.py), and a row's first label is
    forced to IGNORE here too, so a row's last token still predicts nothing.

    Built in numpy from the rows' Python lists (np.full plus slice assignment is ~6x faster
    than ``torch.as_tensor`` of each list): this runs once per micro-batch on every rank.
    A row's ``spans`` are (sequence index, start within the row, length); the batch's are
    flattened and in index order.
    """
    sizes = [len(r["input_ids"]) for r in rows]
    shape = (1, sum(sizes)) if flat else (len(rows), max(sizes))
    # Where each row begins in the flattened batch.
    starts = np.cumsum([0, *sizes[:-1]]) if flat else np.arange(len(rows)) * shape[1]
    ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE, dtype=np.int64)
    flat_ids, flat_labels = ids.reshape(-1), labels.reshape(-1)  # views
    spans: dict[int, tuple[int, int]] = {}
    for r, n, at in zip(rows, sizes, starts.tolist(), strict=True):
        flat_ids[at : at + n] = r["input_ids"]
        flat_labels[at : at + n] = r["labels"]
        if flat and at and n:
            flat_labels[at] = IGNORE  # predicted by the previous row's last token: never
        for index, start, length in r.get("spans", ()):
            spans[index] = (at + start, length)
    docs = _documents(rows, None if flat else shape[1])
    cu = np.zeros(len(docs.lengths) + 1, dtype=np.int64)
    np.cumsum(docs.lengths, out=cu[1:])
    # Each token's position in its document: its index minus its document's start, plus
    # the shared prefix a branch continues from.
    positions = np.arange(ids.size) - np.repeat(cu[:-1] - docs.stems, docs.lengths)
    return Batch(
        input_ids=torch.from_numpy(ids),
        labels=torch.from_numpy(labels),
        position_ids=torch.from_numpy(positions.reshape(shape)),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        max_seqlen=max(docs.lengths),
        tokens=docs.tokens,
        labelled=int((labels[:, 1:] != IGNORE).sum()),  # a row's first label predicts nothing
        attention_sq=docs.attention_sq,
        lengths=tuple(docs.lengths),
        stems=tuple(docs.stems) if any(docs.stems) else (),
        shared=int(sum(docs.stems)),
        spans=tuple(spans[i] for i in sorted(spans)),
    )


@dataclass(frozen=True)
class _Documents:
    lengths: list[int]  # every document of the flattened batch, padding runs included
    stems: np.ndarray  # each one's shared prefix (0: plain)
    tokens: int  # real tokens run
    attention_sq: int  # in length^2 units: a branch's queries also see its stem


def _documents(rows: list[dict], width: int | None) -> _Documents:
    """The flattened batch's documents; ``width``: each row's padded length (None: flat)."""
    lengths: list[int] = []
    stems: list[int] = []
    tokens = attention_sq = 0
    for r in rows:
        n = len(r["input_ids"])
        if sum(r["seq_lengths"]) != n:
            raise DataError(
                f"a sequence's seq_lengths {r['seq_lengths']} do not add up to its {n} "
                "tokens: the prepared data is inconsistent; delete the job's data/ folder to "
                "prepare it again"
            )
        for k, stem in zip(r["seq_lengths"], r.get("stems") or [0] * len(r["seq_lengths"]),
                           strict=True):  # fmt: skip
            if k:
                lengths.append(k)
                stems.append(stem)
                attention_sq += k * k + 2 * k * stem
        if width is not None and width > n:  # the row's padding, a document of its own
            lengths.append(width - n)
            stems.append(0)
        tokens += n
    return _Documents(lengths, np.asarray(stems, dtype=np.int64), tokens, attention_sq)


def next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target: the next token's label; a row's last position predicts nothing."""
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    return targets


class Sampler:
    """Which sequences a rank trains on at (step, micro-batch): a pure function of them.

    Sequence number k of the whole run is element k % n of permutation k // n (one per epoch,
    seeded by seed and epoch); a micro-batch takes the next world x microBatchSize numbers.
    """

    def __init__(self, n: int, seed: int, world: int, micro_batch: int, accumulation: int):
        self.n, self.seed = n, seed
        self.world, self.micro_batch, self.accumulation = world, micro_batch, accumulation
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    @property
    def per_step(self) -> int:
        return self.world * self.micro_batch * self.accumulation

    def steps_for(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * self.n / self.per_step))

    def epoch(self, step: int) -> float:
        return step * self.per_step / self.n

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = ((step * self.accumulation + micro) * self.world + rank) * self.micro_batch
        return [self._at(k) for k in range(start, start + self.micro_batch)]

    def _at(self, k: int) -> int:
        epoch, i = divmod(k, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return int(self._perm[i])


def eval_batches(data: Data, rank: int, world: int, micro_batch: int) -> list[Batch]:
    """This rank's share of the eval set; every rank gets the same number of batches.

    FSDP needs every rank in every forward, so short ranks get a batch with no labels.
    """
    n = len(data.eval)
    mine = list(range(rank, n, world))
    count = math.ceil(n / world / micro_batch)
    batches = []
    for b in range(count):
        chunk = data.rows(mine[b * micro_batch : (b + 1) * micro_batch], "eval")
        if not chunk:
            blank = data.rows([0], "eval")[0]
            chunk = [{**blank, "labels": [IGNORE] * len(blank["labels"])}]
        batches.append(collate(chunk, data.pad_id))
    return batches
