"""Suite memory (issue 12): per-rank peak memory of LoRA and QLoRA on a ~190M Llama, 2 CPU
processes, fp32 compute, against `ftjob plan`'s per-process estimate.

LoRA holds its frozen base sharded in the compute dtype (fp32 on CPU); QLoRA holds the decoder
layers' linear weights in 4-bit NF4, sharded too, so each rank keeps 1/2 of ~0.52 bytes a
weight instead of 1/2 of 4. Measured: rank 1's trainPeakRssMiB (rank 1 never reads the weight
files), with glibc's mmap threshold pinned (see bench/planner.py: otherwise peak RSS measures
the allocator's retention). QLoRA's row puts it next to LoRA's on the same base.
"""

from __future__ import annotations

from pathlib import Path

from bench import common
from bench.planner import MIB, PINNED, estimate_of
from bench.report import row

SIZE = "190m"


def job(method: str, work: Path) -> dict:
    """Two steps, seq 64 x micro-batch 1, two processes on one node: memory is the weights'."""
    doc = common.job(f"memory-{method}", common.model_dir(SIZE, work), steps=2, seq=64,
                     micro_batch=1, method=method, nodes=1)  # fmt: skip
    doc["spec"]["resources"]["processesPerNode"] = 2
    return doc


def measure(method: str, work: Path) -> dict:
    doc = job(method, work)
    e = estimate_of(doc)
    run = common.ftjob_run(doc, work, env=PINNED)
    return {"method": method, "params": e.params, "planMiB": e.per_device / MIB,
            "planWeightsMiB": e.weights / MIB, "rankPeakMiB": run.progress["trainPeakRssMiB"],
            "loadPeakMiB": run.progress["loadPeakRssMiB"], "losses": run.losses()}  # fmt: skip


def run(work: Path, quick: bool) -> dict:
    cases = {m: measure(m, work) for m in ("lora", "qlora")}
    rows = []
    for method, c in cases.items():
        label = f"{c['params'] / 1e6:.0f}M {method}, 2 CPU processes, seq 64 x mb 1"
        measured = c["rankPeakMiB"][1]
        ratio = c["planMiB"] / measured
        rows.append(row(f"plan vs rank-1 train peak RSS MiB, {label}", c["planMiB"], measured,
                        "measured (pinned)", ratio, "0.7-1.3x", 0.7 <= ratio <= 1.3))  # fmt: skip
    q, lo = cases["qlora"]["rankPeakMiB"][1], cases["lora"]["rankPeakMiB"][1]
    rows.append(row(f"rank-1 train peak RSS MiB, {cases['qlora']['params'] / 1e6:.0f}M qlora "
                    "vs lora", q, lo, "lora (fp32 base)", q / lo))  # fmt: skip
    return {"cases": list(cases.values()), "rows": rows}
