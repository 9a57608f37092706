"""Suite c: peak RSS per rank while loading, rank-0 loading (ftjob's default: rank 0 reads the
weights and broadcasts them into the shards) vs every rank reading the whole checkpoint
(FTJOB_LOAD_ON_ALL_RANKS=1, what a plain from_pretrained on every rank does).

Growth is measured against the tiny model's run, whose weights are ~1 MiB: what remains is the
process baseline (Python, torch, transformers), the same for every size."""

from __future__ import annotations

from pathlib import Path

from bench import common
from bench.report import row

ALL_RANKS = {"FTJOB_LOAD_ON_ALL_RANKS": "1"}
EVERY = "every rank loads"


def small_job(size: str, work: Path, method: str = "full") -> dict:
    """Two steps of seq 64 x micro-batch 1: loading dominates; shared with bench.planner."""
    model = common.model_dir(size, work)
    return common.job(f"load-{size}-{method}", model, steps=2, seq=64, micro_batch=1,
                      method=method)  # fmt: skip


def measure(size: str, work: Path, base: list[float]) -> dict:
    ours = common.ftjob_run(small_job(size, work), work).progress["loadPeakRssMiB"]
    every = common.ftjob_run(small_job(size, work), work, env=ALL_RANKS)
    theirs = every.progress["loadPeakRssMiB"]
    return {
        "model": size,
        "params": common.param_count(common.model_dir(size, work)),
        "rank0Loading": ours,
        "everyRank": theirs,
        "tinyBaseline": base,
        "rank1Growth": ours[1] - base[1],
        "rank1GrowthEveryRank": theirs[1] - base[1],
    }


def rows_for(c: dict) -> list[dict]:
    label = f"{c['model']} ({c['params'] / 1e6:.0f}M, {c['params'] * 4 / 2**20:.0f} MiB fp32)"
    ours, theirs = c["rank0Loading"], c["everyRank"]
    return [
        row(f"rank-1 load peak RSS MiB, {label}", ours[1], theirs[1], EVERY, ours[1] / theirs[1]),
        row(
            f"rank-1 load RSS growth over tiny MiB, {label}",
            c["rank1Growth"],
            c["rank1GrowthEveryRank"],
            EVERY,
            goal="<= 1024 MiB",
            met=c["rank1Growth"] <= 1024,
        ),  # fmt: skip
        row(f"rank-0 load peak RSS MiB, {label}", ours[0], theirs[0], EVERY, ours[0] / theirs[0]),
    ]


def run(work: Path, quick: bool) -> dict:
    sizes = ["medium"] if quick else ["medium", "large"]
    base = common.ftjob_run(small_job("tiny", work), work).progress["loadPeakRssMiB"]
    cases = [measure(size, work, base) for size in sizes]
    rows = [r for c in cases for r in rows_for(c)]
    if len(cases) > 1:
        small, big = cases[0], cases[-1]
        spread = big["rank1Growth"] - small["rank1Growth"]
        theirs = big["rank1GrowthEveryRank"] - small["rank1GrowthEveryRank"]
        grew = (big["params"] - small["params"]) * 4 / 2**20
        # Flat: rank 1 grows by no more than its own shard of the added weights (plus 10%).
        flat = spread <= grew / 2 * 1.1
        label = f"(fp32 weights grew {grew:.0f}; rank 1's shard {grew / 2:.0f})"
        what = f"rank-1 growth, {big['model']} minus {small['model']} MiB {label}"
        rows.append(row(what, spread, theirs, EVERY, goal="flat in size", met=flat))
    return {"cases": cases, "rows": rows}
