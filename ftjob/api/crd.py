"""Render the FineTuneJob CustomResourceDefinition from ``spec/`` and ``status.py``, and the
FineTuneProfile's from ``profile.py``.

``ftjob crd`` (``--profile``) prints them; manifests/crd.yaml (profile-crd.yaml) and the Helm
chart's copies are this output, and a test keeps them equal.
"""

from __future__ import annotations

from typing import Any

import yaml

from ftjob import __version__
from ftjob.api import jobspec, objectives, profile, status
from ftjob.api.schema import openapi

# Pod and Service names are built from the job name, so it must be a short DNS-1035 label. A
# CRD may constrain metadata.name (and nothing else of metadata) in its schema.
NAME_SCHEMA = {
    "type": "string",
    "maxLength": jobspec.NAME_MAX,
    "pattern": jobspec.NAME_PATTERN,
    "description": "name of the job: " + jobspec.NAME_HINT.removeprefix("must be ") + ".",
}


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    # Why the job is in its phase, one word (Queued, Unschedulable, ImagePullBackOff,
    # AllPodsRunning, Preempted, ...): a Pending job's cause at a glance; the condition's
    # message and a Warning Event say the rest.
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Running")].reason',
    },
    {"name": "Nodes", "type": "integer", "jsonPath": ".spec.resources.nodes"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.display"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {"name": "ETA", "type": "string", "jsonPath": ".status.progress.eta"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # For a job in a Kueue queue, what Kueue says (what is short, or the ClusterQueue that
    # admitted it).
    {
        "name": "Queue",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Queued")].message',
        "priority": 1,
    },
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
    {
        "name": "In-Place",
        "type": "integer",
        "jsonPath": ".status.restartsInPlace",
        "priority": 1,
    },
    {
        "name": "Tokens/s",
        "type": "number",
        "jsonPath": ".status.progress.tokensPerSecond",
        "priority": 1,
    },
    {"name": "MFU", "type": "number", "jsonPath": ".status.progress.mfu", "priority": 1},
    # GPU-hours and money spent, and the projection (status.cost, the profile's prices).
    {"name": "Cost", "type": "string", "jsonPath": ".status.cost.display", "priority": 1},
    # Then the objectives' own (printer_columns()), then the image.
    {"name": "Image", "type": "string", "jsonPath": ".status.image", "priority": 1},
]


def printer_columns() -> list[dict[str, Any]]:
    """:data:`PRINTER_COLUMNS` with the objectives' metrics that ask for a column
    (api/objectives.py; a job of another objective leaves them empty): a headline one after
    Loss in the default view, the others before the last, with -o wide."""
    own = [m for m in objectives.metrics() if m.column]
    head = [_column(m) for m in own if m.headline]
    wide = [_column(m) | {"priority": 1} for m in own if not m.headline]
    at = [c["name"] for c in PRINTER_COLUMNS].index("Loss") + 1
    return PRINTER_COLUMNS[:at] + head + PRINTER_COLUMNS[at:-1] + wide + PRINTER_COLUMNS[-1:]


def _column(m: objectives.Metric) -> dict[str, Any]:
    return {"name": m.column, "type": "number", "jsonPath": f".status.progress.{m.key}"}


def schema() -> dict[str, Any]:
    """The openAPIV3Schema of the v1alpha1 version."""
    spec_schema = openapi(jobspec.FineTuneJobSpec)
    status_schema = status.schema()
    return {
        "type": "object",
        "description": spec_schema.pop("description"),
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object", "properties": {"name": NAME_SCHEMA}},
            "spec": {"description": "spec is the desired fine-tune.", **spec_schema},
            "status": {"description": status_schema.pop("description"), **status_schema},
        },
        "required": ["spec"],
    }


def crd() -> dict[str, Any]:
    """The FineTuneJob CRD."""
    names = {"kind": jobspec.KIND, "plural": jobspec.PLURAL, "singular": "finetunejob"}
    version = {"subresources": {"status": {}}, "additionalPrinterColumns": printer_columns()}
    return _crd(
        names | {"shortNames": ["ftj"]},
        "Namespaced",
        version | {"schema": {"openAPIV3Schema": schema()}},
    )


def profile_crd() -> dict[str, Any]:
    """The FineTuneProfile CRD: cluster-scoped, a spec and no status (api/profile.py)."""
    names = {"kind": profile.KIND, "plural": profile.PLURAL, "singular": profile.SINGULAR}
    spec_schema = openapi(profile.FineTuneProfileSpec)
    body = {
        "type": "object",
        "description": spec_schema.pop("description"),
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {"description": "spec: the defaults and limits.", **spec_schema},
        },
    }
    columns = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    version = {"additionalPrinterColumns": columns, "schema": {"openAPIV3Schema": body}}
    return _crd(names | {"shortNames": ["ftp"]}, "Cluster", version)


def _crd(names: dict[str, Any], scope: str, version: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{names['plural']}.{jobspec.GROUP}",
            "labels": {
                "app.kubernetes.io/name": "ftjob",
                "app.kubernetes.io/version": __version__,
            },
        },
        "spec": {
            "group": jobspec.GROUP,
            "scope": scope,
            "names": {
                "kind": names["kind"],
                "listKind": f"{names['kind']}List",
                "plural": names["plural"],
                "singular": names["singular"],
                "shortNames": names["shortNames"],
                "categories": ["ftjob", "ml"],
            },
            "versions": [{"name": jobspec.VERSION, "served": True, "storage": True, **version}],
        },
    }


def render_yaml() -> str:
    header = "# Generated by `ftjob crd` from ftjob/api/jobspec/ -- do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def render_profile_yaml() -> str:
    header = "# Generated by `ftjob crd --profile` from ftjob/api/profile.py -- do not edit.\n"
    return header + yaml.safe_dump(profile_crd(), sort_keys=False, width=100)


def rule_count(node: Any = None) -> int:
    """How many rules the CRD enforces beyond types: CEL rules, bounds, enums, patterns."""
    node = schema() if node is None else node
    if isinstance(node, list):
        return sum(rule_count(v) for v in node)
    if not isinstance(node, dict):
        return 0
    keys = ("minimum", "maximum", "enum", "pattern", "maxLength", "maxItems", "maxProperties")
    own = sum(1 for k in keys if k in node) + len(node.get("required", []))
    own += len(node.get("x-kubernetes-validations", []))
    return own + sum(rule_count(v) for k, v in node.items() if k != "x-kubernetes-validations")
