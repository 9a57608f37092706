"""One rank's loading, as the trainer does it (build on meta, shard, materialize), timed and
described; bench/loading.py samples its memory from outside while it runs.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/load_worker.py \\
        SPEC.json OUT

Runs whichever ``ftjob`` is first on PYTHONPATH: this tree (every rank reads its own rows) or
the baseline commit's (rank 0 reads, then broadcasts each tensor), through the same calls.
Writes OUT/rank<R>.pid when started and OUT/rank<R>.json when loaded.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def status() -> dict[str, int]:
    """RssAnon and RssFile of this process, bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def held_bytes(net) -> int:
    """What this rank keeps of the model: its local shards (NF4's parts) and buffers."""
    total = 0
    for p in [*net.parameters(), *net.buffers()]:
        local = p.to_local() if hasattr(p, "to_local") else p
        nf4 = ("quantized_data", "quantized_scalers", "quantization_factor")
        parts = [getattr(local, a) for a in nf4 if hasattr(local, a)]
        total += sum(t.nbytes for t in parts) if parts else local.nbytes
    return total


def main(spec_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ftjob.api.jobspec import parse_spec
    from ftjob.trainer.model import load as model
    from ftjob.trainer.model import parallel

    rank = int(os.environ["RANK"])
    pid = Path(out) / f"rank{rank}.pid"
    pid.with_suffix(".tmp").write_text(str(os.getpid()))
    pid.with_suffix(".tmp").rename(pid)  # whole when it appears: the sampler reads it then
    spec = parse_spec(json.loads(Path(spec_file).read_text()))
    d = parallel.init(spec)
    tok = model.load_tokenizer(spec)
    dist.barrier()  # everything imported and the sampler attached: start together
    before, started = status(), time.time()
    built = model.build(spec, tok)  # the trainer's _load, up to the optimizer
    params, trainable = model.count_parameters(built.model)
    # The loading suite measures the sharded layout (auto would replicate these on one node).
    sharding = "full" if spec.parallelism.sharding == "auto" else spec.parallelism.sharding
    shards = parallel.shard_group(spec, d, sharding)
    model.check_shardable(built, shards)
    net, _ = parallel.wrap(built.model, spec, d, sharding, model.left_whole(built, shards))
    largest = max(p.numel() * p.element_size() for p in net.parameters())
    model.materialize(built, d, spec.parallelism.cpu_offload)
    finished = time.time()
    result = {"rank": rank, "before": before, "after": status(), "started": started,
              "finished": finished, "held": held_bytes(net), "largest": largest,
              "readBytes": getattr(built, "read_bytes", None), "params": params,
              "torchThreads": torch.get_num_threads()}  # fmt: skip
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
