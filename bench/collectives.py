"""gloo's collectives between CPU processes: the figures behind the planner's CPU time model
(ftjob/api/hardware.py GLOO_BYTES_PER_S, GLOO_COLLECTIVE_SECONDS; docs/planning.md).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.collectives

Times an all-reduce and an all-gather of 4 bytes, 4 KiB, 4 MiB and 64 MiB (fp32), each
repeated and averaged between barriers, and prints one line per size from rank 0. Not a suite
of ``python -m bench``: run it by hand, beside whatever else the machine is running.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def timed(fn, reps: int) -> float:
    """Seconds per call, after one call to warm up."""
    fn()
    dist.barrier()
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    return (time.perf_counter() - began) / reps


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for n in (1, 1024, 2**20, 16 * 2**20):  # fp32 values
        x, out = torch.ones(n), torch.empty(world * n)
        reps = 20 if n > 2**20 else 200
        reduce = timed(lambda: dist.all_reduce(x), reps)  # noqa: B023 - called at once
        gather = timed(lambda: dist.all_gather_single(out, x), reps)  # noqa: B023
        if dist.get_rank() == 0:
            size = 4 * n
            print(f"{size} bytes: all_reduce {reduce * 1e3:.3f} ms ({size / reduce / 1e9:.2f} "
                  f"GB/s), all_gather {gather * 1e3:.3f} ms ({world * size / gather / 1e9:.2f} "
                  "GB/s of output)", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
