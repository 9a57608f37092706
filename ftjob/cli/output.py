"""PURE: what ``-o json`` and ``-o yaml`` print, for scripts and CI checks (docs/cli.md).

Each command prints one document with camelCase keys; bytes are integers, times seconds,
and a value that cannot be known is ``null``. New keys may be added; existing keys keep
their meaning (``apiVersion`` changes if that ever has to break).
"""

from __future__ import annotations

import json

from ftjob.api import manifest
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.cli import validate
from ftjob.plan import quota
from ftjob.plan.describe import pod_grace, verdict_text
from ftjob.plan.estimate import stride_name
from ftjob.plan.options import Plan

API_VERSION = "ftjob.dev/v1alpha1"
FORMATS = ("json", "yaml")


def dumps(doc: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    return manifest.dumps([doc])


def errors(lines: list[str]) -> list[dict]:
    """``field: message`` lines as objects; a line without a field keeps it empty."""
    out = []
    for line in lines:
        field, sep, message = line.partition(": ")
        out.append({"field": field, "message": message} if sep else {"field": "", "message": line})
    return out


def validation_result(path: str, checked: validate.CheckedJob) -> dict:
    return {
        "file": path,
        "name": checked.name,
        "valid": checked.ok,
        "summary": validate.summary(checked.spec) if checked.ok else None,
        "profile": checked.profile,  # {name, generation} applied (--profile), else None
        "errors": errors(checked.errors),
        "serverErrors": errors(checked.server_errors),
        # What the text prints under a valid job: what was not checked here, and warnings.
        "notes": list(checked.notes),
        "warnings": list(checked.warnings),
    }


def validation_list(results: list[dict]) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "ValidationList",
        "valid": all(r["valid"] for r in results),
        "items": results,
    }


def plan_result(
    path: str, name: str | None, spec: FineTuneJobSpec, result: Plan, notes: list[str] = ()
) -> dict:
    e, s = result.estimate, result.shape
    return {
        "file": path,
        "name": name,
        "fits": result.fits,
        "verdict": verdict_text(result),
        "notes": list(notes),  # what was not checked here, as the text prints it
        "model": {
            "name": s.name,
            "parameters": s.params,
            "layers": s.layers,
            "hidden": s.hidden,
            "trainableParameters": e.trainable,
            "method": spec.method.type,
        },
        # Per GPU, or per process on CPU.
        "perDevice": {
            "weightsBytes": int(e.weights),
            "gradientsBytes": int(e.gradients),
            "optimizerBytes": int(e.optimizer),
            "activationsBytes": int(e.activations),
            "temporariesBytes": int(e.temporaries),
            "reservedBytes": int(e.reserved),
            "totalBytes": int(e.per_device),
            "deviceBytes": _int(e.device_bytes),
        },
        "cpuMemory": {
            "peakPerNodeBytes": int(e.cpu_peak_per_node),
            "peakPhase": e.cpu_peak_phase,  # which phase sets the peak
            # Each phase's peak, in the busiest pod (rank 0's: it prepares and exports).
            "phasesPerNodeBytes": {phase: int(b) for phase, b in e.cpu_phases.items()},
            "loadingPerNodeBytes": int(e.load_cpu_per_node),
            "pageCachePerNodeBytes": int(e.page_cache_per_node),
            "steadyPerNodeBytes": int(e.cpu_per_node),
            "podMemoryBytes": _int(e.pod_memory),
        },
        # What each pod requests and the whole gang takes of a Kueue ClusterQueue's quota.
        "quota": {"perPod": quota.requests(spec), "gang": quota.gang(spec)},
        "checkpointBytes": int(e.checkpoint_bytes),
        # The pods' terminationGracePeriodSeconds and why (the planned save, or the floor).
        "gracePeriod": dict(zip(("seconds", "why"), pod_grace(spec, e), strict=True)),
        # What parallelism.sharding asks for, what it means here and why (auto resolved).
        "sharding": {
            "setting": spec.parallelism.sharding,
            "chosen": e.sharding,
            "why": e.sharding_reason,
            "collectiveSecondsPerStep": e.collective_seconds,
        },
        # What activationCheckpointing asks for, and what it means here (auto resolved).
        "activationCheckpointing": {
            "setting": spec.training.activation_checkpointing,
            "chosen": stride_name(e.checkpoint_stride),
        },
        "tokensPerStep": spec.tokens_per_step,
        "flopsPerToken": e.flops_per_token,
        "recomputedFlopsPerToken": e.recomputed_flops_per_token,
        "referenceFlopsPerToken": e.reference_flops_per_token,  # DPO with adapters
        # The one step time (compute + collectives, not overlapped), and its parts.
        "stepSeconds": e.step_seconds,
        "computeSecondsPerStep": e.compute_seconds,
        "mfu": e.mfu,
        "networkBytesPerNodePerStep": int(e.network_bytes_per_node),
        "networkSecondsPerStep": e.network_seconds,  # the collectives' share between nodes
        "options": [
            {
                "change": o.change,
                "perDeviceBytes": int(o.estimate.per_device),
                "stepSeconds": o.estimate.step_seconds,
            }
            for o in result.options
        ],
    }


def plan_list(results: list[dict], invalid: list[dict]) -> dict:
    """The plans, and the jobs that could not be planned (each with its errors)."""
    return {"apiVersion": API_VERSION, "kind": "PlanList", "items": results, "invalid": invalid}


def invalid_plan(path: str, doc: dict, lines: list[str]) -> dict:
    """A job ``ftjob plan`` refused: its file, name and ``field: message`` errors."""
    name = (doc.get("metadata") or {}).get("name")
    prefix = f"{path}: "
    return {
        "file": path,
        "name": name if isinstance(name, str) else None,
        "errors": errors([line.removeprefix(prefix) for line in lines]),
    }


def object_list(objects: list[dict]) -> dict:
    """Rendered objects as kubectl prints several: a v1 List (``kubectl apply -f`` takes it)."""
    return {"apiVersion": "v1", "kind": "List", "items": objects}


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)
