"""The verdict on a FineTuneJob document: ftjob's own checks and the API server's, offline.

Both must agree: ``spec.py`` raises readable errors for people, the generated CRD (schema +
CEL, through :mod:`ftjob.api.admission`) is what a cluster enforces at ``kubectl apply``.

A job is accepted only if every child the operator would create for it is valid too: the
children are rendered and held to the API server's rules (:mod:`ftjob.api.kubevalidation`), and
each refusal is traced back to the FineTuneJob field that produced the value.

Where the model's shape is known (its config.json beside the job file, or an hf:// model in
:data:`ftjob.plan.modelshape.KNOWN_MODELS`), the job is also held to what the trainer would refuse
on that model (:mod:`ftjob.plan.limits`, through the plan's estimate): validate, plan and the
trainer give one verdict; the operator's admission applies it where the model is in that table
(it reads no volume).

Local inputs (:func:`ftjob.job.inputs.missing`, the check ``ftjob run`` makes before it starts
anything): ``ftjob plan`` reads the model and data beside the job file, so a missing one
refuses the job (``local=True``). ``ftjob validate`` checks a job for a cluster,
where a relative or absolute path names the checkpoint volume, not this machine: a path not
found here is a note saying the model's shape (or the data) was not checked, not an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from ftjob.api import admission, crd, kubevalidation
from ftjob.api.schema import FieldError, SpecError
from ftjob.api.spec import FineTuneJobSpec, parse_resource, validate_update
from ftjob.job import inputs
from ftjob.operator import render
from ftjob.plan import estimate as plan
from ftjob.plan.modelshape import ModelShape, shape_for

# A stand-in for the UID the API server assigns: same shape, so names and labels are as long.
SAMPLE_UID = "00000000-0000-4000-8000-000000000000"


@cache
def crd_schema() -> dict:
    return crd.schema()


@dataclass
class Verdict:
    name: str | None
    spec: FineTuneJobSpec | None = None
    errors: list[str] = field(default_factory=list)  # ftjob's messages
    server_errors: list[str] = field(default_factory=list)  # the API server's messages
    notes: list[str] = field(default_factory=list)  # what could not be checked here, and why
    shape: ModelShape | None = None  # the model's, where it could be read

    @property
    def ok(self) -> bool:
        return not self.errors and not self.server_errors


def check(
    doc: dict[str, Any],
    old: dict[str, Any] | None = None,
    job_file: str | None = None,
    local: bool = False,
) -> Verdict:
    """Check ``doc`` (as an update of ``old`` when given) both ways, and on its model.

    ``job_file``: where relative model and data sources are looked up. ``local``: they must
    be there (plan, run); otherwise a missing one is only a note (validate).
    """
    name = (doc.get("metadata") or {}).get("name")
    verdict = Verdict(name=name if isinstance(name, str) else None)
    try:
        _, verdict.spec = parse_job(doc)
        if old is not None:
            _, old_spec = parse_resource(old)
            validate_update(old_spec, verdict.spec)
        # Relative sources are read beside the job file; without one, only absolute ones.
        root = Path(job_file).parent if job_file else None
        missing = inputs.missing(verdict.spec, root, None) if root else []
        if local and missing:
            raise SpecError(missing)
        verdict.notes = [
            f"not checked: {m.path}: {m.message} on this machine (a cluster reads the path "
            "from the checkpoint volume)"
            for m in missing
        ]
        verdict.shape = _model_shape(verdict.spec, root)
        if verdict.shape is not None:
            problem = plan.estimate(verdict.spec, verdict.shape).problem
            if problem:
                raise SpecError([problem])
    except SpecError as e:
        verdict.errors = [str(err) for err in e.errors]
        verdict.spec = None
    except ValueError as e:  # a config.json without the fields a decoder has
        verdict.errors = [f"spec.model.source: {e}"]
        verdict.spec = None
    _, verdict.server_errors = admission.admit(crd_schema(), doc, old)
    return verdict


def _model_shape(spec: FineTuneJobSpec, root: Path | None) -> ModelShape | None:
    """The model's shape where it can be read: the config.json of a local folder, or the
    table's entry for an hf:// model (None: not known here; the trainer checks it)."""
    source = spec.model.source
    config = None
    if not source.startswith("hf://"):
        folder = Path(source) if Path(source).is_absolute() or root is None else root / source
        if not (folder / "config.json").is_file():
            return None
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{folder / 'config.json'} cannot be read as JSON: {e}") from None
    try:
        return shape_for(source, config)
    except ValueError:
        if config is not None:
            raise  # a config.json without the fields a decoder has
        return None  # an hf:// model not in the table


def parse_job(doc: dict[str, Any]) -> tuple[str, FineTuneJobSpec]:
    """The job's name and spec, if the job and every child it would have are valid; else
    :class:`SpecError` naming every field at fault. The operator and ``ftjob validate`` share it.
    """
    name, spec = parse_resource(doc)
    namespace = doc["metadata"].get("namespace") or "default"
    if errors := children_errors(name, namespace, spec):
        raise SpecError(errors)
    return name, spec


def children_errors(name: str, namespace: str, spec: FineTuneJobSpec) -> list[FieldError]:
    """What the API server would refuse in the job's children, each blamed on a job field.

    The last attempt the job may reach is rendered: its labels are the longest.
    """
    attempt = spec.run_policy.backoff_limit + 1
    objs = render.children(name, namespace, spec, attempt=attempt, uid=SAMPLE_UID)
    found = []
    for err in kubevalidation.errors(objs):
        where = f"(in {err.kind} {err.name}: {err.path})"
        found.append(FieldError(blame(err, spec, objs), f"{err.message} {where}"))
    return found


# Where each child field's value comes from in the FineTuneJob; first match wins.
_SOURCES = [
    (r"metadata\.namespace", "metadata.namespace"),
    (r"metadata\.labels\[kueue\.x-k8s\.io/queue-name\]", "spec.scheduling.queue"),
    (r"metadata\.|spec\.(hostname|subdomain|selector)", "metadata.name"),
    (r"spec\.containers\[0\]\.image", "spec.image"),
    (r"spec\.containers\[0\]\.resources", "spec.resources"),
    (r"spec\.nodeSelector\[(.*)\]", "spec.scheduling.nodeSelector.{0}"),
    (r"spec\.tolerations(\[.*)", "spec.scheduling.tolerations{0}"),
    (r"spec\.priorityClassName", "spec.scheduling.priorityClassName"),
    (r"spec\.schedulerName", "spec.scheduling.schedulerName"),
    (r"spec\.volumes\[\d+\]\.persistentVolumeClaim", "spec.checkpoint.volume.claimName"),
    (r"data", "spec"),  # the ConfigMap carries the whole job document
]
_PORTS = ("spec.network.rendezvousPort", "spec.network.progressPort")


def blame(err: kubevalidation.ChildError, spec: FineTuneJobSpec, objs: list[dict]) -> str:
    """The FineTuneJob field that put the refused value into the child."""
    port = re.match(r"spec\.(containers\[0\]\.)?ports\[(\d+)\]", err.path)
    if port:
        return _PORTS[int(port.group(2))] if int(port.group(2)) < len(_PORTS) else "spec.network"
    env = re.match(r"spec\.containers\[0\]\.env\[(\d+)\]", err.path)
    if env:
        pod = next(o for o in objs if o["kind"] == err.kind and o["metadata"]["name"] == err.name)
        var = pod["spec"]["containers"][0]["env"][int(env.group(1))]["name"]
        return _env_source(var, spec, err.path)
    for pattern, source in _SOURCES:
        m = re.match(pattern, err.path)
        if m:
            return source.format(*m.groups())
    return "spec"


def _env_source(var: str, spec: FineTuneJobSpec, path: str) -> str:
    if var == "HF_TOKEN":
        leaf = "key" if path.endswith(".key") else "name"
        return f"spec.secrets.huggingFaceToken.{leaf}"
    for i, e in enumerate(spec.env):
        if e.name == var:
            return f"spec.env[{i}]"
    if var in spec.network.nccl_env:
        return f"spec.network.ncclEnv.{var}"
    return "spec"


def summary(spec: FineTuneJobSpec) -> str:
    """One line a person can check the job's shape against."""
    r, m = spec.resources, spec.method
    if r.gpus_per_node:
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
