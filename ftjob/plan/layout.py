"""parallelism.sharding: auto, resolved: the fastest layout whose states fit. Pure.

The candidates are ``none`` (every process holds the model whole and trains it as DDP:
nothing is gathered, and only what trains has its gradients all-reduced, overlapping the
backward), ``grad-op`` (sharded, each layer gathered once a micro-batch), ``hybrid``
(sharded within a node, replicated across nodes; only with more than one node) and ``full``.
Each is estimated (:func:`ftjob.plan.estimate.estimate_at`, with activationCheckpointing's
own auto resolved for that layout on GPUs) and timed: its compute on GPUs (FLOPs at the
assumed utilisation; on CPU the same for every layout, so left out) plus its collectives
(:mod:`ftjob.plan.traffic`). The fastest whose memory stays within TIGHT of the budget wins;
ties go to the earlier candidate. Where none fits, the one that needs the least memory.

``ftjob plan`` (through :func:`estimate`, the job's estimate at the layout it resolves to) and
the trainer (trainer/model/parallel.py, with the memory it finds) both ask :func:`choose`.
This module sits above :mod:`ftjob.plan.estimate`, which estimates one given layout.

    python -m ftjob plan examples/tiny.yaml
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ftjob.api.hardware import GPUS
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import quantity
from ftjob.plan.estimate import TIGHT, Estimate, checkpoint_stride, estimate_at, gib
from ftjob.plan.modelshape import ModelShape

CONTEXT_SPLITS = (2, 4, 8, 16, 32, 64)  # contextParallel auto's tries, smallest first
CANDIDATES = ("none", "grad-op", "hybrid", "full")  # ties: the earlier, fewer collectives
# Why a layout is faster, in the words the log and the plan use.
_WHAT = {
    "none": "replicated as DDP (no gathers{base})",
    "grad-op": "each layer gathered once a micro-batch",
    "hybrid": "sharded within a node, replicated across nodes",
    "full": "fully sharded",
}


@dataclass(frozen=True)
class Budget:
    """The memory one process may use: one GPU's, or a CPU job's share of its pod's (or of
    the machine's, for ``ftjob run``); None where nobody knows it."""

    per_process: float | None
    source: str  # where the figure comes from, in words


def budget(
    spec: FineTuneJobSpec, device_bytes: float | None, machine_bytes: float | None = None
) -> Budget:
    """The budget auto fits against: ``device_bytes`` (one GPU) for a GPU job; for a CPU job
    resources.memory shared by a pod's processes, else ``machine_bytes`` (the machine
    ``ftjob run`` runs on) shared by all the job's processes, as ``ftjob run`` starts them all
    there."""
    r = spec.resources
    if r.on_gpu:
        if device_bytes is None:
            return Budget(None, "no GPU memory known (set resources.gpuType)")
        return Budget(device_bytes, f"{gib(device_bytes)} per GPU")
    if r.memory:
        total, n, where = quantity(r.memory), r.nproc_per_node, f"resources.memory {r.memory}"
    elif machine_bytes:
        # `ftjob run` starts every node's processes on this one machine.
        total, n, where = machine_bytes, r.world_size, f"this machine's {gib(machine_bytes)}"
    else:
        return Budget(None, "no memory known (set resources.memory)")
    return Budget(total / n, f"{gib(total / n)} per process ({where} / {n})")


@dataclass(frozen=True)
class Layout:
    """The sharding in force, the activation checkpointing stride that goes with it, and why."""

    sharding: str
    stride: int
    reason: str  # one line: what auto chose and why ("" for an explicit setting)


def candidates(spec: FineTuneJobSpec) -> list[str]:
    """The layouts auto compares for this job: hybrid only across nodes of more than one
    process (with one, its shard group is a process: none under another name), and none not
    with cpuOffload (which offloads shards)."""
    r, p = spec.resources, spec.parallelism
    hybrid = r.nodes > 1 and r.nproc_per_node > 1
    return [
        s for s in CANDIDATES if (s != "hybrid" or hybrid) and (s != "none" or not p.cpu_offload)
    ]


def choose(spec: FineTuneJobSpec, shape: ModelShape, b: Budget) -> Layout:
    """The sharding for this job: the spec's when set; for auto the fastest candidate that
    fits ``b`` within TIGHT, or, where nothing fits, the one that needs the least memory."""
    device = b.per_process if spec.resources.on_gpu else None
    explicit = spec.parallelism.sharding
    if explicit != "auto":
        return Layout(explicit, checkpoint_stride(spec, shape, device, explicit), "")
    timed = [(s, *_timed(spec, shape, device, s)) for s in candidates(spec)]
    s, e, _ = min(timed, key=lambda t: t[1].per_device)  # where nothing fits, or is known
    if b.per_process is None:
        # Nothing to fit against: the layout that needs least, as before auto compared.
        return Layout(s, e.checkpoint_stride, f"sharding auto -> {s}: {b.source}")
    limit = TIGHT * b.per_process
    fitting = [t for t in timed if _fits(t[1], limit)]
    if fitting:
        s, e, seconds = min(fitting, key=lambda t: t[2])
        return Layout(s, e.checkpoint_stride, _reason(spec, s, e, seconds, timed, b))
    held = [t for t in timed if t[1].per_device <= limit and t[1].problem is None]
    if held:
        # The budget holds a layout; what binds is the pods' CPU memory, in every layout: the
        # fastest the budget holds, and the refusal names the pods' limit, not the budget.
        s, e, _ = min(held, key=lambda t: t[2])
        why = (
            f"{gib(e.per_device)}/process fits in {TIGHT:.0%} of {b.source}, but no layout "
            f"fits resources.memory {spec.resources.memory} ({s} needs "
            f"{gib(e.cpu_peak_per_node)} a pod while {e.cpu_peak_phase}); {s} is the fastest"
        )
        return Layout(s, e.checkpoint_stride, f"sharding auto -> {s}: {why}")
    why = (
        f"nothing fits in {TIGHT:.0%} of {b.source}; {s} needs the least "
        f"({gib(e.per_device)}/process)"
    )
    return Layout(s, e.checkpoint_stride, f"sharding auto -> {s}: {why}")


def _timed(
    spec: FineTuneJobSpec, shape: ModelShape, device: float | None, sharding: str
) -> tuple[Estimate, float]:
    """A layout's estimate (its own auto activation checkpointing) and the step time it is
    compared by: compute where a GPU type gives one, plus collectives."""
    stride = checkpoint_stride(spec, shape, device, sharding)
    e = estimate_at(spec, shape, stride, device, sharding)
    return e, e.collective_seconds if e.step_seconds is None else e.step_seconds


def _fits(e: Estimate, limit: float) -> bool:
    """Within ``limit`` per process, and no check the estimate made (the pod's CPU memory,
    a QLoRA shard rule) failing."""
    return e.per_device <= limit and e.fits_pod is not False and e.problem is None


def _reason(spec, chosen: str, e: Estimate, seconds: float, timed, b: Budget) -> str:
    """One line: the chosen layout's memory against the budget, and the next fastest."""
    fits = (
        f"sharding auto -> {chosen}: {gib(e.per_device)}/process fits in {TIGHT:.0%} of {b.source}"
    )
    if spec.resources.world_size == 1:  # no layout to choose between: nothing is shared
        return f"{fits}; one process trains a plain module (no gathers, no all-reduce)"
    base = ", frozen base whole" if spec.method.type != "full" else ""
    what = _WHAT[chosen].format(base=base)
    slower = sorted((t for t in timed if t[0] != chosen), key=lambda t: t[2])
    versus = f" vs {slower[0][0]} {_ms(slower[0][2])}" if slower else ""
    return (
        f"{fits}; {what} is the fastest that fits ({_ms(seconds)} of collectives"
        f"{' and compute' if e.step_seconds else ''} a step{versus})"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def estimate(
    spec: FineTuneJobSpec, shape: ModelShape, machine_bytes: float | None = None
) -> Estimate:
    """The estimate for the GPU resources.gpuType names (none: no device fit, auto
    activation checkpointing every layer), with sharding auto resolved
    (:func:`choose`). ``machine_bytes``: the memory of the machine a CPU
    job without resources.memory runs on (``ftjob run``), which auto fits against."""
    gpu = GPUS.get(spec.resources.gpu_type) if spec.resources.gpu_type else None
    device_bytes = gpu.memory_bytes if gpu else None
    b = budget(spec, device_bytes, machine_bytes)
    spec, split = resolve_context(spec, shape, b)
    chosen = choose(spec, shape, b)
    e = estimate_at(spec, shape, chosen.stride, device_bytes, chosen.sharding)
    e.sharding_reason = chosen.reason
    e.context_reason = split
    return e


def with_context(spec: FineTuneJobSpec, n: int) -> FineTuneJobSpec:
    """``spec`` with parallelism.contextParallel ``n``."""
    return replace(spec, parallelism=replace(spec.parallelism, context_parallel=str(n)))


def context_splits(spec: FineTuneJobSpec, shape: ModelShape) -> list[int]:
    """The contextParallel values above 1 this job could run: each divides the processes of
    a node (a group stays inside one) and the attention heads (each rank attends with
    heads/N); none for an objective other than sft or an attention other than sdpa."""
    if spec.training.objective != "sft" or spec.model.attention != "sdpa":
        return []
    per_node = spec.resources.nproc_per_node
    return [n for n in CONTEXT_SPLITS if per_node % n == 0 and shape.heads % n == 0]


def resolve_context(
    spec: FineTuneJobSpec, shape: ModelShape, b: Budget
) -> tuple[FineTuneJobSpec, str]:
    """parallelism.contextParallel auto resolved, and why in one line ("" where it stays 1 or
    is set): 1 where the job fits without a split (a split only adds all-to-alls), else the
    smallest of :func:`context_splits` whose layout fits ``b`` within TIGHT; where none
    does, 1 (the plan then says what does not fit)."""
    if spec.parallelism.context_split() is not None:
        return spec, ""
    one = with_context(spec, 1)
    if b.per_process is None or fits_budget(one, shape, b):
        return one, ""
    for n in context_splits(spec, shape):
        split = with_context(spec, n)
        if fits_budget(split, shape, b):
            words = f"sequences of {spec.dataset.max_seq_length:,} tokens"
            return split, f"contextParallel auto -> {n}: {words} fit only split over {n} processes"
    return one, ""


def fits_budget(spec: FineTuneJobSpec, shape: ModelShape, b: Budget) -> bool:
    """Whether the layout :func:`choose` takes for ``spec`` fits ``b`` within TIGHT."""
    if b.per_process is None:
        return False
    chosen = choose(spec, shape, b)
    device = b.per_process if spec.resources.on_gpu else None
    e = estimate_at(spec, shape, chosen.stride, device, chosen.sharding)
    return _fits(e, TIGHT * b.per_process)
