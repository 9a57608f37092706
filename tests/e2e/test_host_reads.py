"""A training step reads nothing from the device between log steps (issue 50, item 2).

    python -m pytest tests/e2e/test_host_reads.py -q

The trainer runs in this process as a gang of one (``python -m ftjob.trainer`` without
torchrun: gloo, world 1), its real loop and step (objective, accumulation, clip, optimizer,
preemption vote, straggler tally, progress) under tests/host_reads.py's counter, which counts
every read a GPU would wait for. Each iteration of the loop is counted on its own: a log step
may read once (the log's one all-reduce), any other step not at all. The counter is shown to
catch a step that calls ``.item()``.
"""

from __future__ import annotations

import in_process
import pytest
from host_reads import HostReads
from test_qlora import make_base
from test_trainer_run import EXAMPLES, job

STEPS, LOG_EVERY, ACCUMULATION = 6, 3, 2


def one_rank(name: str, **changes) -> dict:
    """A one-process job of STEPS steps, logged every LOG_EVERY, with no eval or checkpoint
    inside the loop (they are not steps)."""
    doc = job(name, **changes)
    spec = doc["spec"]
    spec["training"].update(
        maxSteps=STEPS, logEvery=LOG_EVERY, evalEvery=0, gradientAccumulation=ACCUMULATION,
        maxGradNorm=1.0, warmup=1,
    )  # fmt: skip
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec["parallelism"] = changes.get("parallelism", {"sharding": "auto"})
    spec["checkpoint"]["every"] = 1000
    return doc


def dpo(name: str, method: dict) -> dict:
    doc = one_rank(name, method=method)
    spec = doc["spec"]
    pairs = str(EXAMPLES / "data" / "tiny-pairs.jsonl")
    spec["dataset"] = {"source": pairs, "format": "preference", "maxSeqLength": 64,
                       "evalFraction": None}  # fmt: skip
    spec["training"].update(objective="dpo", dpo={"beta": 0.1}, microBatchSize=2)
    return doc


LORA = {"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.1,
                                 "targetModules": ["q_proj", "v_proj", "lm_head"]}}  # fmt: skip
JOBS = {
    "full": lambda base: one_rank("reads-full"),
    "lora": lambda base: one_rank("reads-lora", method=LORA),
    "qlora": lambda base: one_rank(
        "reads-qlora",
        model={"source": str(base)},
        method={**LORA, "type": "qlora", "quantization": {"type": "nf4"}},
    ),
    # No dropout: the adapted head takes the chunked loss (trainer/objectives/loss.py).
    "dpo-lora": lambda base: dpo(
        "reads-dpo-lora", {**LORA, "lora": {**LORA["lora"], "dropout": 0.0}}
    ),
    "dpo-full": lambda base: dpo("reads-dpo-full", {"type": "full"}),
}


def reads_per_iteration(doc: dict, folder, monkeypatch) -> list[HostReads]:
    """Train ``doc`` in this process; the counter of each iteration of the training loop."""
    from ftjob.trainer import step, train

    iterations: list[HostReads] = []
    next_batch, loop = step.Prefetch.next, train._train

    def counted_next(self, n):
        # An iteration begins where it takes its micro-batches: the last one's count closes.
        if iterations:
            iterations[-1].__exit__(None, None, None)
        got = next_batch(self, n)
        iterations.append(HostReads().__enter__())
        return got

    def counted_loop(*args, **kwargs):
        try:
            return loop(*args, **kwargs)
        finally:
            if iterations:
                iterations[-1].__exit__(None, None, None)

    monkeypatch.setattr(step.Prefetch, "next", counted_next)
    monkeypatch.setattr(train, "_train", counted_loop)
    in_process.train(doc, folder, monkeypatch)
    return iterations


def assert_reads_only_on_log_steps(iterations: list[HostReads]) -> None:
    assert len(iterations) == STEPS
    for n, reads in enumerate(iterations, start=1):
        allowed = 1 if n % LOG_EVERY == 0 else 0
        assert reads.count <= allowed, (n, reads.where)
    # The log step's one read is seen: the counter is not blind to this loop.
    assert iterations[LOG_EVERY - 1].count == 1


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("host-reads") / "base"
    make_base(folder)
    return folder


@pytest.mark.parametrize("kind", list(JOBS))
def test_steps_between_log_steps_read_nothing_from_the_device(kind, base, tmp_path, monkeypatch):
    iterations = reads_per_iteration(JOBS[kind](base), tmp_path / kind, monkeypatch)
    assert_reads_only_on_log_steps(iterations)


def test_a_sharded_step_reads_nothing_between_log_steps_either(tmp_path, monkeypatch):
    """The same over FSDP (a gang of one sharded as several ranks are: the hooks, DTensor
    parameters and the clip over them)."""
    from ftjob.trainer.model import parallel

    monkeypatch.setattr(parallel, "plain_enough", lambda spec, d: False)
    doc = one_rank("reads-sharded", parallelism={"sharding": "full"})
    assert_reads_only_on_log_steps(reads_per_iteration(doc, tmp_path / "sharded", monkeypatch))


def test_the_counter_catches_a_step_that_calls_item(tmp_path, monkeypatch):
    from ftjob.trainer import step

    train_step = step.train_step

    def reads_its_loss(*args, **kwargs):
        share, waited, sums = train_step(*args, **kwargs)
        share.item()  # what a careless log line in the step would do
        return share, waited, sums

    monkeypatch.setattr(step, "train_step", reads_its_loss)
    iterations = reads_per_iteration(one_rank("reads-item"), tmp_path / "item", monkeypatch)
    with pytest.raises(AssertionError):
        assert_reads_only_on_log_steps(iterations)
    assert [reads.kinds["item"] for reads in iterations] == [1] * STEPS
