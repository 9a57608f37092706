"""docs/install.md's "Queues with Kueue": its YAML applies with real kubectl, and a job on
that LocalQueue gets pods that carry Kueue's plain-pod group labels.

The emulator serves any CRD it is given; Kueue's own CRDs are large, so the ones below keep
only the fields the doc uses, transcribed from Kueue's kueue.x-k8s.io/v1beta1 API (names,
types, required fields, enums, and the rule that each flavor lists as many resources as the
group covers), strict about unknown fields like a real server. What Kueue itself does (the
admission gate, quota accounting) needs a real cluster with Kueue installed.
"""

import re
from pathlib import Path

import pytest
import yaml
from apiserver import CRD_RESOURCE
from hangs import FLOOR
from support import job_pods, tiny_job

from ftjob.api import manifest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)

STR = {"type": "string"}
INT_OR_STRING = {"x-kubernetes-int-or-string": True}
STRING_MAP = {"type": "object", "additionalProperties": STR}
ANY_LIST = {
    "type": "array",
    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
}
LABEL_SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": STRING_MAP, "matchExpressions": ANY_LIST},
}
RESOURCE_QUOTA = {
    "type": "object",
    "required": ["name", "nominalQuota"],
    "properties": {
        "name": STR,
        "nominalQuota": INT_OR_STRING,
        "borrowingLimit": INT_OR_STRING,
        "lendingLimit": INT_OR_STRING,
    },
}
FLAVOR_QUOTAS = {
    "type": "object",
    "required": ["name", "resources"],
    "properties": {
        "name": STR,
        "resources": {"type": "array", "minItems": 1, "maxItems": 16, "items": RESOURCE_QUOTA},
    },
}
RESOURCE_GROUP = {
    "type": "object",
    "required": ["coveredResources", "flavors"],
    "properties": {
        "coveredResources": {"type": "array", "minItems": 1, "maxItems": 16, "items": STR},
        "flavors": {"type": "array", "minItems": 1, "maxItems": 16, "items": FLAVOR_QUOTAS},
    },
    "x-kubernetes-validations": [
        {
            "rule": "self.flavors.all(x, size(x.resources) == size(self.coveredResources))",
            "message": "flavors must have the same number of resources as the coveredResources",
        }
    ],
}
SPECS = {
    "ResourceFlavor": {
        "type": "object",
        "properties": {
            "nodeLabels": STRING_MAP,
            "nodeTaints": ANY_LIST,
            "tolerations": ANY_LIST,
            "topologyName": STR,
        },
    },
    "ClusterQueue": {
        "type": "object",
        "properties": {
            "resourceGroups": {"type": "array", "maxItems": 16, "items": RESOURCE_GROUP},
            "namespaceSelector": LABEL_SELECTOR,
            "cohort": STR,
            "queueingStrategy": {"type": "string", "enum": ["StrictFIFO", "BestEffortFIFO"]},
            "stopPolicy": {"type": "string", "enum": ["None", "Hold", "HoldAndDrain"]},
            "preemption": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "flavorFungibility": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    },
    "LocalQueue": {
        "type": "object",
        "required": ["clusterQueue"],
        "properties": {
            "clusterQueue": {
                "type": "string",
                "maxLength": 253,
                "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
            },
            "stopPolicy": {"type": "string", "enum": ["None", "Hold", "HoldAndDrain"]},
        },
    },
}
SCOPES = {"ResourceFlavor": "Cluster", "ClusterQueue": "Cluster", "LocalQueue": "Namespaced"}


def kueue_crd(kind: str) -> dict:
    plural = kind.lower() + "s"
    schema = {
        "type": "object",
        "properties": {
            "apiVersion": STR,
            "kind": STR,
            "metadata": {"type": "object"},
            "spec": SPECS[kind],
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kueue.x-k8s.io"},
        "spec": {
            "group": "kueue.x-k8s.io",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "scope": SCOPES[kind],
            "versions": [
                {
                    "name": "v1beta1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def doc_yaml() -> str:
    """The first yaml block of docs/install.md's "Queues with Kueue" section."""
    text = (ROOT / "docs" / "install.md").read_text()
    section = text.split("## Queues with Kueue", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture(scope="module")
def kueue(cluster):
    for kind in SPECS:
        cluster.call(lambda k=kind: cluster.api.create_object(CRD_RESOURCE, None, kueue_crd(k)))


def test_the_docs_kueue_objects_apply_and_a_queued_job_gets_the_group_labels(
    cluster, operator, kubectl, kueue
):
    text = doc_yaml()
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert sorted(d["kind"] for d in docs) == ["ClusterQueue", "LocalQueue", "ResourceFlavor"]
    out = kubectl("apply", "--validate=false", "-f", "-", input=text).stdout
    assert "clusterqueue.kueue.x-k8s.io/gpu-training created" in out, out
    assert "localqueue.kueue.x-k8s.io/research created" in out, out
    assert "resourceflavor.kueue.x-k8s.io/a100-80gb created" in out, out
    local = next(d for d in docs if d["kind"] == "LocalQueue")
    namespace = local["metadata"]["namespace"]
    listed = kubectl("get", "localqueues", "-n", namespace, "-o", "name").stdout.split()
    assert listed == ["localqueue.kueue.x-k8s.io/research"]
    # The LocalQueue points at the ClusterQueue, which covers every resource an EFA job asks for.
    (cq,) = [d for d in docs if d["kind"] == "ClusterQueue"]
    assert local["spec"]["clusterQueue"] == cq["metadata"]["name"]
    covered = set(cq["spec"]["resourceGroups"][0]["coveredResources"])
    assert {"cpu", "memory", "nvidia.com/gpu", "vpc.amazonaws.com/efa"} <= covered
    # The 70B example's queue is this LocalQueue.
    big = manifest.load(ROOT / "examples" / "llama2-70b-full.yaml")[0]
    assert big["spec"]["scheduling"]["queue"] == local["metadata"]["name"]

    job = tiny_job("queued", scheduling={"queue": local["metadata"]["name"]})
    cluster.create_job(job, namespace=namespace)
    cluster.wait(lambda: len(job_pods(cluster, "queued", namespace)) == 2, FLOOR, "2 queued pods")
    for pod in job_pods(cluster, "queued", namespace):
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "research"
        assert labels["kueue.x-k8s.io/pod-group-name"] == "queued-a0"
        assert annotations["kueue.x-k8s.io/pod-group-total-count"] == "2"


def test_kueue_schema_refuses_a_flavor_without_every_covered_resource(cluster, kubectl, kueue):
    """The transcribed schema is not a rubber stamp: a quota that misses a covered resource
    is refused, as Kueue's CRD refuses it."""
    bad = yaml.safe_dump(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta1",
            "kind": "ClusterQueue",
            "metadata": {"name": "short"},
            "spec": {
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "nvidia.com/gpu"],
                        "flavors": [
                            {"name": "x", "resources": [{"name": "cpu", "nominalQuota": 8}]}
                        ],
                    }
                ]
            },
        }
    )
    result = kubectl("apply", "--validate=false", "-f", "-", input=bad, ok=False)
    assert result.returncode != 0
    assert "flavors must have the same number of resources" in result.stderr
