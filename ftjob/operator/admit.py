"""The operator's own admission check: a job is taken only if it and every child the operator
would create for it are valid. (The API server's admission of the FineTuneJob itself, offline,
is :mod:`ftjob.api.admission`; whether the job fits is the plan's ``Planned`` condition.)

The children are rendered (:mod:`ftjob.operator.render`) and held to the API server's rules
(:mod:`ftjob.api.kubevalidation`); each refusal is traced back to the FineTuneJob field that
produced the value. The operator's reconcile and ``ftjob validate`` share :func:`parse_job`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ftjob.api import kubevalidation
from ftjob.api.jobspec import FineTuneJobSpec, parse_resource
from ftjob.api.schema import FieldError, SpecError
from ftjob.operator import render

# A stand-in for the UID the API server assigns: same shape, so names and labels are as long.
SAMPLE_UID = "00000000-0000-4000-8000-000000000000"


def parse_job(
    doc: dict[str, Any], strict: bool = False, children: bool = True
) -> tuple[str, FineTuneJobSpec]:
    """The job's name and spec, if the job and every child it would have are valid; else
    :class:`SpecError` naming every field at fault. The operator and ``ftjob validate`` share it
    (``strict``: see :func:`ftjob.api.jobspec.parse_resource`). ``children=False``: the caller
    knows that the children of a document of this very :func:`digest` passed; they are not
    rendered and checked again (the spec itself always is).
    """
    name, spec = parse_resource(doc, strict)
    namespace = doc["metadata"].get("namespace") or "default"
    if children and (errors := children_errors(name, namespace, spec)):
        raise SpecError(errors)
    return name, spec


def digest(doc: dict[str, Any]) -> str:
    """What the children's validity depends on (the name, the namespace, the spec), hashed:
    the operator reconciles an unchanged job every resync, and rendering and checking a big
    gang's children was most of a reconcile's decision, where the digest is a hash of the
    spec (the fleet suite's figures: bench/RESULTS.md)."""
    meta = doc.get("metadata") or {}
    which = [meta.get("name"), meta.get("namespace"), doc.get("spec")]
    text = json.dumps(which, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


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
