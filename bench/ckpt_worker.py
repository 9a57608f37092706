"""Checkpoint timings on every rank of a 2-process FSDP2 gang (run by bench.checkpoints):

    python -m torch.distributed.run --standalone --nproc-per-node 2 --module bench.ckpt_worker \
        --model DIR --out DIR

* sharded: ftjob's Checkpointer (DCP, every rank writes its shards) with a synchronous save;
* raw: each rank torch.save()s its local tensors to one fsynced file (the disk's floor);
* full: the baseline -- gather model and optimizer to rank 0 (full_state_dict, cpu_offload)
  and write them with safetensors' save_file, as HF Trainer's FULL_STATE_DICT does;
* async: ftjob's Checkpointer with async_save, followed by STEPS_AFTER training steps while
  the copy and the write go on in the background. The stall is what training waits for:
  save() itself plus the waits before each optimizer update (``before_update``). The overlap
  cost is everything the save adds to those steps (stall and competition for the CPU), against
  the same steps without a save;
* resume: Checkpointer.load of the sharded checkpoint (model + optimizer + scheduler + RNG).
Prints ``CKPT {json}`` on rank 0 (seconds; min over --repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from ftjob.trainer.state import checkpoint, integrity


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


# Short steps (1 x 64 tokens), enough of them to outlast the background write on CPU.
STEPS_AFTER, TOKENS = 2, (1, 64)


def train_step(model, optimizer, vocab: int, before_update=lambda: None) -> float:
    """One step; returns the seconds spent waiting in before_update."""
    ids = torch.randint(0, vocab, TOKENS)
    model(input_ids=ids, labels=ids).loss.backward()
    start = time.perf_counter()
    before_update()
    waited = time.perf_counter() - start
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return waited


def async_save(model, optimizer, scheduler, saver, step: int, vocab: int) -> dict:
    """Start a background save, train STEPS_AFTER steps, then wait for the save to commit."""
    dist.barrier()
    start = time.perf_counter()
    saver.save(model, optimizer, scheduler, step)
    call = time.perf_counter() - start
    waits = sum(
        train_step(model, optimizer, vocab, saver.before_update) for _ in range(STEPS_AFTER)
    )
    steps = time.perf_counter() - start - call
    saver.wait()
    dist.barrier()
    return {"stall": call + waits, "call": call, "steps": steps,
            "total": time.perf_counter() - start}  # fmt: skip


def steps_alone(model, optimizer, vocab: int) -> float:
    """Seconds for STEPS_AFTER steps with no save running."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(STEPS_AFTER):
        train_step(model, optimizer, vocab)
    dist.barrier()
    return time.perf_counter() - start


def raw_write(model, optimizer, out: Path, rank: int) -> None:
    """The floor under any sharded save here: each rank torch.save()s the same local tensors
    (weights and moments) to one file and fsyncs it, with no planning or metadata."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=checkpoint.options())
    local = [v.to_local() for v in model_sd.values()]
    local += [v.to_local() for s in optim_sd["state"].values() for v in s.values() if v.dim()]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank{rank}.pt", "wb") as f:
        torch.save(local, f)
        f.flush()
        os.fsync(f.fileno())


def full_save(model, optimizer, out: Path, rank: int) -> None:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model_sd.items()}, out / "model.safetensors")
        flat = {
            f"{name}.{key}": value.contiguous()
            for name, state in optim_sd["state"].items()
            for key, value in state.items()
            if torch.is_tensor(value) and value.dim() > 0
        }
        save_file(flat, out / "optimizer.safetensors")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = AutoConfig.from_pretrained(a.model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    train_step(model, optimizer, config.vocab_size)  # the optimizer's moments now exist
    out = Path(a.out)
    sync = checkpoint.Checkpointer(out / "sync", rank, keep=1, async_save=False)
    background = checkpoint.Checkpointer(out / "async", rank, keep=1, async_save=True)
    vocab = config.vocab_size
    r = {"sharded": [], "full": [], "rawWrite": [], "asyncStall": [], "asyncCall": [],
         "asyncTotal": [], "asyncOverlapCost": [], "stepsAlone": [], "resume": [],
         "checksums": [], "verify": []}  # fmt: skip
    for step in range(1, a.repeats + 1):
        r["sharded"].append(timed(partial(sync.save, model, optimizer, scheduler, step)))
        r["full"].append(timed(partial(full_save, model, optimizer, out / f"full-{step}", rank)))
        r["rawWrite"].append(timed(partial(raw_write, model, optimizer, out / f"raw-{step}", rank)))
        alone = steps_alone(model, optimizer, vocab)
        started = async_save(model, optimizer, scheduler, background, step, vocab)
        r["stepsAlone"].append(alone)
        r["asyncStall"].append(started["stall"])
        r["asyncCall"].append(started["call"])
        r["asyncTotal"].append(started["total"])
        r["asyncOverlapCost"].append(started["call"] + started["steps"] - alone)
        found = checkpoint.latest(out / "sync")
        # What integrity adds: each rank's checksums at commit (part of "sharded" above; its
        # files are still in the page cache) and the verification before a resume.
        mine = integrity.share([p.name for p in found.iterdir()], rank, dist.get_world_size())
        r["checksums"].append(timed(partial(integrity.checksums, found, mine)))
        r["verify"].append(timed(partial(checkpoint.choose, out / "sync", rank, 2)))
        r["resume"].append(timed(partial(sync.load, found, model, optimizer, scheduler)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(out / f"full-{step}", ignore_errors=True)
            shutil.rmtree(out / f"raw-{step}", ignore_errors=True)
    size = sum(f.stat().st_size for f in checkpoint.latest(out / "sync").rglob("*") if f.is_file())
    if rank == 0:
        best = {k: min(v) for k, v in r.items()}
        print("CKPT " + json.dumps({**best, "all": r, "bytes": size, "stepsAfter": STEPS_AFTER}),
              flush=True)  # fmt: skip
    background.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
