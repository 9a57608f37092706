"""Gradient accumulation: the same global batch gives the same losses, however it is split.

    python -m pytest tests/e2e/test_accumulation.py -q

`ftjob run` with 4 real processes, hybrid sharding (2 nodes x 2: shards within a node,
replicas across): FSDP reduce-scatters every micro-batch (sharded gradients accumulate) and
defers only the all-reduce across replicas to the last micro-batch. A step of 4 micro-batches
of 1 sequence on each of the 4 ranks must train exactly like one micro-batch of all 16
sequences, which the trainer computes here in this process as a gang of one
(tests/in_process.py): the step's rows are the same whatever the split (data.Sampler), and
the one-batch step is one rank's arithmetic. Full sharding with accumulation is compared with
the unaccumulated layouts in test_sharding_layouts.py. Memory at accumulation 4 vs 1 (a 190M
model) is a benchmark: `python -m bench --suite accumulation`.
"""

from __future__ import annotations

import in_process
import pytest
from test_trainer_run import job, losses, run

STEPS = 4


def split(name: str, micro: int, accumulation: int, resources: dict) -> dict:
    return job(
        name,
        training={
            "maxSteps": STEPS,
            "microBatchSize": micro,
            "gradientAccumulation": accumulation,
            "learningRate": 1e-3,
        },  # fmt: skip
        dataset={"evalFraction": None},
        resources={"gpusPerNode": 0, **resources},
    )


def test_hybrid_accumulated_micro_batches_train_like_one_batch(tmp_path, monkeypatch):
    doc = split("acc-hybrid", 1, 4, {"nodes": 2, "processesPerNode": 2})
    doc["spec"]["parallelism"] = {"sharding": "hybrid"}
    code, out = run(doc, tmp_path / "hybrid-1x4")
    assert code == 0, out[-3000:]
    accumulated = losses(tmp_path / "hybrid-1x4")
    in_process.train(split("acc-one", 16, 1, {"nodes": 1}), tmp_path / "one-16x1", monkeypatch)
    one_batch = losses(tmp_path / "one-16x1")
    assert sorted(one_batch) == list(range(1, STEPS + 1))
    for step, reference in one_batch.items():
        assert accumulated[step] == pytest.approx(reference, rel=1e-5, abs=1e-5), step
    assert one_batch[STEPS] < one_batch[1]  # it trains at all
