"""A job is accepted only if every child the operator renders for it is valid for the API server.

The children of every valid job (examples, samples and unusual-but-valid jobs) pass
Kubernetes' own schemas and its name/label/toleration/port rules; for the fields whose values
go straight into a child, the job-level verdict (ftjob's and the CRD's) refuses exactly what
the child would be refused for; a child's refusal names the job field it came from.
"""

import copy
import dataclasses
from pathlib import Path

import kubernetes_validate
import pytest

from ftjob.api import kubevalidation, manifest
from ftjob.api.jobspec import parse_resource
from ftjob.api.jobspec.env import SecretsSpec
from ftjob.api.jobspec.fields import SecretKeyRef
from ftjob.api.jobspec.scheduling import Toleration
from ftjob.cli import validate
from ftjob.operator import admit, render, watched

ROOT = Path(__file__).resolve().parents[2]
VALID_FILES = sorted((ROOT / "examples").glob("*.yaml")) + sorted(
    (ROOT / "manifests" / "samples").glob("*.yaml")
)
BASE = {
    "apiVersion": "ftjob.dev/v1alpha1",
    "kind": "FineTuneJob",
    "metadata": {"name": "job"},
    "spec": {
        "model": {"source": "hf://org/model"},
        "dataset": {"source": "data/train.jsonl"},
        "training": {"maxSteps": 100},
    },
}


def job(metadata=None, **sections):
    doc = copy.deepcopy(BASE)
    doc["metadata"].update(metadata or {})
    doc["spec"].update(sections)
    return doc


UNUSUAL_BUT_VALID = {
    "huge-seq-length": job(dataset={"source": "d.jsonl", "maxSeqLength": 131072}),
    "64-nodes": job(
        resources={"nodes": 64, "gpusPerNode": 8},
        checkpoint={"volume": {"claimName": "fsx.shared"}},
        runPolicy={"backoffLimit": 100},
    ),
    "scientific-notation": manifest.loads(
        "apiVersion: ftjob.dev/v1alpha1\nkind: FineTuneJob\nmetadata: {name: sci}\n"
        "spec:\n  model: {source: m}\n  dataset: {source: d.jsonl}\n"
        "  training: {maxSteps: 1e3, learningRate: 2e-5, weightDecay: 1e-2, warmup: 1e2}\n"
    )[0],
    "longest-name": job({"name": "a" * 51 + "z", "namespace": "n" * 63}),
    "labels-and-namespace": job(
        {"namespace": "team-a", "labels": {"example.com/team": "ml.research_1", "empty": ""}}
    ),
    "scheduling": job(
        scheduling={
            "queue": "gpu-queue",
            "priorityClassName": "high.priority",
            "schedulerName": "volcano",
            "nodeSelector": {"node.kubernetes.io/instance-type": "p4d.24xlarge", "gpu": ""},
            "tolerations": [
                {"operator": "Exists"},
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "spot", "value": "true", "effect": "NoExecute", "tolerationSeconds": 60},
                {"key": "dedicated", "value": ""},
            ],
        }
    ),
    "image-by-digest": job(image="registry.local:5000/org/trainer@sha256:" + "0" * 64),
    "secret-with-dots": job(
        secrets={"huggingFaceToken": {"name": "hf.token", "key": ".hf_token-v2"}}
    ),
    "warmup-bounds": job(training={"maxSteps": 100, "warmup": "100%"}),
    "output-beside-reserved": job(output={"path": "exports/checkpoints"}),
    "lora-modules": job(method={"type": "lora", "lora": {"targetModules": ["q_proj", "v_proj"]}}),
}


def valid_jobs():
    for path in VALID_FILES:
        for doc in manifest.load(path):
            yield pytest.param(doc, id=f"{path.parent.name}/{path.name}")
    for name, doc in UNUSUAL_BUT_VALID.items():
        yield pytest.param(doc, id=name)


@pytest.mark.parametrize("doc", list(valid_jobs()))
def test_every_valid_job_is_accepted_and_its_children_pass_kubernetes(doc):
    checked = validate.check(doc)
    assert checked.ok, checked.errors + checked.server_errors
    name = doc["metadata"]["name"]
    namespace = doc["metadata"].get("namespace", "default")
    spec = checked.spec
    objs = render.children(name, namespace, spec, spec.run_policy.backoff_limit + 1, "u" * 36)
    assert kubevalidation.errors(objs) == []
    for obj in objs[:3] + objs[-1:]:  # the pods differ only in their rank
        kubernetes_validate.validate(obj, "1.37", strict=True)


# ------------------------------------------------ the job's verdict == its children's verdict


def spec_with(value_setter):
    """A valid job's spec with one value set past ftjob's checks, as if they were missing."""
    _, spec = parse_resource(job())
    return value_setter(spec)


def children_ok(name, namespace, spec):
    return not kubevalidation.errors(render.children(name, namespace, spec, 4, "u" * 36))


def agree(doc, spec):
    """ftjob's verdict and the CRD's on ``doc`` both equal the verdict on its children."""
    meta = doc["metadata"]
    expected = children_ok(meta["name"], meta.get("namespace", "default"), spec)
    checked = validate.check(doc)
    assert checked.ok == expected, (checked.errors, checked.server_errors)
    assert (not checked.server_errors) == expected, checked.server_errors


IMAGES = ["", " ghcr.io/x:1", "ghcr.io/x 1", "ghcr.io/x:1", "x@sha256:" + "a" * 64, "x\t"]


@pytest.mark.parametrize("image", IMAGES)
def test_image(image):
    agree(job(image=image), spec_with(lambda s: dataclasses.replace(s, image=image)))


TOLERATIONS = [
    {"operator": "Exists"},
    {"operator": "Equal"},
    {"effect": "NoSchedule"},
    {"key": "a", "operator": "Exists", "value": "b"},
    {"key": "a", "operator": "Exists"},
    {"key": "a", "value": ""},
    {"key": "a", "value": "has space"},
    {"key": "bad key", "operator": "Exists"},
    {"key": "example.com/gpu", "value": "x", "effect": "NoExecute", "tolerationSeconds": 5},
    {"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5},
    {"key": "a", "tolerationSeconds": 5},
]


@pytest.mark.parametrize("toleration", TOLERATIONS, ids=str)
def test_toleration(toleration):
    snake = {"tolerationSeconds": "toleration_seconds"}
    tol = Toleration(**{snake.get(k, k): v for k, v in toleration.items()})
    spec = spec_with(
        lambda s: dataclasses.replace(
            s, scheduling=dataclasses.replace(s.scheduling, tolerations=[tol])
        )
    )
    agree(job(scheduling={"tolerations": [toleration]}), spec)


NODE_SELECTORS = [
    {"gpu": "a100"},
    {"gpu type": "a100"},
    {"example.com/gpu": ""},
    {"Example.com/gpu": "x"},
    {"gpu": "a" * 64},
    {"gpu": "-a"},
    {"a" * 64: "x"},
    {"/gpu": "x"},
]


@pytest.mark.parametrize("selector", NODE_SELECTORS, ids=str)
def test_node_selector(selector):
    spec = spec_with(
        lambda s: dataclasses.replace(
            s, scheduling=dataclasses.replace(s.scheduling, node_selector=selector)
        )
    )
    agree(job(scheduling={"nodeSelector": selector}), spec)


@pytest.mark.parametrize("field", ["priorityClassName", "schedulerName"])
@pytest.mark.parametrize("value", ["high", "high.priority", "High", "a_b", "-a", "a" * 254])
def test_scheduling_names(field, value):
    attr = {"priorityClassName": "priority_class_name", "schedulerName": "scheduler_name"}[field]
    spec = spec_with(
        lambda s: dataclasses.replace(
            s, scheduling=dataclasses.replace(s.scheduling, **{attr: value})
        )
    )
    agree(job(scheduling={field: value}), spec)


SECRETS = [
    ("hf", "token"),
    ("hf.token", ".token"),
    ("hf", ""),
    ("hf", "."),
    ("hf", ".."),
    ("hf", "..x"),
    ("hf", "a/b"),
    ("hf", "to ken"),
    ("HF", "token"),
]


@pytest.mark.parametrize("name, key", SECRETS)
def test_secret_ref(name, key):
    ref = SecretKeyRef(name=name, key=key)
    spec = spec_with(lambda s: dataclasses.replace(s, secrets=SecretsSpec(hugging_face_token=ref)))
    agree(job(secrets={"huggingFaceToken": {"name": name, "key": key}}), spec)


@pytest.mark.parametrize("ports", [(29500, 8000), (29500, 29500), (8000, 8000)])
def test_ports(ports):
    rendezvous, progress = ports
    spec = spec_with(
        lambda s: dataclasses.replace(
            s,
            network=dataclasses.replace(
                s.network, rendezvous_port=rendezvous, progress_port=progress
            ),
        )
    )
    agree(job(network={"rendezvousPort": rendezvous, "progressPort": progress}), spec)


@pytest.mark.parametrize(
    "metadata",
    [
        {"name": "run-1"},
        {"name": "1st-run"},
        {"name": "run-"},
        {"name": "Run"},
        {"name": "run", "namespace": "Team_A"},
        {"name": "run", "namespace": "n" * 64},
        {"name": "run", "labels": {"team": "ml research"}},
        {"name": "run", "labels": {"bad key": "x"}},
    ],
    ids=str,
)
def test_metadata(metadata):
    doc = job(metadata)
    # The job's own labels are not copied to its children; the API server checks them on
    # the job itself, as it does for every object.
    expected = children_ok(
        metadata["name"], metadata.get("namespace", "default"), spec_with(lambda s: s)
    ) and not list(kubevalidation.metadata_errors(metadata))
    checked = validate.check(doc)
    assert checked.ok == expected, checked.errors
    assert (not checked.server_errors) == expected, checked.server_errors


# ------------------------------------------------------------ a child's error names the field


@pytest.mark.parametrize(
    "setter, field",
    [
        (lambda s: dataclasses.replace(s, image="a b"), "spec.image"),
        (
            lambda s: dataclasses.replace(
                s,
                scheduling=dataclasses.replace(
                    s.scheduling, tolerations=[Toleration(key="a", operator="Exists", value="b")]
                ),
            ),
            "spec.scheduling.tolerations[0].value",
        ),
        (
            lambda s: dataclasses.replace(
                s, scheduling=dataclasses.replace(s.scheduling, node_selector={"a b": "c"})
            ),
            "spec.scheduling.nodeSelector.a b",
        ),
        (
            lambda s: dataclasses.replace(
                s, network=dataclasses.replace(s.network, progress_port=s.network.rendezvous_port)
            ),
            "spec.network.progressPort",
        ),
        (
            lambda s: dataclasses.replace(
                s, secrets=SecretsSpec(hugging_face_token=SecretKeyRef(name="hf", key=""))
            ),
            "spec.secrets.huggingFaceToken.key",
        ),
        (
            lambda s: dataclasses.replace(
                s, scheduling=dataclasses.replace(s.scheduling, affinity={"x": "y" * 2**20})
            ),
            "spec",  # the ConfigMap that carries the job document would be over 1 MiB
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_child_refusal_is_traced_to_the_job_field(setter, field):
    errors = admit.children_errors("job", "default", spec_with(setter))
    assert errors and {e.path for e in errors} == {field}, errors
    assert all(" (in " in e.message for e in errors)  # and says which child and where


def test_a_job_name_that_makes_a_bad_service_name_is_traced_to_metadata_name():
    _, spec = parse_resource(job())
    errors = admit.children_errors("1st-run", "default", spec)
    assert {e.path for e in errors} == {"metadata.name"}
    assert any("Service 1st-run" in e.message for e in errors)


def test_a_job_document_too_large_for_its_config_map_is_refused_naming_the_spec():
    doc = job(scheduling={"affinity": {"nodeAffinity": {"note": "x" * 2**20}}})
    checked = validate.check(doc)
    assert [e.split(":")[0] for e in checked.errors] == ["spec"], checked.errors
    assert "ConfigMap job-spec" in checked.errors[0]


def test_the_operator_checks_a_jobs_children_once_per_content_and_again_after_an_edit(
    monkeypatch,
):
    from datetime import datetime, timezone

    from ftjob.operator import handlers

    checked = []
    real = admit.children_errors
    monkeypatch.setattr(admit, "children_errors", lambda *a: checked.append(a) or real(*a))
    state, doc = watched.JobState(), job({"namespace": "team-a", "uid": "u-1"})

    def decide(d):
        seen = watched.Seen(copy.deepcopy(d), {}, [], datetime.now(timezone.utc))
        return handlers._decide("job", seen, state)[1]

    assert decide(doc).phase != "Failed" and len(checked) == 1
    # A reconcile of the same job (a resync; status and resourceVersion are not its content).
    again = copy.deepcopy(doc) | {"status": {"phase": "Running"}}
    again["metadata"]["resourceVersion"] = "7"
    assert decide(again).phase != "Failed" and len(checked) == 1
    # An edit whose ConfigMap would be over 1 MiB: the children are checked again, and refused.
    edited = copy.deepcopy(doc)
    edited["spec"]["scheduling"] = {"affinity": {"nodeAffinity": {"note": "x" * 2**20}}}
    refused = decide(edited)
    assert len(checked) == 2 and refused.phase == "Failed", refused.status
    assert "ConfigMap job-spec" in str(refused.status), refused.status
    # Back to the content that passed: still known, and a new edit is checked again.
    assert decide(doc).phase != "Failed" and len(checked) == 2
    edited["spec"]["scheduling"] = {"nodeSelector": {"gpu": "h100"}}
    assert decide(edited).phase != "Failed" and len(checked) == 3
