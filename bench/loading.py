"""Suite c: peak RSS per rank while loading, rank-0 loading (ftjob's default: rank 0 reads the
weights and broadcasts them into the shards) vs every rank reading the whole checkpoint
(bench/every_rank_trainer.py: what a plain from_pretrained on every rank does).

Growth is measured against the tiny model's run, whose weights are ~1 MiB: what remains is the
process baseline (Python, torch, transformers), the same for every size."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench import common
from bench.report import row

EVERY = "every rank loads"


def every_rank_run(doc: dict, work: Path) -> dict:
    """The same job under bench/every_rank_trainer.py (2 processes); its progress.json."""
    folder = work / "runs" / f"{doc['metadata']['name']}-every-rank"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    env = {"FTJOB_JOB_DIR": str(folder / "job"), "FTJOB_PROGRESS_PORT": "0"}
    script = str(common.ROOT / "bench" / "every_rank_trainer.py")
    common.torchrun(script, ["--spec", str(folder / "job.yaml")], 2, work, env=env)
    return json.loads((folder / "job" / "progress.json").read_text())


def small_job(size: str, work: Path, method: str = "full") -> dict:
    """Two steps of seq 64 x micro-batch 1: loading dominates; shared with bench.planner."""
    model = common.model_dir(size, work)
    return common.job(f"load-{size}-{method}", model, steps=2, seq=64, micro_batch=1,
                      method=method)  # fmt: skip


def measure(size: str, work: Path, base: list[float]) -> dict:
    ours = common.ftjob_run(small_job(size, work), work).progress["loadPeakRssMiB"]
    theirs = every_rank_run(small_job(size, work), work)["loadPeakRssMiB"]
    return {
        "model": size,
        "params": common.param_count(common.model_dir(size, work)),
        "rank0Loading": ours,
        "everyRank": theirs,
        "tinyBaseline": base,
        "rank1Growth": ours[1] - base[1],
        "rank1GrowthEveryRank": theirs[1] - base[1],
    }


def shard_mib(c: dict) -> float:
    """Rank 1's own half of the fp32 weights: what it must hold whoever reads the file."""
    return c["params"] * 4 / 2 / 2**20


def rows_for(c: dict) -> list[dict]:
    label = f"{c['model']} ({c['params'] / 1e6:.0f}M, {c['params'] * 4 / 2**20:.0f} MiB fp32)"
    ours, theirs = c["rank0Loading"], c["everyRank"]
    excess, excess_every = c["rank1Growth"] - shard_mib(c), c["rank1GrowthEveryRank"] - shard_mib(c)
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
        row(
            f"rank-1 growth beyond its own shard ({shard_mib(c):.0f}) MiB, {label}",
            excess,
            excess_every,
            EVERY,
        ),
        row(f"rank-0 load peak RSS MiB, {label}", ours[0], theirs[0], EVERY, ours[0] / theirs[0]),
    ]


def run(work: Path, quick: bool) -> dict:
    sizes = ["medium"] if quick else ["medium", "large"]
    base = common.ftjob_run(small_job("tiny", work), work).progress["loadPeakRssMiB"]
    cases = [measure(size, work, base) for size in sizes]
    rows = [r for c in cases for r in rows_for(c)]
    if len(cases) > 1:
        small, big = cases[0], cases[-1]
        ours = (big["rank1Growth"] - shard_mib(big)) - (small["rank1Growth"] - shard_mib(small))
        theirs = (big["rank1GrowthEveryRank"] - shard_mib(big)) - (
            small["rank1GrowthEveryRank"] - shard_mib(small)
        )
        grew = (big["params"] - small["params"]) * 4 / 2**20
        # Flat: beyond its own shard, rank 1 grows by under 10% of the weights the model gained.
        what = (f"rank-1 growth beyond its shard, {big['model']} minus {small['model']} MiB "
                f"(fp32 weights grew {grew:.0f})")  # fmt: skip
        rows.append(row(what, ours, theirs, EVERY, goal="flat (< 10% of weight growth)",
                        met=ours < 0.1 * grew))  # fmt: skip
    return {"cases": cases, "rows": rows}
