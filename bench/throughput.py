"""Suite a: trainer throughput, ftjob (`ftjob run`, FSDP2) against TRL SFTTrainer + accelerate
(torchrun, 2 processes) on the same model, data, sequence length, micro-batch and steps.

On CPU accelerate falls back to DDP (its FSDP plugin needs CUDA): the baseline is DDP, so
this compares the cost of ftjob's sharding against an unsharded trainer. GPU: see bench.gpu.
"""

from __future__ import annotations

from pathlib import Path

from bench import common
from bench.report import row

# Steps a run: enough after the warm-up that the median per-step rate (common.steady) stands
# on a dozen steps or more.
STEPS = {"tiny": 16, "medium": 16}
# Warm-up steps left out of both sides' rates (allocation, first-touch page faults): the same
# number a side, passed to TRL's worker as --skip.
SKIP = 2


def trl_args(model: Path, steps: int, seq: int, micro_batch: int, method: str) -> list[str]:
    """bench.trl_worker's arguments for the job :func:`common.job` makes of the same values."""
    return ["--model", str(model), "--data", str(common.CHAT_DATA), "--steps", str(steps),
            "--seq", str(seq), "--micro-batch", str(micro_batch), "--method", method,
            "--skip", str(SKIP)]  # fmt: skip


def compare(size: str, work: Path, method: str = "full", steps: int | None = None,
            seq: int = 256, micro_batch: int = 4, pairs: int = 2) -> dict:  # fmt: skip
    """ftjob and TRL alternately, ``pairs`` times each; the best tokens/s of each side counts
    (others' jobs on a shared machine only ever slow a run down)."""
    model = common.model_dir(size, work)
    steps = steps or STEPS.get(size, 6)
    args = trl_args(model, steps, seq, micro_batch, method)
    ours, theirs = common.alternate(
        pairs, f"tput-{size}-{method}",
        lambda name: common.job(name, model, steps=steps, seq=seq, micro_batch=micro_batch,
                                method=method),
        "bench.trl_worker", args, work,
    )  # fmt: skip
    rates = [r.steady_tokens_per_second(SKIP) for r in ours]  # each run's median step
    mine = max(rates)
    best = max(t["tokensPerSecond"] for t in theirs)
    return {
        "model": size,
        "params": common.param_count(model),
        "method": method,
        "steps": steps,
        "seq": seq,
        "microBatch": micro_batch,
        "ftjob": {"tokensPerSecond": mine,
                  "runs": rates,
                  "stepRates": [r.step_rates(SKIP) for r in ours],
                  "wall": [r.wall for r in ours], "losses": ours[0].losses(),
                  "trainPeakRssMiB": ours[0].progress.get("trainPeakRssMiB")},
        "baseline": {"tokensPerSecond": best, "runs": [t["tokensPerSecond"] for t in theirs],
                     "stepRates": [t["stepRates"] for t in theirs],
                     "wall": [t["wall"] for t in theirs], "losses": theirs[0]["losses"],
                     "wrapper": theirs[0]["wrapper"], "peakRssMiB": theirs[0]["peakRssMiB"]},
        "ratio": mine / best if best else None,
    }  # fmt: skip


# Best of 3 a side (issue 50's CPU goal): others' work on a shared machine only slows a run.
PAIRS = 3
# The 190M LoRA row has the dpo suite's shape (bench/dpo.py FULL): seq 256, two sequences a
# rank (a pair there); 14 steps (12 after the warm-up).
LORA_190M = dict(method="lora", steps=14, seq=256, micro_batch=2, pairs=PAIRS)


def run(work: Path, quick: bool) -> dict:
    sizes = ["tiny"] if quick else ["tiny", "medium"]
    cases = [compare(size, work, pairs=1 if quick else PAIRS) for size in sizes]
    if not quick:
        cases.append(compare("190m", work, **LORA_190M))
    rows = [
        row(
            f"tokens/s (median step) after {SKIP} warm-up steps, "
            f"{c['model']} ({c['params'] / 1e6:.1f}M) {c['method']}, 2 procs, "
            f"seq {c['seq']} x mb {c['microBatch']}, {c['steps']} steps, "
            f"best of {len(c['ftjob']['runs'])}",
            c["ftjob"]["tokensPerSecond"],
            c["baseline"]["tokensPerSecond"],
            f"TRL SFTTrainer ({c['baseline']['wrapper']})",
            c["ratio"],
            ">= 1.1x (GPU goal; CPU baseline is DDP)",
            c["ratio"] is not None and c["ratio"] >= 1.1,
        )
        for c in cases
    ]
    return {"cases": cases, "rows": rows}
