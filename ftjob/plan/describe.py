"""The plan in words: the lines ``ftjob plan`` prints, the one-line verdict (fits, will not
fit, not checked, cannot run), and the ``Planned`` condition the operator records from it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ftjob.api.hardware import GIB, GPUS, node_bandwidth
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.plan import datasize, limits, quota
from ftjob.plan.estimate import (
    PHASES,
    TIGHT,
    Estimate,
    gib,
    phase_why,
    reference_pass,
    stride_name,
)
from ftjob.plan.layout import estimate
from ftjob.plan.modelshape import ModelShape, shape_for
from ftjob.plan.options import Plan, plan
from ftjob.plan.saving import grace_period


def _source_root() -> Path | None:
    root = os.environ.get("FTJOB_SOURCE_ROOT")  # relative sources, as the trainer resolves them
    return Path(root) if root else None


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = seconds / 60
    if minutes < 120:
        return f"{minutes:.0f} min"
    return f"{minutes / 60:.1f} h"


def describe(spec: FineTuneJobSpec, result: Plan, source_root: Path | None = None) -> list[str]:
    """The plan as lines a person reads top to bottom; relative data sources are looked up
    under ``source_root`` (the job file's folder)."""
    e, s, r = result.estimate, result.shape, spec.resources
    device = r.gpu_type or ("GPU (gpuType unset)" if r.on_gpu else "CPU process")
    rows = [
        (
            "model",
            f"{s.name}: {_count(s.params)} parameters, {s.layers} layers, hidden "
            f"{s.hidden}; trainable {_count(e.trainable)} ({spec.method.type})",
        ),
        (
            "shape",
            f"{r.nodes} node(s) x {r.nproc_per_node} x {device}"
            + (", one pod per node (required pod anti-affinity), " if r.nodes > 1 else ", ")
            + ", ".join(e.notes)
            + f", {spec.compute_precision()}, "
            + checkpointing_text(spec, e),
        ),
        ("sharding", _sharding_text(spec, e)),
        *_context_rows(spec, e),
        (
            "per GPU" if r.on_gpu else "per process",
            f"weights {gib(e.weights)}"
            + (f" + reference {gib(e.reference)}" if e.reference else "")
            + f" + gradients {gib(e.gradients)} + optimizer "
            f"{gib(e.optimizer)} + activations {gib(e.activations)} + temporaries "
            f"{gib(e.temporaries)} + reserved {gib(e.reserved)} = {gib(e.per_device)}"
            + (f" of {gib(e.device_bytes)}" if e.device_bytes else "")
            # 0 bytes of weights, gradients and optimizer are not a mistake: say where they are.
            + (
                "; weights, gradients and optimizer states live in CPU memory (cpuOffload)"
                if spec.parallelism.cpu_offload and r.on_gpu
                else ""
            ),
        ),
        ("CPU memory", _cpu_text(spec, e)),
        (
            "checkpoint",
            f"{gib(e.checkpoint_bytes)} each on the volume "
            f"(x keep {spec.checkpoint.keep} = {gib(e.checkpoint_bytes * spec.checkpoint.keep)})",
        ),
        ("grace", grace_text(spec, e)),
        ("data", datasize.describe(spec, source_root or _source_root())),
        ("quota", quota.text(spec)),
    ]
    if spec.training.objective == "dpo":
        rows.append(("reference", _reference_text(spec, s, e)))
    grpo = spec.training.grpo_settings()
    if grpo is not None and grpo.beta:
        rows.append(("reference", _kl_reference_text(spec, e)))
    tokens = result.spec.tokens_per_step  # contextParallel auto resolved
    if e.step_seconds is not None:
        total, steps = "", spec.training.max_steps
        if steps:
            total = f", {steps} steps ~ {_duration(e.step_seconds * steps)}"
        text = _throughput_text(e, tokens, ddp=limits.ddp(spec, e.sharding))
        rows.append(("throughput", text + total + _assumed_peak(r.gpu_type)))
    elif r.on_gpu:
        rows.append(("throughput", f"{tokens:,} tokens/step (set resources.gpuType for time)"))
    else:
        rows.append(("throughput", f"{tokens:,} tokens/step (no time estimate on CPU)"))
    if r.nodes > 1:
        bw = node_bandwidth(spec.network.fabric, r.gpus_per_node, spec.network.efa_devices_per_node)
        rows.append(
            (
                "network",
                f"{gib(e.network_bytes_per_node)} per node per step over "
                f"{spec.network.fabric} ({bw / 1e9:.0f} GB/s): {_duration(e.network_seconds)} "
                "of the step's collectives",
            )
        )
    rows.append(("verdict", verdict_text(result)))
    unit = "GPU" if r.on_gpu else "process"
    for option in result.options:
        step = option.estimate.step_seconds
        rows.append(
            (
                "  fits with",
                f"{option.change}: {gib(option.estimate.per_device)} per {unit}"
                + (" (tight)" if _tight(option.estimate) else "")
                + (f", ~{_duration(step)}/step" if step else "")
                + _more_cpu(e, option.estimate),
            )
        )
    width = max(len(label) for label, _ in rows) + 2
    return [f"{label:<{width}}{text}" for label, text in rows]


def _throughput_text(e: Estimate, tokens: int, ddp: bool) -> str:
    """The step time, the one every line quotes, and what it is made of."""
    parts = f"compute {_duration(e.compute_seconds)} at {e.hardware_utilisation:.0%} of peak"
    if e.collective_seconds and ddp:
        parts += f" + collectives {_duration(e.collective_seconds)} (what DDP's all-reduce "
        parts += "does not overlap with the backward)"
    elif e.collective_seconds:
        parts += f" + collectives {_duration(e.collective_seconds)}, not overlapped"
    if e.generation_seconds:
        parts += f" + sampling {_duration(e.generation_seconds)} (GRPO, assumed ~3% of peak)"
    return f"{tokens:,} tokens/step, ~{_duration(e.step_seconds)}/step ({parts}): {e.mfu:.0%} MFU"


def _assumed_peak(gpu_type: str | None) -> str:
    """Where the step time rests on a peak the gpuType does not fix (H100-80GB), say so."""
    gpu = GPUS.get(gpu_type) if gpu_type else None
    if gpu is None or not gpu.peak_assumed:
        return ""
    return (
        f"; peak assumed {gpu.peak_bf16_flops / 1e12:.0f} TFLOP/s ({gpu.name} names no board: "
        "the slowest's; the trainer's MFU uses the device's own name)"
    )


def _reference_text(spec: FineTuneJobSpec, s: ModelShape, e: Estimate) -> str:
    """The DPO reference row: what the reference costs for this method."""
    if spec.method.type != "full":
        return (
            "the same network with its adapters off: one more forward per micro-batch "
            f"(+{e.reference_flops_per_token / e.flops_per_token:.0%} of the step's model "
            "FLOPs, counted in the step time), no extra weights, no kept activations"
        )
    stored, seconds = reference_pass(spec, s)
    when = f", ~{_duration(seconds)} per 1,000 pairs" if seconds is not None else ""
    return (
        "the initial model's log-probabilities, one forward over every pair before training"
        f"{when}; stored on the volume beside the prepared data, {stored:.0f} bytes a pair "
        f"({gib(stored * 1e6)} per million pairs), reused by restarts"
    )


def _kl_reference_text(spec: FineTuneJobSpec, e: Estimate) -> str:
    """GRPO's reference row (beta > 0): what the KL term's reference costs for this method."""
    forward = "one forward per micro-batch of each generation batch (counted in the step time)"
    if spec.method.type != "full":
        return f"the same network with its adapters off: {forward}, no extra weights"
    unit = "GPU" if spec.resources.on_gpu else "process"
    where = (
        "in CPU memory (cpuOffload)"
        if spec.parallelism.cpu_offload
        else f"{gib(e.reference)} per {unit}"
    )
    return (
        f"a frozen copy of the starting model in {spec.compute_precision()}, laid out as the "
        f"policy ({where}, counted above); {forward}; never checkpointed: a resume reads it "
        "again from model.source"
    )


def _cpu_text(spec: FineTuneJobSpec, e: Estimate) -> str:
    """The pods' CPU memory: the peak, the phase that sets it, and every phase's figure."""
    phases = ", ".join(f"{phase} {gib(e.cpu_phases[phase])}" for phase in PHASES)
    return (
        f"{gib(e.cpu_peak_per_node)} per pod at most, while {e.cpu_peak_phase} "
        f"({phase_why(spec, e.cpu_peak_phase)}): {phases}"
        + (f"; of {gib(e.pod_memory)} (resources.memory)" if e.pod_memory else "")
        + f"; page cache: {gib(e.page_cache_per_node)} of weight files read through it, "
        "charged to the pod but reclaimable, not counted"
    )


def _tight(e: Estimate) -> bool:
    """Above TIGHT of a GPU's memory: the estimate's error could tip it."""
    return bool(e.device_bytes) and e.per_device > TIGHT * e.device_bytes


def _more_cpu(base: Estimate, option: Estimate) -> str:
    """The CPU memory a change needs, where it needs more than the job (cpuOffload)."""
    if option.cpu_peak_per_node <= base.cpu_peak_per_node:
        return ""
    return f", {gib(option.cpu_peak_per_node)} CPU memory per pod"


def _context_rows(spec: FineTuneJobSpec, e: Estimate) -> list[tuple[str, str]]:
    """contextParallel in force, where it splits: the tokens each process holds and the
    all-to-alls that buys (none for a job at 1: its plan reads as before)."""
    n = e.context_parallel
    if n == 1:
        return []
    chosen = e.context_reason or f"{n} (parallelism.contextParallel)"
    length = -(-spec.dataset.max_seq_length // n)
    return [
        (
            "context parallel",
            f"{chosen}; each process holds {length:,} tokens of each sequence (Ulysses "
            f"all-to-all over heads); +{gib(e.context_layer_bytes)} sent per process per layer "
            f"each way (forward, backward; again where recomputed), inside a node: "
            f"{_duration(e.context_seconds)} a step",
        )
    ]


def _sharding_text(spec: FineTuneJobSpec, e: Estimate) -> str:
    """What parallelism.sharding means here: auto's choice and why, or the setting obeyed."""
    if e.sharding_reason:
        return e.sharding_reason.removeprefix("sharding ")
    return (
        f"{e.sharding} (parallelism.sharding; collectives {_duration(e.collective_seconds)} a step)"
    )


def pod_grace(spec: FineTuneJobSpec, e: Estimate) -> tuple[int, str]:
    """The terminationGracePeriodSeconds the pods get (as ftjob.operator.render sets it) and why."""
    return grace_period(
        e.checkpoint_bytes, spec.resources.nodes, spec.checkpoint.grace_period_seconds
    )


def grace_text(spec: FineTuneJobSpec, e: Estimate) -> str:
    """The pods' grace period, why, and what a SIGTERM does with it."""
    seconds, why = pod_grace(spec, e)
    return (
        f"terminationGracePeriodSeconds {seconds} ({why}): a SIGTERM in training saves at the "
        "next step; before the first step or after the last save the pod ends in seconds"
    )


def checkpointing_text(spec: FineTuneJobSpec, e: Estimate) -> str:
    """What activation checkpointing does here, and what auto chose."""
    chosen = stride_name(e.checkpoint_stride)
    if spec.training.activation_checkpointing != "auto":
        return f"activation checkpointing {chosen}"
    if not e.device_bytes:
        why = "no GPU memory to fit against"
    elif e.checkpoint_stride == 1:
        why = "nothing faster fits"
    else:
        why = "the fastest that fits"
    return f"activation checkpointing auto: {chosen} ({why})"


def verdict_text(result: Plan) -> str:
    """The plan's verdict in one line: FITS, WILL NOT FIT (and what would), not checked (and
    what to set), or CANNOT RUN (what the trainer would refuse)."""
    e = result.estimate
    if e.problem:
        return f"CANNOT RUN: {e.problem}"
    found = []
    if e.fits_device is not None:
        share = e.per_device / e.device_bytes
        found.append(f"{gib(e.per_device)} of {gib(e.device_bytes)} per GPU ({share:.0%})")
    if e.fits_pod is not None:
        phase = e.cpu_peak_phase
        found.append(
            f"{gib(e.cpu_peak_per_node)} of {gib(e.pod_memory)} CPU memory per pod (peak "
            f"while {phase}: {phase_why(result.spec, phase)})"
        )
    if e.fits is None:
        if not result.on_gpus:  # gpuType is for GPU jobs only (a CRD rule)
            return "not checked: set resources.memory to check the CPU memory"
        if e.fits_device is None:
            return "not checked: set resources.gpuType (and resources.memory) to check the fit"
        # The GPUs fit, but the pods' CPU memory (offloaded states, loading) was not checked.
        return (
            f"GPU memory fits: {found[0]}; CPU MEMORY NOT CHECKED: a pod needs up to "
            f"{gib(e.cpu_peak_per_node)}; set resources.memory to check it"
        )
    if e.fits:
        return ("FITS (tight)" if _tight(e) else "FITS") + ": " + ", ".join(found)
    options = "; ".join(o.change.split(" (")[0] for o in result.options) or "no single change"
    return "WILL NOT FIT: " + ", ".join(found) + f"; fits with: {options}"


def fits_with(result: Plan) -> str | None:
    """The plan's "fits with" advice as the fix of a job refused for it: the changes that fit,
    or None where no single change does (``ftjob plan`` then says what would not suffice)."""
    changes = [o.change.split(" (")[0] for o in result.options]
    if not changes:
        return None
    said = changes[0] if len(changes) == 1 else "one of: " + " | ".join(changes)
    return f"set {said} (what the plan says fits)"


def planned_condition(
    spec: FineTuneJobSpec, config: dict | None = None, machine_bytes: float | None = None
) -> dict:
    """The ``Planned`` condition the operator records before it creates any pod: its reason,
    message (the verdict) and whether the job may start. Not admission: the API server admits
    a job (:mod:`ftjob.api.admission`) before the operator ever plans it. Every door asks this
    one function: the operator, validate, and each training process before it loads anything.

    ``config`` is the model's config.json when the caller can read it; hf:// sources of
    well-known models are planned from the table. ``machine_bytes``: the memory a CPU job
    without resources.memory runs in (``ftjob run``: this machine's, as ``ftjob plan`` counts).
    ``allowed`` is False only when the job will not fit and ``spec.plan.enforce`` is on;
    ``fix`` is the plan's fits-with advice (None where nothing fits or it fits), ``tight``
    whether a fit is within the estimate's error, ``cpuPhases`` a pod's CPU memory by phase
    (estimate.PHASES, bytes; empty where not planned).
    """
    try:
        shape = shape_for(spec.model.source, config)
    except ValueError as e:
        return below_any_model(spec) or not_planned(f"not planned: {e}")
    return condition_of(spec, shape, machine_bytes)


def not_planned(message: str) -> dict:
    """The condition of a job the plan cannot tell about: it may start."""
    return {"reason": "Unknown", "message": message, "allowed": True, "fix": None,
            "tight": False, "cpuPhases": {}}  # fmt: skip


def _will_not_fit(spec: FineTuneJobSpec, message: str, fix: str | None, phases: dict) -> dict:
    """The WillNotFit condition: refused unless spec.plan.enforce is false (then said)."""
    enforce = spec.plan.enforce
    tail = "" if enforce else " (spec.plan.enforce is false: starting anyway)"
    return {"reason": "WillNotFit", "message": message + tail, "allowed": not enforce,
            "fix": fix, "tight": False, "cpuPhases": phases}  # fmt: skip


# A model smaller than any that is trained: what a pod needs with it is what it needs whatever
# the model (the processes, rank 0's data preparation: the plan's model-independent parts).
SMALLEST = ModelShape("any model", hidden=8, layers=1, heads=1, kv_heads=1, intermediate=8, vocab=8)


def below_any_model(spec: FineTuneJobSpec) -> dict | None:
    """The WillNotFit condition of a job whose resources.memory is below what a pod needs
    whatever its model (the model's shape unknown: a folder on the volume), else None.

    A pod that small can be OOMKilled before its trainer has read the model's config.json
    (seen on real nodes: examples/tiny.yaml at 300Mi, three gangs OOMKilled, no plan check
    reached), so the door refuses it, and can: the least of every model is a floor."""
    e = estimate(spec, SMALLEST)
    if e.fits_pod is not False:
        return None
    phase, need = e.cpu_peak_phase, math.ceil(e.cpu_peak_per_node / GIB)
    message = (
        f"WILL NOT FIT whatever the model: at least {gib(e.cpu_peak_per_node)} of "
        f"{gib(e.pod_memory)} CPU memory per pod (peak while {phase}: {phase_why(spec, phase)}), "
        f"before the model's own share; fits with: resources.memory: {need}Gi at least"
    )
    fix = f"set resources.memory: {need}Gi or more (`ftjob plan` with the model gives the figure)"
    return _will_not_fit(spec, message, fix, {})


def condition_of(spec: FineTuneJobSpec, shape: ModelShape, machine_bytes: float | None) -> dict:
    """:func:`planned_condition` of a model whose shape is known (validate reads it itself)."""
    result = plan(spec, shape, machine_bytes=machine_bytes)
    # The pods' CPU memory by phase: what an OOMKilled pod is held to (ftjob.operator.foreseen).
    phases = {phase: round(b) for phase, b in result.estimate.cpu_phases.items()}
    said = {"message": verdict_text(result), "fix": None, "tight": False, "cpuPhases": phases}
    if result.estimate.problem:  # the trainer would refuse it: no enforce can let it through
        return {"reason": "CannotRun", **said, "allowed": False}
    if result.fits is None:
        return {"reason": "Unknown", **said, "allowed": True}
    if result.fits:
        return {"reason": "Fits", **said, "allowed": True, "tight": _tight(result.estimate)}
    return _will_not_fit(spec, said["message"], fits_with(result), phases)
