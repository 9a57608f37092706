"""A background checkpoint holds the state of the step it names, though training goes on.

    python -m pytest tests/e2e/test_checkpoint_async.py -q

The test runs this file under torchrun (the ``__main__`` block): 2 ranks shard the tiny model
with FSDP2, train a step, start an async save, and train on while it is copied and written
(waiting before each optimizer update, as the trainer does). Each rank then loads the
checkpoint into the model it kept training and compares it with what it held when the save
began; a synchronous save of the same state is loaded and compared the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hangs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def snapshot(model, optimizer) -> dict:
    """Every rank's local shards of the weights and AdamW moments, copied."""
    out = {f"w:{n}": p.to_local().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            if value.dim() > 0:
                out[f"{key}:{n}"] = value.to_local().clone()
    return out


def differences(a: dict, b: dict) -> list[str]:
    import torch

    return [k for k in a if not torch.equal(a[k], b[k])]


def probe(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from ftjob.trainer.state import checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    background = checkpoint.Checkpointer(out / "async", rank, keep=1, async_save=True)
    sync = checkpoint.Checkpointer(out / "sync", rank, keep=1, async_save=False)

    def step() -> None:
        ids = torch.randint(0, model.config.vocab_size, (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        background.before_update()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    at_save = snapshot(model, optimizer)
    background.save(model, optimizer, scheduler, 1)
    sync.save(model, optimizer, scheduler, 1)
    for _ in range(3):
        step()  # the state moves on while the background save copies and writes
    moved = snapshot(model, optimizer)
    background.close()
    results = {"moved": len(differences(at_save, moved)), "tensors": len(at_save)}
    for name, saver in (("async", background), ("sync", sync)):
        found = checkpoint.latest(saver.root)
        results[f"{name}Folder"] = found.name if found else None
        results[f"{name}Step"] = saver.load(found, model, optimizer, scheduler)[0]
        results[f"{name}Differs"] = differences(at_save, snapshot(model, optimizer))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_async_checkpoint_equals_the_state_when_it_was_started(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hangs.RUN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["moved"] == r["tensors"] > 0  # training changed every tensor after the save
        assert r["asyncFolder"] == r["syncFolder"] == "step-00000001"
        assert r["asyncStep"] == r["syncStep"] == 1
        assert r["asyncDiffers"] == [] and r["syncDiffers"] == []


if __name__ == "__main__":
    from ftjob.trainer.__main__ import exit_now

    probe(Path(sys.argv[1]))
    exit_now(0)  # as the trainer leaves: torch.distributed's teardown can abort a done rank
