"""Suite f (issue 6): `plan.estimate` against measured peaks of 2-process CPU runs.

Overall: the estimate's per-process total (weights + gradients + optimizer + activations +
temporaries + reserved) vs rank 1's trainPeakRssMiB (rank 1 never holds the whole model; rank
0 also reads the checkpoint). States: the estimate's model-dependent part (everything but the
fixed process baseline) vs rank 1's growth over the tiny model's run with the same settings,
which cancels the baseline the planner assumes (PROCESS_BASELINE_BYTES)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import common
from bench.loading import small_job
from bench.report import row
from ftjob import plan
from ftjob.modelshape import ModelShape
from ftjob.spec import parse_resource

MIB = 2**20


def estimate(doc: dict) -> plan.Estimate:
    _, spec = parse_resource(doc)
    config = json.loads((Path(doc["spec"]["model"]["source"]) / "config.json").read_text())
    return plan.estimate(spec, ModelShape.from_config(config))


def variable(e: plan.Estimate) -> float:
    return e.per_device - e.reserved


def run(work: Path, quick: bool) -> dict:
    sizes = ["tiny", "medium"] if quick else ["tiny", "medium", "large"]
    cases = []
    for method in ("full", "lora"):
        base_doc = small_job("tiny", work, method)
        base = common.ftjob_run(base_doc, work).progress["trainPeakRssMiB"][1]
        base_est = estimate(base_doc)
        for size in sizes:
            doc = small_job(size, work, method)
            measured = common.ftjob_run(doc, work).progress["trainPeakRssMiB"][1]
            e = estimate(doc)
            states = (e.weights + e.gradients + e.optimizer) / MIB
            growth_est = (variable(e) - variable(base_est)) / MIB
            cases.append({
                "model": size, "method": method, "params": e.params,
                "estimateTotalMiB": e.per_device / MIB, "measuredRank1MiB": measured,
                "ratio": e.per_device / MIB / measured,
                "estimateStatesMiB": states,
                "estimateGrowthMiB": growth_est, "measuredGrowthMiB": measured - base,
                "growthRatio": growth_est / (measured - base) if size != "tiny" else None,
                "breakdownMiB": {k: getattr(e, k) / MIB for k in ("weights", "gradients",
                                 "optimizer", "activations", "temporaries", "reserved")},
            })  # fmt: skip
    rows = []
    for c in cases:
        label = f"{c['model']} ({c['params'] / 1e6:.1f}M) {c['method']}, seq 64 x mb 1"
        rows.append(row(f"plan total vs rank-1 train peak RSS MiB, {label}",
                        c["estimateTotalMiB"], c["measuredRank1MiB"], "measured", c["ratio"],
                        goal="0.7-1.3x", met=0.7 <= c["ratio"] <= 1.3))  # fmt: skip
        if c["growthRatio"] is not None:
            g = c["growthRatio"]
            rows.append(row(f"plan growth over tiny vs measured MiB, {label} (of which "
                            f"W+G+O {c['estimateStatesMiB']:.0f})", c["estimateGrowthMiB"],
                            c["measuredGrowthMiB"], "measured", g, goal="0.85-1.15x",
                            met=0.85 <= g <= 1.15))  # fmt: skip
    return {"cases": cases, "rows": rows}
