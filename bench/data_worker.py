"""One measurement of bench.data in a fresh process (so its peak RSS is its own).

    python bench/data_worker.py MODE FILE ROOT

MODE: prepare (rank 0's first prepare), restart (prepare again with the data present, then
memory-map it), rank (a waiting rank: memory-map and collate a few hundred batches),
baseline (datasets.load_dataset("json") + batched .map(num_proc) tokenization into ROOT).
Prints ``data {json}``: seconds, peak RSS of this process and of its largest worker process,
peak PSS (and its private part) of the whole process tree at once (sampled every 0.2 s), all
in MiB, and the RSS before the data was touched. The modes that play a trainer rank first
import the trainer (as a rank has when it reaches the data), so the time and memory are the
data's own.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENIZER = ROOT / "examples" / "tiny-model"

from bench import common  # noqa: E402 - after the path is set

MINE = ("VmRSS", "VmHWM", "RssAnon", "RssFile")  # of this process: VmHWM is its own peak
# (ru_maxrss would carry over the parent's peak across fork and exec); RssAnon is private,
# RssFile mapped file pages, shared with other ranks through the page cache and reclaimable.


def tree_pss_mib(pid: int) -> tuple[float, float]:
    """(PSS, private PSS) of a process and all its descendants now (MiB). PSS splits a page
    shared by n processes (forked workers share the parent's pages) n ways, so the sum is
    what the tree takes; the part that is not private is mapped file pages (page cache,
    reclaimable)."""
    total = private = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            pss = common.proc_mib(p, ("Pss", "Pss_Anon"), "smaps_rollup")
            total, private = total + pss["Pss"], private + pss["Pss_Anon"]
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, KeyError):
            continue  # a worker that just ended
    return total, private


class TreePeak(threading.Thread):
    """The largest PSS (and private PSS) of this process tree taken together: workers run
    side by side."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = self.private = 0.0
        self.running = True

    def sample(self) -> None:
        total, private = tree_pss_mib(os.getpid())
        self.peak, self.private = max(self.peak, total), max(self.private, private)

    def run(self) -> None:
        while self.running:
            self.sample()
            time.sleep(0.2)


def workers_peak_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)


def spec_for(source: Path):
    from ftjob.api.jobspec import parse_spec

    return parse_spec(
        {
            "model": {"source": str(TOKENIZER)},
            "dataset": {"source": str(source), "maxSeqLength": 2048},
            "training": {"maxSteps": 1, "microBatchSize": 4},
        }
    )


def main(mode: str, source: Path, root: Path) -> dict:
    from transformers import AutoTokenizer

    if mode != "baseline":
        import ftjob.trainer.train  # noqa: F401 - what a rank has imported when it loads data

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    before = common.proc_mib("self", MINE)
    tree = TreePeak()
    tree.start()
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
        from ftjob.trainer.data import batches as data

        spec = spec_for(source)
        quiet = lambda _: None  # noqa: E731
        ds = data.load(spec, tok, root, is_main=mode != "rank", log=quiet)
        out["sequences"] = len(ds.train)
        if mode == "rank":
            # What a training rank does with the data: random micro-batches of 4 sequences.
            sampler = data.Sampler(len(ds.train), 42, world=2, micro_batch=4, accumulation=1)
            read = time.monotonic()
            for step in range(200):
                data.collate(ds.rows(sampler.indices(step, 0, 1)), ds.pad_id)
            out["batchMs"] = round((time.monotonic() - read) / 200 * 1e3, 2)
    out["seconds"] = round(time.monotonic() - started, 2)
    after = common.proc_mib("self", MINE)
    out.update(
        rssBeforeMiB=round(before["VmRSS"], 1),
        rssAfterMiB=round(after["VmRSS"], 1),
        anonGrowthMiB=round(after["RssAnon"] - before["RssAnon"], 1),
        fileGrowthMiB=round(after["RssFile"] - before["RssFile"], 1),
        peakMiB=round(after["VmHWM"], 1),
        workersPeakMiB=workers_peak_mib(),
    )
    tree.running = False
    tree.sample()
    out.update(treePssPeakMiB=round(tree.peak, 1), treePrivatePeakMiB=round(tree.private, 1))
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    print("data " + json.dumps(result), flush=True)
