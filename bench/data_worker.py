"""One measurement of bench.data in a fresh process (so its peak RSS is its own).

    python bench/data_worker.py MODE FILE ROOT

MODE: prepare (rank 0's first prepare), restart (prepare again with the data present, then
memory-map it), rank (a waiting rank: memory-map and collate a few hundred batches),
baseline (datasets.load_dataset("json") + batched .map(num_proc) tokenization into ROOT).
Prints ``data {json}``: seconds, peak RSS of this process and of its worker processes (MiB),
and the RSS before the data was touched.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENIZER = ROOT / "examples" / "tiny-model"


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib(who: int) -> float:
    return round(resource.getrusage(who).ru_maxrss / 1024, 1)


def spec_for(source: Path):
    from ftjob.spec import parse_spec

    return parse_spec(
        {
            "model": {"source": str(TOKENIZER)},
            "dataset": {"source": str(source), "maxSeqLength": 2048},
            "training": {"maxSteps": 1, "microBatchSize": 4},
        }
    )


def main(mode: str, source: Path, root: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    before = rss_mib()
    started = time.monotonic()
    out: dict = {"mode": mode}
    if mode == "baseline":
        import datasets

        datasets.disable_progress_bars()
        table = datasets.load_dataset("json", data_files=str(source), split="train",
                                      cache_dir=str(root))  # fmt: skip
        procs = len(os.sched_getaffinity(0))
        table = table.map(lambda b: tok(b["text"]), batched=True, batch_size=1000,
                          num_proc=procs, remove_columns=["text"])  # fmt: skip
        out["sequences"] = len(table)
    else:
        from ftjob.trainer import data

        spec = spec_for(source)
        quiet = lambda _: None  # noqa: E731
        ds = data.load(spec, tok, root, is_main=mode != "rank", log=quiet)
        out["sequences"] = len(ds.train)
        if mode == "rank":
            # What a training rank does with the data: random micro-batches of 4 sequences.
            sampler = data.Sampler(len(ds.train), 42, world=2, micro_batch=4, accumulation=1)
            for step in range(200):
                data.collate(ds.rows(sampler.indices(step, 0, 1)), ds.pad_id)
    out.update(
        seconds=round(time.monotonic() - started, 2),
        rssBeforeMiB=round(before, 1),
        rssAfterMiB=round(rss_mib(), 1),
        peakMiB=peak_mib(resource.RUSAGE_SELF),
        workersPeakMiB=peak_mib(resource.RUSAGE_CHILDREN),
    )
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    print("data " + json.dumps(result), flush=True)
