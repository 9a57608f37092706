"""Suite f (issue 6): `plan.estimate` against measured peaks of 2-process CPU runs.

Overall: the estimate's per-process total (weights + gradients + optimizer + activations +
temporaries + reserved) vs rank 1's trainPeakRssMiB. Growth: the estimate's model-dependent
part (everything but the fixed process baseline) vs rank 1's growth over the tiny model's run
with the same settings, which cancels the baseline the planner assumes
(PROCESS_BASELINE_BYTES).

Each run is measured twice: with glibc's default allocator settings, and with its mmap
threshold pinned (PINNED). By default glibc raises the threshold after large tensors are
freed, so later ones come from the heap and freed memory stays resident: peak RSS then
measures the allocator's retention, not the live tensors the planner models.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import common
from bench.report import row
from ftjob.api.jobspec import parse_resource
from ftjob.job import machine
from ftjob.plan.estimate import Estimate
from ftjob.plan.layout import estimate
from ftjob.plan.modelshape import ModelShape

MIB = 2**20
PINNED = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def small_job(size: str, work: Path, method: str = "full") -> dict:
    """Two steps of seq 64 x micro-batch 1: the weights dominate."""
    model = common.model_dir(size, work)
    return common.job(f"load-{size}-{method}", model, steps=2, seq=64, micro_batch=1,
                      method=method)  # fmt: skip


def estimate_of(doc: dict) -> Estimate:
    _, spec = parse_resource(doc)
    config = json.loads((Path(doc["spec"]["model"]["source"]) / "config.json").read_text())
    # The memory `ftjob run` fits sharding auto against on this machine, as the trainer does.
    return estimate(spec, ModelShape.from_config(config), machine.memory_bytes())


def variable(e: Estimate) -> float:
    return e.per_device - e.reserved


def rank1_peak(doc: dict, work: Path, env: dict | None) -> float:
    return common.ftjob_run(doc, work, env=env).progress["trainPeakRssMiB"][1]


def measure(size: str, method: str, work: Path) -> dict:
    doc, base_doc = small_job(size, work, method), small_job("tiny", work, method)
    e, base_e = estimate_of(doc), estimate_of(base_doc)
    total = e.per_device / MIB
    growth = (variable(e) - variable(base_e)) / MIB
    case = {"model": size, "method": method, "params": e.params, "estimateTotalMiB": total,
            "estimateGrowthMiB": growth,
            "estimateStatesMiB": (e.weights + e.gradients + e.optimizer) / MIB,
            "breakdownMiB": {k: getattr(e, k) / MIB for k in ("weights", "gradients",
                             "optimizer", "activations", "temporaries", "reserved")}}  # fmt: skip
    for key, env in (("default", None), ("pinned", PINNED)):
        measured = rank1_peak(doc, work, env)
        measured_growth = measured - rank1_peak(base_doc, work, env)
        growth_ratio = growth / measured_growth if size != "tiny" else None
        case[key] = {"rank1MiB": measured, "ratio": total / measured,
                     "growthMiB": measured_growth, "growthRatio": growth_ratio}  # fmt: skip
    return case


def rows_for(c: dict) -> list[dict]:
    label = f"{c['model']} ({c['params'] / 1e6:.1f}M) {c['method']}, seq 64 x mb 1"
    total, d, p = c["estimateTotalMiB"], c["default"], c["pinned"]
    rows = [
        row(f"plan total vs rank-1 train peak RSS MiB, {label}", total, d["rank1MiB"],
            "measured", d["ratio"], "0.7-1.3x", 0.7 <= d["ratio"] <= 1.3),
        row(f"... same, glibc mmap threshold pinned, {label}", total, p["rank1MiB"],
            "measured (pinned)", p["ratio"], "0.7-1.3x", 0.7 <= p["ratio"] <= 1.3),
    ]  # fmt: skip
    if p["growthRatio"] is not None:
        g = p["growthRatio"]
        rows.append(row(f"plan growth over tiny vs measured (pinned) MiB, {label}; W+G+O "
                        f"{c['estimateStatesMiB']:.0f} of it", c["estimateGrowthMiB"],
                        p["growthMiB"], "measured (pinned)", g, "0.85-1.15x",
                        0.85 <= g <= 1.15))  # fmt: skip
    return rows


def run(work: Path, quick: bool) -> dict:
    sizes = ["tiny", "medium"] if quick else ["tiny", "medium", "large"]
    cases = [measure(size, method, work) for method in ("full", "lora") for size in sizes]
    return {"cases": cases, "rows": [r for c in cases for r in rows_for(c)]}
