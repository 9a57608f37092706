"""The verdict on a FineTuneJob document: ftjob's own checks and the API server's, offline.

Both must agree: ``spec.py`` raises readable errors for people, the generated CRD (schema +
CEL, through :mod:`ftjob.admission`) is what a cluster enforces at ``kubectl apply``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ftjob import admission, crd
from ftjob.schema import SpecError
from ftjob.spec import FineTuneJobSpec, parse_resource, validate_update


@cache
def crd_schema() -> dict:
    return crd.schema()


@dataclass
class Verdict:
    name: str | None
    spec: FineTuneJobSpec | None = None
    errors: list[str] = field(default_factory=list)  # ftjob's messages
    server_errors: list[str] = field(default_factory=list)  # the API server's messages

    @property
    def ok(self) -> bool:
        return not self.errors and not self.server_errors


def check(doc: dict[str, Any], old: dict[str, Any] | None = None) -> Verdict:
    """Check ``doc`` (as an update of ``old`` when given) both ways."""
    name = (doc.get("metadata") or {}).get("name")
    verdict = Verdict(name=name if isinstance(name, str) else None)
    try:
        _, verdict.spec = parse_resource(doc)
        if old is not None:
            _, old_spec = parse_resource(old)
            validate_update(old_spec, verdict.spec)
    except SpecError as e:
        verdict.errors = [str(err) for err in e.errors]
    _, verdict.server_errors = admission.admit(crd_schema(), doc, old)
    return verdict


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
