"""One optimizer step, with the host never waiting for the device.

Three things used to stall a GPU step and are kept off it here:
* data: each step's micro-batches are read, collated and pinned by a background thread one
  step ahead (:class:`Prefetch`), and copied to the device without blocking;
* numbers: the labelled-token count that weighs the loss comes from collate (host ints), its
  sum over ranks is all-reduced on the device and never read back; the loss stays a device
  tensor, and only log steps turn it into a number (:meth:`Tally.reduce`, one collective);
* gradients: FSDP reduce-scatters every micro-batch, so what accumulates is each rank's shard
  of the gradients (4·N/world bytes), never the whole unsharded gradient; with replicas
  (hybrid, none) only the all-reduce across replicas waits for the last micro-batch.

    python -m pytest tests/e2e/test_accumulation.py -q
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ftjob.trainer import data
from ftjob.trainer.loss import token_loss


class Prefetch:
    """Each step's micro-batches for this rank, collated (and pinned for a GPU) by a thread
    that runs one step ahead: collation overlaps the previous step's compute."""

    def __init__(self, ds: data.Data, sampler: data.Sampler, rank: int, steps: range):
        self._ahead: queue.Queue = queue.Queue(maxsize=1)  # plus the one being built: 2 steps
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(ds, sampler, rank, steps), daemon=True, name="prefetch"
        )
        self._thread.start()

    def _fill(self, ds, sampler, rank, steps) -> None:
        try:
            for step in steps:
                micro = [
                    data.collate(ds.rows(sampler.indices(step, m, rank)), ds.pad_id).pin()
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

    def add(self, loss: torch.Tensor, micro: list[data.Batch], own_seconds: float) -> None:
        self.loss = loss
        self.own_seconds += own_seconds
        self.steps += 1
        for b in micro:
            self.tokens += b.tokens
            self.model_flops += self.flops(b.tokens, b.attention_sq)

    def reduce(
        self, device: torch.device, rank: int, world: int
    ) -> tuple[float, int, float, list[float]]:
        """(step loss, tokens, FLOPs, each rank's mean own step time) over all ranks; the
        counts restart (a sync point)."""
        counts = torch.tensor([self.tokens, self.model_flops], dtype=torch.float64, device=device)
        own = torch.zeros(world, dtype=torch.float64, device=device)
        own[rank] = self.own_seconds / max(self.steps, 1)
        both = torch.cat([self.loss.reshape(1).to(torch.float64), counts, own])
        dist.all_reduce(both)
        loss, tokens, flops, *seconds = both.tolist()
        self.tokens, self.model_flops, self.own_seconds, self.steps = 0, 0.0, 0.0, 0
        return loss, int(tokens), flops, seconds


def train_step(
    net, optimizer, weights, micro: list[data.Batch], device, world: int, replicated: bool,
    max_norm: float, before_update: Callable[[], None],
) -> tuple[torch.Tensor, float]:  # fmt: skip
    """Forward and backward over the micro-batches, then the optimizer update; returns this
    rank's share of the step's mean loss (on the device) and the seconds the host waited for
    the other ranks at the step's first collective (gloo; NCCL does not hold the host)."""
    # Every labelled token of the step weighs the same, whichever rank or micro-batch has it:
    # divide by the global count (FSDP then averages gradients over ranks, hence x world).
    labelled = torch.tensor(float(sum(b.labelled for b in micro)), device=device)
    began = time.perf_counter()
    dist.all_reduce(labelled)  # stays on the device: nothing waits for it
    waited = time.perf_counter() - began
    scale = world / labelled.clamp(min=1.0)
    total = torch.zeros((), device=device)
    for m, batch in enumerate(micro):
        if replicated:
            # Shards accumulate locally; the all-reduce across replicas (across nodes under
            # hybrid) runs once, after the last micro-batch. The reduce-scatter within the
            # shard group still runs every micro-batch: that is what keeps gradients sharded.
            net.set_requires_all_reduce(m == len(micro) - 1)
        loss, _ = token_loss(net, batch, device)
        (loss * scale).backward()
        total += loss.detach()
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(weights, max_norm)
    before_update()  # a background checkpoint may still be copying weights and moments
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total * scale / world, waited
