"""Worker of tests/gpu/test_trainer_cuda.py: two ranks on cuda:0, joined by NCCL.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/gpu/two_ranks_one_gpu.py --result DIR

Each rank writes DIR/rank<N>.json: ``{"refused": NCCL's message}`` when NCCL will not put two
ranks of one communicator on one device (then it exits 3, so that torchrun stops the other
rank instead of leaving it waiting), else rank 0 writes the per-step losses of the trainer's
own build / shard / materialize on the tiny model, trained on one fixed batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # ftjob from this checkout, as the test that starts this runs it
STEPS = 10


def spec():
    from ftjob.api.jobspec import parse_spec

    return parse_spec({
        "model": {"source": str(ROOT / "examples" / "tiny-model")},
        "dataset": {"source": "unused.jsonl", "format": "text", "maxSeqLength": 64},
        "method": {"type": "full"},
        "training": {"maxSteps": STEPS},
        "resources": {"nodes": 1, "gpusPerNode": 2},
        "parallelism": {"sharding": "full"},
    })  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--result", type=Path, required=True)
    out = p.parse_args().result
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", 0)  # both ranks: what this test is about
    torch.cuda.set_device(device)
    try:
        # device_id makes NCCL build its communicator now, where a refusal is raised.
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device)
        dist.all_reduce(torch.ones(1, device=device))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - NCCL's refusal, whatever its type, is the result
        (out / f"rank{rank}.json").write_text(json.dumps({"refused": str(e).strip()[:500]}))
        return 3

    from ftjob.trainer.model import load as model
    from ftjob.trainer.model import parallel

    s = spec()
    d = parallel.Dist(rank, rank, world, world, device)
    built = model.build(s, model.load_tokenizer(s))
    mesh = parallel.mesh(s, d, "full")
    net = parallel.shard(built.model, s, mesh, "full")
    model.materialize(built, d)
    net.train()
    optimizer = torch.optim.AdamW([w for w in net.parameters() if w.requires_grad], lr=1e-2)
    torch.manual_seed(0)  # the same batch on both ranks: their losses must agree
    ids = torch.randint(3, net.config.vocab_size, (2, 64), device=device)
    losses = []
    for _ in range(STEPS):
        loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    mine = torch.stack(losses).float()
    both = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(both, mine)
    if rank == 0:
        result = {"losses": mine.tolist(), "ranksAgree": bool(torch.equal(both[0], both[1])),
                  "peakGpuMiB": round(torch.cuda.max_memory_allocated(device) / 2**20)}  # fmt: skip
        (out / "rank0.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
