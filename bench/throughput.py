"""Suite a: trainer throughput, ftjob (`ftjob run`, FSDP2) against TRL SFTTrainer + accelerate
(torchrun, 2 processes) on the same model, data, sequence length, micro-batch and steps.

On CPU accelerate falls back to DDP (FINDINGS.md): the baseline is DDP, so this compares the
cost of ftjob's sharding against an unsharded trainer. GPU: see bench.gpu.
"""

from __future__ import annotations

from pathlib import Path

from bench import common
from bench.report import row

STEPS = {"tiny": 8, "medium": 6}


def compare(size: str, work: Path, method: str = "full", steps: int | None = None,
            seq: int = 256, micro_batch: int = 4) -> dict:  # fmt: skip
    model = common.model_dir(size, work)
    steps = steps or STEPS.get(size, 6)
    doc = common.job(f"tput-{size}-{method}", model, steps=steps, seq=seq,
                     micro_batch=micro_batch, method=method)  # fmt: skip
    ours = common.ftjob_run(doc, work)
    args = ["--model", str(model), "--data", str(common.CHAT_DATA), "--steps", str(steps),
            "--seq", str(seq), "--micro-batch", str(micro_batch), "--method", method]  # fmt: skip
    wall, out = common.torchrun(str(common.ROOT / "bench" / "trl_worker.py"), args, 2, work)
    trl = common.last_json(out, "TRL")
    mine, theirs = ours.steady_tokens_per_second(), trl["tokensPerSecond"]
    return {
        "model": size,
        "params": common.param_count(model),
        "method": method,
        "steps": steps,
        "ftjob": {"tokensPerSecond": mine, "wall": ours.wall, "losses": ours.losses(),
                  "trainPeakRssMiB": ours.progress.get("trainPeakRssMiB")},
        "baseline": {"tokensPerSecond": theirs, "wall": wall, "losses": trl["losses"],
                     "wrapper": trl["wrapper"], "peakRssMiB": trl["peakRssMiB"]},
        "ratio": mine / theirs if theirs else None,
    }  # fmt: skip


def run(work: Path, quick: bool) -> dict:
    sizes = ["tiny"] if quick else ["tiny", "medium"]
    cases = [compare(size, work) for size in sizes]
    rows = [
        row(
            f"tokens/s, {c['model']} ({c['params'] / 1e6:.1f}M) {c['method']}, 2 procs, "
            f"seq 256 x mb 4, {c['steps']} steps",
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
