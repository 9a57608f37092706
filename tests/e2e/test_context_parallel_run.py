"""Context parallelism through ``ftjob run``: a sequence split over 2 processes trains to the
losses of one process holding it whole.

    python -m pytest tests/e2e/test_context_parallel_run.py -q

One real run of 2 CPU processes at parallelism.contextParallel 2 (one group: data parallel 1,
FSDP over both ranks, every layer recomputed in backward, so the all-to-alls run again there)
against the same job trained in this process as a gang of one (tests/in_process.py): the same
micro-batches each step (the sampler counts groups, not processes), every step's loss and the
final eval loss within 1e-5. The exactness of one step, gradient by gradient, at 2 and 4 is
tests/unit/test_context_parallel.py's; this is the wiring: the spec, the groups, the sampler,
the cut in the prefetch thread, evaluation, checkpoint and export.
"""

from __future__ import annotations

import in_process
import pytest
from test_trainer_run import final, history, job, losses, run

STEPS = 5


def _job(name: str, resources: dict, split: int) -> dict:
    return job(
        name,
        training={"maxSteps": STEPS, "learningRate": 1e-3, "microBatchSize": 2},
        resources={"nodes": 1, "gpusPerNode": 0, **resources},
        parallelism={"sharding": "full", "contextParallel": split},
        checkpoint={"every": 2, "keep": 3},
    )


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """The job at contextParallel 2 on 2 processes, saving every 2 steps: its folder."""
    folder = tmp_path_factory.mktemp("cp") / "cp2"
    code, out = run(_job("cp-two", {"processesPerNode": 2}, 2), folder)
    assert code == 0, out[-3000:]
    assert "context parallel 2 (Ulysses all-to-all over heads) x data parallel 1" in out
    return folder


def test_a_split_sequence_trains_to_one_process_losses(split_run, tmp_path, monkeypatch):
    (tmp_path / "cp2").symlink_to(split_run)
    in_process.train(_job("cp-one", {}, 1), tmp_path / "one", monkeypatch)
    split, whole = losses(tmp_path / "cp2"), losses(tmp_path / "one")
    assert sorted(whole) == list(range(1, STEPS + 1))
    for step, reference in whole.items():
        assert split[step] == pytest.approx(reference, rel=1e-5, abs=1e-5), step
    assert whole[STEPS] < whole[1]  # it trains at all
    # The slices' token counts add up to the whole micro-batches', and a group is one reader
    # of the data: the same epoch at each step.
    seen = [[(r["tokensSeen"], r["epoch"]) for r in history(tmp_path / w)] for w in ("cp2", "one")]
    assert seen[0] == seen[1] and seen[0][-1][0] > 0
    evaluated = [final(tmp_path / w)["evalLoss"] for w in ("cp2", "one")]
    assert evaluated[0] == pytest.approx(evaluated[1], rel=1e-5)
    assert (tmp_path / "cp2" / "model" / "config.json").is_file()  # exported as any job


def test_a_split_run_resumes_from_its_checkpoint_to_the_same_losses(split_run, tmp_path):
    """Stopped after step 2's checkpoint (the groups' shards, the data order by step and by
    group), `ftjob run` again at contextParallel 2: steps 3-5 with the uninterrupted run's
    losses."""
    again = tmp_path / "resumed"
    in_process.stopped_after(split_run, again, 2)
    code, out = run(_job("cp-two", {"processesPerNode": 2}, 2), again)
    assert code == 0, out[-3000:]
    assert "(step 2)" in out, out[-3000:]
    first, resumed = losses(split_run), losses(again)
    assert sorted(resumed) == [3, 4, 5]
    assert resumed == {step: first[step] for step in resumed}
