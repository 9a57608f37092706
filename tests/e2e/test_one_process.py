"""A job of one process trains a plain module, no FSDP (issue 50, item 1).

    python -m pytest tests/e2e/test_one_process.py -q

The trainer runs in this process as a gang of one (tests/in_process.py), twice over the same
steps: as it does now (a plain module: no ``fully_shard``, no DTensor) and, for comparison,
with the sharded path it took before (``fully_shard`` over a mesh of one, forced by the
test). On CPU in fp32 the two train to the same losses, export the same weights, and each
resumes from the other's checkpoint to the losses the uninterrupted run logged.
"""

from __future__ import annotations

import in_process
import pytest
import torch
from safetensors.torch import load_file
from test_trainer_run import job, losses

STEPS, EVERY = 6, 3


def one_process(name: str, **changes) -> dict:
    doc = job(name, **changes)
    spec = doc["spec"]
    spec["training"].update(maxSteps=STEPS, evalEvery=0, gradientAccumulation=2, warmup=1)
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec["parallelism"] = {"sharding": "full"}  # what a gang of one ignores
    spec["checkpoint"].update(every=EVERY, keep=2)
    spec["dataset"]["evalFraction"] = None
    return doc


def sharded_anyway(monkeypatch) -> None:
    """The trainer as it was: FSDP over one rank."""
    from ftjob.trainer.model import parallel

    monkeypatch.setattr(parallel, "plain_enough", lambda spec, d: False)


def watched(monkeypatch) -> dict:
    """The model the steps train and the number of ``fully_shard`` calls, filled in as the
    run goes."""
    from torch.distributed.fsdp import FSDPModule

    from ftjob.trainer import step
    from ftjob.trainer.model import parallel

    seen: dict = {"fully_shard": 0}
    shard, train_step = parallel.fully_shard, step.train_step

    def counted(module, **kwargs):
        seen["fully_shard"] += 1
        return shard(module, **kwargs)

    def looked_at(run, *args, **kwargs):
        net = run.net
        seen["dtensors"] = [
            n for n, p in net.named_parameters() if type(p.data) is not torch.Tensor
        ]
        seen["fsdp"] = [n for n, m in net.named_modules() if isinstance(m, FSDPModule)]
        return train_step(run, *args, **kwargs)

    monkeypatch.setattr(parallel, "fully_shard", counted)
    monkeypatch.setattr(step, "train_step", looked_at)
    return seen


def exported(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted((folder / "model").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's uninterrupted run: its folder, and what the plain run's steps saw."""
    root = tmp_path_factory.mktemp("one-process")
    with pytest.MonkeyPatch.context() as patch:
        seen = watched(patch)
        in_process.train(one_process("plain"), root / "plain", patch)
    with pytest.MonkeyPatch.context() as patch:
        sharded = watched(patch)
        sharded_anyway(patch)
        in_process.train(one_process("sharded"), root / "sharded", patch)
    return root, seen, sharded


def test_one_process_trains_a_plain_module(runs):
    _, seen, sharded = runs
    assert seen == {"fully_shard": 0, "dtensors": [], "fsdp": []}
    # The comparison is with a model that was sharded: the test sees FSDP where it is.
    assert sharded["fully_shard"] > 0 and sharded["dtensors"] and sharded["fsdp"]


def test_plain_and_sharded_train_to_the_same_losses_and_export(runs):
    root = runs[0]
    plain, sharded = losses(root / "plain"), losses(root / "sharded")
    assert sorted(plain) == list(range(1, STEPS + 1))
    for step, loss in sharded.items():
        assert plain[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), step
    assert plain[STEPS] < plain[1]
    ours, theirs = exported(root / "plain"), exported(root / "sharded")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("written, read", [("plain", "sharded"), ("sharded", "plain")])
def test_a_checkpoint_of_one_layout_resumes_in_the_other(
    runs, written, read, tmp_path, monkeypatch
):
    root = runs[0]
    saved = f"{written}/checkpoints/step-{EVERY:08d}"  # on the volume: a relative path
    assert (root / saved).is_dir()
    monkeypatch.setenv("FTJOB_SOURCE_ROOT", str(root))
    doc = one_process(f"{read}-from-{written}", checkpoint={"resumeFrom": saved})
    if read == "sharded":
        sharded_anyway(monkeypatch)
    in_process.train(doc, tmp_path / "resumed", monkeypatch)
    resumed, uninterrupted = losses(tmp_path / "resumed"), losses(root / written)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6, abs=1e-6), step
