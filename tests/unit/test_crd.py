"""The generated CRD: valid for Kubernetes, equal to every committed copy, rules that compile."""

import json
from pathlib import Path

import cel
import kubernetes_validate
import pytest
import yaml

from ftjob.api import contract, crd
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import openapi

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_COPIES = [ROOT / "manifests" / "crd.yaml"]


def walk(node, path=""):
    yield path, node
    for key in ("properties", "additionalProperties"):
        sub = node.get(key)
        if isinstance(sub, dict) and key == "properties":
            for name, child in sub.items():
                yield from walk(child, f"{path}.{name}")
        elif isinstance(sub, dict):
            yield from walk(sub, f"{path}.*")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


@pytest.mark.parametrize("copy", COMMITTED_COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_copy_equals_generator(copy):
    assert copy.read_text() == crd.render_yaml(), (
        "stale: regenerate with python scripts/manifests.py"
    )


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_crd_validates_against_kubernetes_schema(version):
    kubernetes_validate.validate(crd.crd(), version, strict=True)


def test_every_field_is_documented_for_kubectl_explain():
    spec_schema = crd.schema()["properties"]["spec"]
    named = [(p, node) for p, node in walk(spec_schema) if p and not p.endswith(("[]", "*"))]
    undocumented = [p for p, node in named if "description" not in node]
    assert len(named) >= 90
    assert undocumented == []


def test_every_cel_rule_compiles_as_core_cel():
    rules = [
        rule["rule"]
        for _, node in walk(crd.schema())
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 20
    for rule in rules:
        cel.compile(rule)


def test_every_field_path_of_a_rule_exists_in_the_schema():
    paths = {p for p, _ in walk(crd.schema()["properties"]["spec"])}
    for rule in openapi(FineTuneJobSpec)["x-kubernetes-validations"]:
        assert rule["fieldPath"] in paths, rule


def test_lists_and_maps_are_bounded_so_cel_cost_is_bounded():
    for path, node in walk(crd.schema()["properties"]["spec"]):
        if node.get("type") == "array":
            assert "maxItems" in node, path
        if node.get("type") == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, path


def test_printer_columns_and_names():
    version = crd.crd()["spec"]["versions"][0]
    columns = [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c]
    # GRPO's reward says more than its loss: it shows beside it (empty for other objectives).
    assert columns == ["Phase", "Reason", "Nodes", "Progress", "Loss", "Reward", "ETA", "Age"]
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1]
    assert wide == [
        "Queue",
        "Restarts",
        "In-Place",
        "Tokens/s",
        "MFU",
        "Cost",
        "Reward-Acc",
        "Image",
    ]
    assert version["subresources"] == {"status": {}}
    assert crd.crd()["spec"]["names"]["shortNames"] == ["ftj"]


def test_status_schema_declares_what_the_operator_writes():
    status = crd.schema()["properties"]["status"]["properties"]
    assert {"phase", "conditions", "progress", "lastCheckpoint", "failure"} <= set(status)
    reasons = status["failure"]["properties"]["reason"]["enum"]
    # Every reason the trainer's record can name, and those the operator adds itself.
    assert set(contract.REASONS) | {"OOMKilled", "Stalled", "StartupTimeout"} <= set(reasons)
    assert "phase" in status["progress"]["properties"]


def test_defaults_in_schema_are_plain_json():
    json.dumps(crd.crd())
    yaml.safe_dump(crd.crd())


def _defaults_with_rules(schema: dict, path: str = "spec"):
    for key, sub in (schema.get("properties") or {}).items():
        if isinstance(sub.get("default"), dict) and sub.get("x-kubernetes-validations"):
            yield f"{path}.{key}", sub
        yield from _defaults_with_rules(sub, f"{path}.{key}")


def test_a_default_the_rules_check_passes_them_as_written():
    """kube-apiserver checks an object's default against its CEL rules as written, before
    defaulting inside it, and refused the CRD when a rule named a field the default lacked
    ({} for network: "no such key: progressPort"); such defaults are spelled out."""
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    found = dict(_defaults_with_rules(spec))
    assert "spec.network" in found
    for path, schema in found.items():
        for rule in schema["x-kubernetes-validations"]:
            if "oldSelf" in rule["rule"]:
                continue  # transition rules need an old object; a default has none
            result = cel.evaluate(rule["rule"], {"self": schema["default"]})
            assert result is True, (path, rule["rule"])
