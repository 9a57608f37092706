"""Gradient accumulation: the same global batch gives the same losses, however it is split.

    python -m pytest tests/e2e/test_accumulation.py -q

`ftjob run` with 2 real processes. FSDP reduce-scatters every micro-batch (sharded gradients
accumulate) and, with replicas (hybrid), defers only the all-reduce across them to the last
micro-batch: a step of 4 micro-batches of 1 sequence must train exactly like a step of one
micro-batch of 4. Memory at accumulation 4 vs 1 (a 190M model) is a benchmark:
`python -m bench --suite accumulation`.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_trainer_run import job, losses, run

STEPS = 4


def split(name: str, micro: int, accumulation: int, **resources) -> dict:
    return job(
        name,
        training={
            "maxSteps": STEPS,
            "microBatchSize": micro,
            "gradientAccumulation": accumulation,
            "learningRate": 1e-3,
        },  # fmt: skip
        dataset={"evalFraction": None},
        resources={"nodes": 2, "gpusPerNode": 0, **resources},
    )


# Hybrid shards within a node and replicates across: both reductions. Full sharding alone is
# the slow tier's (tests/deadline.py).
@pytest.mark.parametrize("sharding", [pytest.param("full", marks=pytest.mark.slow), "hybrid"])
def test_accumulated_micro_batches_train_like_one_batch(tmp_path, sharding):
    curves = {}
    for micro, accumulation in ((4, 1), (1, 4)):
        doc = split(f"acc-{sharding}-{accumulation}", micro, accumulation)
        doc["spec"]["parallelism"] = {"sharding": sharding}
        if sharding == "hybrid":  # 2 nodes x 2 processes: shards within, replicas across
            doc["spec"]["resources"]["processesPerNode"] = 2
        workdir = tmp_path / f"{micro}x{accumulation}"
        code, out = run(doc, workdir)
        assert code == 0, out[-3000:]
        curves[accumulation] = losses(workdir)
    assert sorted(curves[1]) == list(range(1, STEPS + 1))
    for step, reference in curves[1].items():
        assert curves[4][step] == pytest.approx(reference, rel=1e-5, abs=1e-5), step
    assert curves[1][STEPS] < curves[1][1]  # it trains at all
