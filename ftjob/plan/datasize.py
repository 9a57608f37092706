"""What the prepared data costs: bytes on the volume and memory per rank (for ``ftjob plan``).

Pure arithmetic on the spec and, where the source is a local file, its size; nothing is read.
The constants come from ``python -m bench --suite data`` (bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import quantity
from ftjob.api.source import Local, parse

TEXT_BYTES_PER_TOKEN = 4.0  # JSONL bytes per token for English with a 32k-150k BPE vocabulary
STORED_BYTES_PER_TOKEN = 8  # input_ids + labels, int32 each (Arrow; offsets are negligible)
# Measured by bench --suite data and bench.data.mapped_rank (bench/RESULTS.md): a waiting rank's
# private memory grew 50 MiB mapping the data and collating 200 batches, flat from a 7k- to a
# 70k-sequence set, plus 136 MiB importing datasets/pyarrow. The mapped pages it touches are
# page cache (shared by the node's ranks, reclaimable), not counted here. Rank 0's prepare
# peaked at 648 MiB in the main process and 843 MiB in a tokenizing worker (20k records).
RANK_DATA_BYTES = 190 * 2**20
PREPARE_BYTES_PER_PROCESS = 850 * 2**20


@dataclass
class DataEstimate:
    source_bytes: int | None  # None: an hf:// source or a file not found here
    tokens: float | None
    prepared_bytes: float | None  # kept on the volume under <job>/data/<key>/
    preparing_bytes: float | None  # the volume's peak while preparing (temporary copies)
    rank_bytes: float  # CPU memory per rank for the data while training
    prepare_memory: float  # CPU memory of rank 0's prepare (all its processes)


def estimate(spec: FineTuneJobSpec, source_root: Path | None = None) -> DataEstimate:
    found, size = parse(spec.dataset.source), None
    if isinstance(found, Local):
        path = found.at(source_root or ".")
        if path.is_file():
            size = path.stat().st_size
        elif path.is_dir():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    tokens = size / TEXT_BYTES_PER_TOKEN if size is not None else None
    prepared = tokens * STORED_BYTES_PER_TOKEN if tokens is not None else None
    # While preparing, the volume also holds the records as Arrow (about the source's size)
    # and the tokens before packing (about the prepared size); both go when it commits.
    preparing = size + 2 * prepared if size is not None and prepared is not None else None
    # prepare.py tokenizes with one process per pod CPU (at most 32) beside the main one.
    cpus = int(quantity(spec.resources.cpu)) if spec.resources.cpu else 2
    processes = 1 + max(1, min(cpus, 32))
    return DataEstimate(size, tokens, prepared, preparing, RANK_DATA_BYTES,
                        processes * PREPARE_BYTES_PER_PROCESS)  # fmt: skip


def describe(spec: FineTuneJobSpec, source_root: Path | None = None) -> str:
    """The data row of ``ftjob plan`` (without its label)."""
    e = estimate(spec, source_root)
    memory = (f"memory-mapped, ~{_size(e.rank_bytes)} per rank; rank 0 prepares with "
              f"~{_size(e.prepare_memory)} once")  # fmt: skip
    if e.prepared_bytes is None and not parse(spec.dataset.source).remote:
        # A cluster job's data lives on the checkpoint volume: not an error, only unsized here.
        return (
            f"data not checked here ({spec.dataset.source} is not on this machine; a cluster "
            f"reads it from the checkpoint volume): size unknown until prepared; {memory}"
        )
    if e.prepared_bytes is None:
        return f"size unknown until prepared ({spec.dataset.source}); {memory}"
    return (
        f"{_size(e.source_bytes)} source ~ {e.tokens:,.0f} tokens "
        f"(~{TEXT_BYTES_PER_TOKEN:.0f} bytes/token): ~{_size(e.prepared_bytes)} prepared on "
        f"the volume (peak ~{_size(e.preparing_bytes)} while preparing); {memory}"
    )


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
