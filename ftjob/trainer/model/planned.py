"""The plan, kept by the trainer: before any data is prepared or weight read, each training
process plans its job from the model's own config.json, as ``ftjob plan`` does, and ends a
job the plan says will not fit its memory (spec.plan.enforce) as a permanent failure,
WillNotFit, with the plan's figures and its fits-with advice.

The operator plans at its door only what it can read (hf:// models it knows offline); a model
on the volume is first read here. Every rank computes the same pure verdict from the same
inputs, so all ranks fail alike and no collective is needed to agree.
"""

from __future__ import annotations

import json
from pathlib import Path

from ftjob.api.contract import WILL_NOT_FIT, TrainerError
from ftjob.api.hardware import GPUS
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.job import machine
from ftjob.job.inputs import resolve
from ftjob.plan.describe import not_planned, planned_condition
from ftjob.plan.layout import budget, resolve_context, with_context
from ftjob.plan.modelshape import ModelShape


def model_config(source: str) -> dict | None:
    """The model's config.json (``source`` a local folder by now: sources.fetch pinned an
    hf:// or s3:// one), or None where it cannot be read: loading names that cause itself."""
    try:
        config = json.loads((Path(resolve(source)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def check(spec: FineTuneJobSpec, config: dict | None, machine_bytes: float | None) -> str:
    """The plan's verdict as one log line, or :class:`TrainerError` (WillNotFit) for a job
    the plan says will not fit while spec.plan.enforce is on. ``machine_bytes``: the memory a
    CPU job without resources.memory runs in (this machine's, as ``ftjob plan`` counts it).

    A tight fit and an unenforced misfit run, said as a warning; a spec the trainer cannot run
    at all (CannotRun) is left to the check that names its field (ftjob.plan.limits)."""
    return _said(_planned(spec, config, machine_bytes))


def _planned(spec: FineTuneJobSpec, config: dict | None, machine_bytes: float | None):
    """The plan's condition, None without a config, or the planner's own error: a plan that
    cannot be made must not stop a job the planner has no verdict on (it is said, not raised)."""
    if config is None:
        return None
    try:
        return planned_condition(spec, config, machine_bytes)
    except (ArithmeticError, LookupError, TypeError, ValueError) as e:  # a config it misreads
        return not_planned(f"not checked: the planner failed: {e!r}")


def _said(planned: dict | None) -> str:
    if planned is None:
        return "plan: not checked (the model's config.json could not be read)"
    if planned["reason"] == WILL_NOT_FIT and not planned["allowed"]:
        raise TrainerError(planned["message"], reason=WILL_NOT_FIT, fix=planned["fix"])
    if planned["tight"]:
        return f"warning: the plan's margin is tight (its error could tip it): {planned['message']}"
    if planned["reason"] == WILL_NOT_FIT:
        return f"warning: plan: {planned['message']}"
    return f"plan: {planned['message']}"


def published(planned: dict | None) -> dict:
    """The plan as rank 0's progress serves it (key ``plan``): the verdict and a pod's CPU
    memory by phase, which the operator holds an OOMKilled pod to (ftjob.operator.foreseen)."""
    if planned is None:
        return {"reason": "Unknown", "verdict": "not checked: the model's config.json unread"}
    return {"reason": planned["reason"], "verdict": planned["message"],
            "tight": planned["tight"], "cpuPhaseBytes": planned["cpuPhases"]}  # fmt: skip


def keep(spec: FineTuneJobSpec) -> tuple[str, dict]:
    """:func:`check` of the job as this process runs it (its model's config.json read, and
    this machine's memory for a CPU job without resources.memory), and :func:`published`."""
    planned = _planned(spec, model_config(spec.model.source), machine.memory_bytes())
    return _said(planned), published(planned)


def resolved(spec: FineTuneJobSpec) -> tuple[FineTuneJobSpec, str]:
    """``spec`` with parallelism.contextParallel auto resolved as ``ftjob plan`` resolves it
    (the model's config.json, resources.gpuType's memory, this machine's for a CPU job), and
    the choice in words ("" where it stays 1). Every rank decides alike from the same inputs.
    Without a config.json the split stays 1: nothing says it is needed."""
    if spec.parallelism.context_split() is not None:
        return spec, ""
    config = model_config(spec.model.source)
    if config is None:
        return with_context(spec, 1), ""
    gpu = GPUS.get(spec.resources.gpu_type) if spec.resources.gpu_type else None
    b = budget(spec, gpu.memory_bytes if gpu else None, machine.memory_bytes())
    return resolve_context(spec, ModelShape.from_config(config), b)
