"""Small things the operator, the CRD and the chart say, said truly (issue 52, point 7)."""

from pathlib import Path

import pytest
from test_chart import render
from test_crd import walk
from test_status import T0

from ftjob.api import crd, manifest
from ftjob.api.jobspec import parse_resource
from ftjob.api.schema import _show
from ftjob.operator import lifecycle
from ftjob.operator import status as st

ROOT = Path(__file__).resolve().parents[2]


def planned(example: str) -> dict:
    name, spec = parse_resource(manifest.load(ROOT / "examples" / example)[0])
    return st.condition(
        lifecycle.decide(spec, name, 1, None, [], T0).status["conditions"], "Planned"
    )


@pytest.mark.parametrize(
    "example, status, reason",
    [
        ("tiny.yaml", "Unknown", "NotPlanned"),  # a model path the operator cannot read
        ("llama3-8b-lora-efa.yaml", "True", "Fits"),
        ("llama3-8b-full-1gpu.yaml", "False", "WillNotFit"),
    ],
)
def test_the_planned_condition_says_what_the_plan_knows(example, status, reason):
    condition = planned(example)
    assert (condition["status"], condition["reason"]) == (status, reason), condition
    if status == "Unknown":
        assert condition["message"].startswith("not planned: ")


def test_kubectl_explain_shows_each_default():
    """`kubectl explain` prints descriptions, not the schema's defaults: every scalar default
    is in its field's description, as Kubernetes' own types say it."""
    spec_schema = crd.schema()["properties"]["spec"]
    defaulted = [
        (path, node)
        for path, node in walk(spec_schema)
        if "default" in node
        and not isinstance(node["default"], dict | list)
        and node["default"] != ""
    ]
    assert len(defaulted) >= 60
    for path, node in defaulted:
        text = node["description"]
        said = f"Defaults to {_show(node['default'])}." in text
        assert said or "default" in text.lower(), (path, text)
    backoff = spec_schema["properties"]["runPolicy"]["properties"]["backoffLimit"]
    assert backoff["description"].endswith(f"Defaults to {backoff['default']}.")


def test_the_charts_notes_warn_while_the_images_are_placeholders():
    notes = render({})["ftjob/templates/NOTES.txt"]
    assert notes.startswith("WARNING: no registry publishes")
    assert "ghcr.io/ftjob/operator:" in notes and "ghcr.io/ftjob/trainer:" in notes
    built = {
        "image": {"repository": "registry.example.com/ftjob-operator"},
        "trainer": {"defaultImage": "registry.example.com/ftjob-trainer:0.1.0"},
    }
    assert "WARNING" not in render(built)["ftjob/templates/NOTES.txt"]
    trainer_only = render({"image": built["image"]})["ftjob/templates/NOTES.txt"]
    assert "ghcr.io/ftjob/trainer:" in trainer_only and "ftjob/operator:" not in trainer_only
