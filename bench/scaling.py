"""Suite e: 2 processes vs 1 process on CPU for the same global batch (8 sequences of 256):
wall time, steady tokens/s and loss parity. The 2-process run is bench.throughput's."""

from __future__ import annotations

from pathlib import Path

from bench import common
from bench.report import row
from bench.throughput import SKIP, STEPS


def run(work: Path, quick: bool) -> dict:
    size = "tiny" if quick else "medium"
    model, steps = common.model_dir(size, work), STEPS[size]
    tries = 1 if quick else 2
    # The 2-process runs are bench.throughput's (cached); best of each side, as there.
    twos = [common.ftjob_run(common.job(f"tput-{size}-full" + (f"-{i}" if i else ""), model,
                                        steps=steps, seq=256, micro_batch=4), work)
            for i in range(tries)]  # fmt: skip
    ones = [common.ftjob_run(common.job(f"scale-{size}-1-{i}", model, steps=steps, seq=256,
                                        micro_batch=8, nodes=1), work)
            for i in range(tries)]  # fmt: skip
    two = max(twos, key=lambda r: r.steady_tokens_per_second(SKIP))
    one = max(ones, key=lambda r: r.steady_tokens_per_second(SKIP))
    diff = max(abs(a - b) for a, b in zip(two.losses(), one.losses(), strict=True))
    t2, t1 = two.steady_tokens_per_second(SKIP), one.steady_tokens_per_second(SKIP)
    rows = [
        row(
            f"tokens/s 2 procs vs 1 proc, {size}, global batch 8 x 256, best of {tries}",
            t2,
            t1,
            "1 process (2 threads)",
            t2 / t1,
        ),
        row(
            f"wall s of `ftjob run` ({steps} steps, incl. start-up), 2 vs 1 procs",
            two.wall,
            one.wall,
            "1 process",
            two.wall / one.wall,
        ),
        row(
            "loss parity: max abs(loss 2 procs - loss 1 proc) over steps",
            diff,
            goal="< 1e-3",
            met=diff < 1e-3,
        ),
    ]
    return {"losses2": two.losses(), "losses1": one.losses(), "rows": rows}
