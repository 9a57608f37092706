"""Suite accumulation (issue 21): what gradient accumulation costs in memory.

A ~190M Llama, full fine-tune, 2 CPU processes (gloo), the same micro-batch (1 x 256 tokens),
gradientAccumulation 1, 4 and 8: each rank's peak RSS while training. FSDP reduce-scatters
every micro-batch, so what accumulates is each rank's shard of the gradients (fp32, 4 bytes a
parameter / world size). At accumulation 1 that shard is freed after each optimizer step and
never meets the next step's activations; with accumulation it must live from the first
micro-batch to the update, beside the activations: one gradient shard more, whatever the
count. The old trainer turned gradient sync off between micro-batches and so kept the whole
unsharded fp32 gradient (4 bytes a parameter on every rank). glibc's mmap threshold is pinned
as in bench/planner.py, so that peak RSS measures tensors rather than the allocator's retention.
"""

from __future__ import annotations

from pathlib import Path

from bench import common
from bench.planner import PINNED
from bench.report import row

SIZE = "190m"
GOAL = 1.05  # issue 21: accumulation 4 within 5% of accumulation 1
MIB = 2**20


def job(accumulation: int, work: Path) -> dict:
    doc = common.job(f"accumulate-{accumulation}", common.model_dir(SIZE, work), steps=2,
                     seq=256, micro_batch=1, method="full", nodes=1)  # fmt: skip
    doc["spec"]["training"]["gradientAccumulation"] = accumulation
    doc["spec"]["resources"]["processesPerNode"] = 2
    return doc


def run(work: Path, quick: bool) -> dict:
    cases = {}
    for accumulation in (1, 4) if quick else (1, 4, 8):
        out = common.ftjob_run(job(accumulation, work), work, env=PINNED, timeout=1800)
        cases[accumulation] = {"trainPeakRssMiB": out.progress["trainPeakRssMiB"],
                               "losses": out.losses(), "wall": out.wall}  # fmt: skip
    params = common.param_count(common.model_dir(SIZE, work))
    shard = params * 4 / 2 / MIB  # one rank's fp32 gradient shard
    label = f"{params / 1e6:.0f}M full, 2 CPU processes, seq 256 x mb 1"
    rows = []
    for rank in (0, 1):
        peak = {a: c["trainPeakRssMiB"][rank] for a, c in cases.items()}
        rows.append(row(f"rank-{rank} train peak RSS MiB, {label}, accumulation 4 vs 1",
                        peak[4], peak[1], "accumulation 1", peak[4] / peak[1], f"<= {GOAL}x",
                        peak[4] / peak[1] <= GOAL))  # fmt: skip
        rows.append(row(f"rank-{rank} growth at accumulation 4 (MiB) vs one fp32 gradient "
                        f"shard, {label}", peak[4] - peak[1], shard, "params x 4 B / 2 ranks",
                        (peak[4] - peak[1]) / shard, "~1x (the accumulator)"))  # fmt: skip
        if 8 in peak:
            rows.append(row(f"rank-{rank} train peak RSS MiB, {label}, accumulation 8 vs 4",
                            peak[8], peak[4], "accumulation 4", peak[8] / peak[4],
                            "flat (<= 1.02x)", peak[8] / peak[4] <= 1.02))  # fmt: skip
    return {"cases": [{"accumulation": a, **c} for a, c in cases.items()], "rows": rows}
