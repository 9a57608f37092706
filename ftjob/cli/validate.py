"""A FineTuneJob document checked: ftjob's own checks and the API server's, offline.

Both must agree: ``spec.py`` raises readable errors for people, the generated CRD (schema +
CEL, through :mod:`ftjob.api.admission`) is what a cluster enforces at ``kubectl apply``.

A job is accepted only if every child the operator would create for it is valid too: the
operator's own check (:func:`ftjob.operator.admit.parse_job`) renders the children, holds them to
the API server's rules and traces each refusal back to the FineTuneJob field at fault.

Where the model's shape is known (its config.json beside the job file, or an hf:// model in
:data:`ftjob.plan.modelshape.KNOWN_MODELS`), the job is also held to what the trainer would refuse
on that model (:mod:`ftjob.plan.limits`, through the plan's estimate): validate, plan and the
trainer give one answer; the operator's Planned condition applies it where the model is in that
table (it reads no volume).

Local inputs (:func:`ftjob.job.inputs.missing`, the check ``ftjob run`` makes before it starts
anything): both commands check a job for a cluster, where a relative or absolute path names
the checkpoint volume, not this machine: a path not found here is a note saying the model's
shape (or the data) was not checked, not an error. Only ``ftjob plan``'s model is needed
here (``local=True``): its estimate is made from the model's config.json, so a missing model
folder refuses the job; the data only sizes one row of the plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from ftjob.api import admission, crd
from ftjob.api.jobspec import (
    DEFAULT_IMAGE,
    FineTuneJobSpec,
    ineffective,
    parse_resource,
    validate_update,
)
from ftjob.api.profile import Profile, apply
from ftjob.api.schema import FieldError, SpecError
from ftjob.api.source import S3, Local, parse
from ftjob.job import inputs
from ftjob.operator import render  # pure: no kopf or kubernetes needed
from ftjob.operator.admit import parse_job
from ftjob.plan.describe import below_any_model, condition_of
from ftjob.plan.layout import estimate
from ftjob.plan.modelshape import ModelShape, shape_for


@cache
def crd_schema() -> dict:
    return crd.schema()


@dataclass
class CheckedJob:
    """A job document as :func:`check` found it: its spec if valid, else why not."""

    name: str | None
    spec: FineTuneJobSpec | None = None
    errors: list[str] = field(default_factory=list)  # ftjob's messages
    server_errors: list[str] = field(default_factory=list)  # the API server's messages
    notes: list[str] = field(default_factory=list)  # what could not be checked here, and why
    warnings: list[str] = field(default_factory=list)  # valid, but likely not what was meant
    shape: ModelShape | None = None  # the model's, where it could be read
    profile: dict | None = None  # the profile applied: {name, generation}

    @property
    def ok(self) -> bool:
        return not self.errors and not self.server_errors


def check(
    doc: dict[str, Any],
    old: dict[str, Any] | None = None,
    job_file: str | None = None,
    local: bool = False,
    profile: Profile | None = None,
) -> CheckedJob:
    """Check ``doc`` (as an update of ``old`` when given) both ways, and on its model.

    ``job_file``: where relative model and data sources are looked up. ``local``: the model
    must be there (plan reads its shape); any other missing input is only a note.
    ``profile``: merged under the job first (:func:`with_profile`), its limits checked too.
    """
    name = (doc.get("metadata") or {}).get("name")
    checked = CheckedJob(name=name if isinstance(name, str) else None)
    doc, refused, checked.profile = with_profile(doc, profile)
    try:
        _, checked.spec = parse_job(doc, strict=True)
        if old is not None:
            _, old_spec = parse_resource(old)
            validate_update(old_spec, checked.spec)
        # Relative sources are read beside the job file; without one, only absolute ones.
        root = Path(job_file).parent if job_file else None
        missing = inputs.missing(checked.spec, root, None) if root else []
        needed = [m for m in missing if local and m.path == "spec.model.source"]
        if needed:
            raise SpecError(needed)
        checked.notes = [
            f"not checked: {m.path}: {m.message} on this machine (a cluster reads the path "
            "from the checkpoint volume)"
            for m in missing
        ]
        checked.warnings = ineffective(checked.spec, doc.get("spec") or {}) + warnings(checked.spec)
        checked.shape = _model_shape(checked.spec, root)
        if checked.shape is not None:
            problem = estimate(checked.spec, checked.shape).problem
            if problem:
                raise SpecError([problem])
    except SpecError as e:
        checked.errors = [str(err) for err in e.errors]
        checked.spec = None
    except ValueError as e:  # a config.json without the fields a decoder has
        checked.errors = [f"spec.model.source: {e}"]
        checked.spec = None
    if refused:  # the profile's limits (the job's own errors first)
        checked.errors += [str(x) for x in refused]
        checked.spec = None
    _, checked.server_errors = admission.admit(crd_schema(), doc, old)
    return checked


# Where validate cannot read the model's shape (a path not on this machine, an s3:// source, an
# hf:// model not in the table), the trainer still plans the job before it loads anything.
MEMORY_UNCHECKED = (
    "not checked: memory: the model's config.json cannot be read here (the trainer plans the "
    "job from it before loading anything, and refuses one that will not fit)"
)


def memory_verdict(checked: CheckedJob, strict: bool = False) -> None:
    """The plan's memory verdict on a valid job, as each trainer will apply it, said where
    validate says things: a job that will not fit (or fits tightly) is warned of, an error
    with ``strict`` where spec.plan.enforce would refuse it; one the plan cannot tell about
    gets one note (not a CPU job without resources.memory: what ``ftjob run`` runs here). A
    job that fits adds nothing. ``ftjob plan`` shows the figures."""
    if not checked.ok:
        return
    if checked.shape is None:  # a limit below any model's is still refused (the floor)
        planned = below_any_model(checked.spec)
        if planned is None:
            checked.notes.append(MEMORY_UNCHECKED)
            return
    else:  # no machine's memory: a cluster's job; it changes a CPU job's layout, not a verdict
        planned = condition_of(checked.spec, checked.shape, None)
    if planned["reason"] == "Unknown" and not checked.spec.resources.on_gpu:
        return  # a CPU job without resources.memory: `ftjob run`'s, in this machine's memory
    if planned["reason"] == "Unknown":
        checked.notes.append(
            "not checked: memory: " + planned["message"].removeprefix("not checked: ")
        )
    elif planned["reason"] == "WillNotFit":
        line = f"the plan says it will not fit: {planned['message']}"
        if strict and not planned["allowed"]:
            checked.errors.append(f"spec.resources: {line}")  # errors name their field
        else:
            checked.warnings.append(line)
    elif planned["tight"]:
        checked.warnings.append(
            f"the plan's margin is tight (its error could tip it): {planned['message']}"
        )


def with_profile(
    doc: dict[str, Any], profile: Profile | None
) -> tuple[dict[str, Any], list[FieldError], dict | None]:
    """``doc`` with ``profile`` applied as the operator would (api/profile.py), the limits it
    breaks, and the record of what was applied. Without a profile, the job as it is; a job
    naming another profile than the one given is refused (it would not get this one)."""
    if profile is None:
        return doc, [], None
    named = (doc.get("spec") or {}).get("profile") if isinstance(doc.get("spec"), dict) else None
    if named is not None and named != profile.name:
        wrong = FieldError(
            "spec.profile",
            f"names FineTuneProfile {named}, but the profile given is {profile.name}",
            fix=f"pass --profile with {named}'s file, or set spec.profile: {profile.name}",
        )
        return doc, [wrong], None
    applied = apply(doc, profile, DEFAULT_IMAGE)
    return applied.doc, applied.violations, applied.record


def warnings(spec: FineTuneJobSpec) -> list[str]:
    """What is valid but likely wrong for a cluster. A CPU-only job is left alone: it is the
    kind ``ftjob run`` runs on this machine, where no image is pulled."""
    if not spec.resources.on_gpu:
        return []
    note = render.image_warning(spec)
    return [note] if note else []


def _model_shape(spec: FineTuneJobSpec, root: Path | None) -> ModelShape | None:
    """The model's shape where it can be read: the config.json of a local folder, or the
    table's entry for an hf:// model (None: not known here; the trainer checks it)."""
    source, config = parse(spec.model.source), None
    if isinstance(source, S3):
        return None  # read by the trainer, once downloaded
    if isinstance(source, Local):
        folder = source.at(root or ".")
        if not (folder / "config.json").is_file():
            return None
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{folder / 'config.json'} cannot be read as JSON: {e}") from None
    try:
        return shape_for(spec.model.source, config)
    except ValueError:
        if config is not None:
            raise  # a config.json without the fields a decoder has
        return None  # an hf:// model not in the table


def summary(spec: FineTuneJobSpec) -> str:
    """One line a person can check the job's shape against."""
    r, m = spec.resources, spec.method
    if r.on_gpu:
        unit = _count(r.gpus_per_node, "GPU", "GPUs")
    else:
        unit = _count(r.nproc_per_node, "CPU process", "CPU processes")
    t = spec.training
    length = (
        _count(t.max_steps, "step", "steps") if t.max_steps else _count(t.epochs, "epoch", "epochs")
    )
    return (
        f"{m.type}, {_count(r.nodes, 'node', 'nodes')} x {unit} "
        f"(world size {r.world_size}), global batch {spec.global_batch_size} x "
        f"{spec.dataset.max_seq_length} tokens, {length}, {spec.compute_precision()}"
    )


def _count(n: float, one: str, many: str) -> str:
    return f"{n:g} {one if n == 1 else many}"
