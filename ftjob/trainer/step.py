"""One optimizer step, with the host never waiting for the device.

Three things used to stall a GPU step and are kept off it here:
* data: each step's micro-batches are read, collated and pinned by a background thread one
  step ahead (:class:`Prefetch`), and copied to the device without blocking;
* numbers: the labelled-token count that weighs the loss comes from collate (host ints), and
  its sum over ranks (with the preemption vote) is all-reduced in host memory, never on the
  device; the loss stays a device tensor, and only log steps turn it into a number
  (:meth:`Tally.reduce`, one collective); ``tests/e2e/test_host_reads.py`` counts the reads;
* gradients: FSDP reduce-scatters every micro-batch, so what accumulates is each rank's shard
  of the gradients (4·N/world bytes), never the whole unsharded gradient; with replicas
  (hybrid) only the all-reduce across replicas waits for the last micro-batch. DDP (none)
  all-reduces only in the last micro-batch's backward, bucket by bucket as it runs.

    python -m pytest tests/e2e/test_accumulation.py -q
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ftjob.trainer.data import batches as data
from ftjob.trainer.gang import preempt
from ftjob.trainer.model import context, parallel
from ftjob.trainer.objectives.objective import Objective
from ftjob.trainer.state import checkpoint


@dataclass
class Run:
    """The sharded model and what trains it (ftjob.trainer.train's ``_load``): what a step
    reads and changes, and what the log says about the model."""

    net: torch.nn.Module
    weights: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    ckpt: checkpoint.Checkpointer
    params: int
    trainable: int
    sharding: str
    reduce_last: parallel.ReduceLast  # keeps the gradients' reduction to the last micro-batch
    speed: parallel.Speed
    flops: Callable[[int, int], float]
    read_bytes: int  # what this rank read from the weight files
    load_seconds: float  # how long this rank took to read them
    context: context.Group | None = None  # this rank's context-parallel group (None: 1)


class Prefetch:
    """Each step's micro-batches for this rank, collated (and pinned for a GPU) by a thread
    that runs one step ahead: collation overlaps the previous step's compute."""

    def __init__(
        self, ds: data.Data, sampler: data.Sampler, rank: int, steps: range,
        collate: Callable[[list[dict], int], data.Batch] = data.collate,
    ):  # fmt: skip
        self._ahead: queue.Queue = queue.Queue(maxsize=1)  # plus the one being built: 2 steps
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(ds, sampler, rank, steps, collate), daemon=True,
            name="prefetch",
        )  # fmt: skip
        self._thread.start()

    def _fill(self, ds, sampler, rank, steps, collate) -> None:
        try:
            for step in steps:
                micro = [
                    collate(ds.rows(sampler.indices(step, m, rank)), ds.pad_id).pin()
                    for m in range(sampler.accumulation)
                ]
                if not self._put((step, micro)):
                    return
        except BaseException as e:  # noqa: BLE001 - raised again on the training thread
            self._put((None, e))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._ahead.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def next(self, step: int) -> list[data.Batch]:
        got, micro = self._ahead.get()
        if isinstance(micro, BaseException):
            raise micro
        if got != step:
            raise RuntimeError(f"prefetch is at step {got}, training at step {step}")
        return micro

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class Tally:
    """What a step leaves for the log: this rank's loss share (device) and host counts.

    ``reduce`` sums them over ranks in one collective: the step's mean loss over every
    labelled token of the gang, the tokens and model FLOPs of every step since the last log
    (for tokens/s and MFU), and each rank's own mean step time in its own slot (for the
    straggler check: ``world`` more numbers in the same all-reduce)."""

    flops: Callable[[int, int], float]  # (tokens, sum of squared document lengths) -> FLOPs
    loss: torch.Tensor | None = None
    tokens: int = 0
    model_flops: float = 0.0
    own_seconds: float = 0.0  # this rank's step time, the wait for the others left out
    steps: int = 0
    sums: torch.Tensor | None = None  # the objective's metric sums of the last step

    def add(
        self, loss: torch.Tensor, micro: list[data.Batch], own_seconds: float,
        sums: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        self.loss, self.sums = loss, sums
        self.own_seconds += own_seconds
        self.steps += 1
        for b in micro:
            # tokens/s counts the sequences as written; the FLOPs are those run (a shared
            # prompt once).
            self.tokens += b.tokens + b.shared
            self.model_flops += self.flops(b.tokens, b.attention_sq)

    def reduce(
        self, device: torch.device, rank: int, world: int
    ) -> tuple[float, int, float, list[float], list[float]]:
        """(step loss, tokens, FLOPs, each rank's mean own step time, the last step's metric
        sums) over all ranks; the counts restart (a sync point)."""
        counts = torch.tensor([self.tokens, self.model_flops], dtype=torch.float64, device=device)
        own = torch.zeros(world, dtype=torch.float64, device=device)
        own[rank] = self.own_seconds / max(self.steps, 1)
        sums = torch.zeros(0, dtype=torch.float64, device=device)
        if self.sums is not None:
            sums = self.sums.to(torch.float64)
        both = torch.cat([self.loss.reshape(1).to(torch.float64), counts, own, sums])
        dist.all_reduce(both)
        loss, tokens, flops, *rest = both.tolist()
        self.tokens, self.model_flops, self.own_seconds, self.steps = 0, 0.0, 0.0, 0
        return loss, int(tokens), flops, rest[:world], rest[world:]


def train_step(
    run: Run, micro: list[data.Batch], d: parallel.Dist, max_norm: float, objective: Objective,
    vote: preempt.Vote | None = None,
) -> tuple[torch.Tensor, float, torch.Tensor | None]:  # fmt: skip
    """Forward and backward over the micro-batches, then the optimizer update; returns this
    rank's share of the step's mean loss (on the device), the seconds the host waited for
    the other ranks at the step's first collective (on the host, gloo, whatever the device), and
    the objective's metric sums over this rank's micro-batches (None for next-token loss).
    ``vote`` rides on the step's first collective: the gang's agreement to stop for a SIGTERM
    (:mod:`ftjob.trainer.gang.preempt`), at no extra collective.

    ``objective`` (trainer/objectives/objective.py) gives each micro-batch's summed loss and what
    the step's loss is a mean over (labelled tokens, or pairs)."""
    net, device, world = run.net, d.device, d.world_size
    # Every labelled token (or pair) of the step weighs the same, whichever rank or
    # micro-batch has it: divide by the global count (FSDP then averages gradients over
    # ranks, hence x world). The count is a host number from collate, summed over ranks on
    # the host (gloo, also beside NCCL): the device never holds it, so nothing waits to read it.
    counted = np.array([sum(objective.count(b) for b in micro), vote.ballot() if vote else 0.0])
    began = time.perf_counter()
    dist.all_reduce(torch.from_numpy(counted))  # in place: ``counted`` holds the sums
    waited = time.perf_counter() - began
    count, ballots = counted.tolist()
    if vote:
        vote.cast(ballots)
    scale = world / max(count, 1.0)
    total = torch.zeros((), device=device)
    sums = None
    for m, batch in enumerate(micro):
        if run.reduce_last:
            run.reduce_last(m == len(micro) - 1)
        loss, part = objective.loss(net, batch, device)
        (loss * scale).backward()
        total += loss.detach()
        if part is not None:
            sums = part if sums is None else sums + part
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(run.weights, max_norm)
    run.ckpt.before_update()  # a background checkpoint may still be copying weights and moments
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total * scale / world, waited, sums
