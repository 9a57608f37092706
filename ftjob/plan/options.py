"""What would fit instead: when a job's estimate does not fit, the cheapest single changes
(and stacks of them) that would, each a job the API server accepts.

:func:`plan` is the estimate with those options; :mod:`ftjob.plan.describe` puts it in words.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ftjob.api.hardware import GIB, GPUS
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import check_rules
from ftjob.plan.estimate import (
    Estimate,
    checkpoint_stride,
    estimate_at,
    stride_name,
    stride_of,
)
from ftjob.plan.layout import context_splits, estimate, with_context
from ftjob.plan.modelshape import ModelShape


@dataclass
class Option:
    """One change that fits: its label, the changed spec and that spec's estimate."""

    change: str
    spec: FineTuneJobSpec
    estimate: Estimate


@dataclass
class Plan:
    """A job's estimate and, when it does not fit, the options that would."""

    spec: FineTuneJobSpec
    shape: ModelShape
    estimate: Estimate
    options: list[Option]
    on_gpus: bool = True  # what the advice may name: gpuType only for a GPU job

    @property
    def fits(self) -> bool | None:
        return self.estimate.fits


def _with(spec: FineTuneJobSpec, **changes) -> FineTuneJobSpec:
    """A copy of spec with dotted-path changes, e.g. training__micro_batch_size=1."""
    groups: dict[str, dict] = {}
    for key, value in changes.items():
        part, name = key.split("__")
        groups.setdefault(part, {})[name] = value
    replaced = {k: dataclasses.replace(getattr(spec, k), **v) for k, v in groups.items()}
    return dataclasses.replace(spec, **replaced)


def _candidates(
    spec: FineTuneJobSpec, shape: ModelShape, base: Estimate, machine_bytes: float | None = None
):
    """Single changes that lower memory (or raise the pods' where theirs binds), cheapest
    first (what each costs the user); ``base``: the job's own estimate."""
    t, r, p, m = spec.training, spec.resources, spec.parallelism, spec.method
    sharding = base.sharding
    if base.fits_pod is False:
        # The smallest whole GiB that holds the pods' peak: no speed lost, if the nodes have it.
        need = math.ceil(base.cpu_peak_per_node / GIB)
        yield (
            f"resources.memory: {need}Gi (the pods' peak, while {base.cpu_peak_phase})",
            {"resources__memory": f"{need}Gi"},
        )
    if t.activation_checkpointing not in ("auto", "all"):
        # What auto would pick here: the fewest recomputed layers that fit (else all). auto
        # itself already recomputes as much as it takes, so it gets no such advice.
        gpu = GPUS.get(r.gpu_type) if r.gpu_type else None
        auto = _with(spec, training__activation_checkpointing="auto")
        device = gpu.memory_bytes if gpu else None
        stride = checkpoint_stride(auto, shape, device, sharding)
        if stride != stride_of(t.activation_checkpointing):
            e = estimate_at(auto, shape, stride, device, sharding)
            more = e.recomputed_flops_per_token / e.flops_per_token
            yield (
                f"activationCheckpointing: {stride_name(stride)} (~{more:.0%} more compute)",
                {"training__activation_checkpointing": stride_name(stride)},
            )
    if t.micro_batch_size > 1:
        mb = max(1, t.micro_batch_size // 2)
        ga = spec.accumulation * t.micro_batch_size // mb
        yield (
            f"microBatchSize: {mb}, gradientAccumulation: {ga} (same global batch)",
            {
                "training__micro_batch_size": mb,
                "training__gradient_accumulation": ga,
            },
        )
    split = _context_split(spec, shape, base, machine_bytes)
    if split:
        yield (
            f"parallelism.contextParallel: {split} (each sequence split over {split} "
            "processes of a node: all-to-alls in every layer)",
            {"parallelism__context_parallel": str(split)},
        )
    if p.sharding not in ("full", "auto") or (p.sharding == "auto" and r.nodes > 1):
        yield "sharding: full (more traffic between nodes)", {"parallelism__sharding": "full"}
    volume = "" if spec.checkpoint.volume else "; needs a shared checkpoint.volume"
    for factor in (2, 4):
        if r.on_gpu:
            n = r.nodes * factor
            yield f"nodes: {n} (more GPUs{volume})", {"resources__nodes": n}
    if m.type == "full":
        yield "method: lora (train adapters only)", {"method__type": "lora"}
    if m.type in ("full", "lora"):
        yield (
            "method: qlora with nf4 (4-bit base)",
            {"method__type": "qlora", "method__lora": m.lora},
        )
    if not p.cpu_offload and p.sharding != "none":
        yield "cpuOffload: true (roughly halves throughput)", {"parallelism__cpu_offload": True}
    if r.gpu_type:
        # Only exact products are suggested: an assumed peak would make a guessed step time.
        bigger = [
            g
            for g in GPUS.values()
            if g.memory_bytes > GPUS[r.gpu_type].memory_bytes and not g.peak_assumed
        ]
        for gpu in sorted(bigger, key=lambda g: g.memory_bytes)[:2]:
            yield f"gpuType: {gpu.name} (GPUs with more memory)", {"resources__gpu_type": gpu.name}


def _context_split(
    spec: FineTuneJobSpec, shape: ModelShape, base: Estimate, machine_bytes: float | None
) -> int | None:
    """For a job at contextParallel 1: the smallest split that fits on its own, else the
    largest (to stack with other changes); None where none can run (auto tried them all)."""
    if spec.parallelism.context_parallel != "1":
        return None
    splits = context_splits(spec, shape)
    for n in splits:
        if option_fits(base, estimate(with_context(spec, n), shape, machine_bytes)):
            return n
    return splits[-1] if splits else None


def option_fits(base: Estimate, option: Estimate) -> bool:
    """Whether a suggested change fits by the job's own standard: no check fails, the GPUs
    were checked, and the pods' CPU memory was checked against resources.memory, or, where
    that is not set, the change asks no more CPU memory than the job already needs (so
    cpuOffload, which moves the states to CPU memory, is never offered unchecked)."""
    if option.problem or option.fits_device is False or option.fits_pod is False:
        return False
    if option.on_gpu and not option.fits_device:
        return False
    if option.fits_pod is None:
        return option.cpu_peak_per_node <= base.cpu_peak_per_node
    return True


def plan(
    spec: FineTuneJobSpec,
    shape: ModelShape,
    max_options: int = 3,
    machine_bytes: float | None = None,
) -> Plan:
    """The estimate and, if it does not fit, up to ``max_options`` changes that would;
    ``machine_bytes``: the memory a CPU job without resources.memory runs in (``ftjob run``)."""
    base = estimate(spec, shape, machine_bytes)
    if spec.parallelism.context_parallel == "auto":  # what the trainer will run
        spec = with_context(spec, base.context_parallel)
    options: list[Option] = []
    if base.fits is False:
        cumulative: dict = {}
        labels: list[str] = []
        stacked_fits = False
        for label, change in _candidates(spec, shape, base, machine_bytes):
            single = _with(spec, **change)
            if check_rules(single, "spec"):
                continue  # advice must be a job the API server accepts
            est = estimate(single, shape, machine_bytes)
            if option_fits(base, est):
                options.append(Option(label, single, est))
            elif (
                "nodes" not in label and not stacked_fits and not cumulative.keys() & change.keys()
            ):
                # Changes stack: activation checkpointing and a smaller micro-batch together.
                # A change of a field already changed (a second gpuType, qlora after lora)
                # replaces rather than adds, so it is not stacked: the label would lie. Once
                # a stack fits, more changes on top of it are not advice.
                cumulative.update(change)
                labels.append(label.split(" (")[0])
                stacked = _with(spec, **cumulative)
                est = estimate(stacked, shape, machine_bytes)
                if option_fits(base, est) and len(labels) > 1 and not check_rules(stacked, "spec"):
                    options.append(Option(" + ".join(labels), stacked, est))
                    stacked_fits = True
            if len(options) >= max_options:
                break
    return Plan(
        spec=spec,
        shape=shape,
        estimate=base,
        options=options,
        on_gpus=spec.resources.on_gpu,
    )
