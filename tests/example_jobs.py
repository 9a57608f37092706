"""The bundled examples as specs, with edits: what the planner's tests start from.

example("tiny.yaml", **{"resources.nodes": 1, "method.type": "lora"})
"""

from __future__ import annotations

from pathlib import Path

from ftjob.api import manifest
from ftjob.api.jobspec import FineTuneJobSpec, parse_resource

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str, **edits) -> FineTuneJobSpec:
    """examples/``name``'s spec, each ``edits`` key a dotted path under spec set to its value."""
    (doc,) = manifest.load(EXAMPLES / name)
    for path, value in edits.items():
        node = doc["spec"]
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return parse_resource(doc)[1]
