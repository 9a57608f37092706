"""Names that fit, proven by the real kube-apiserver: a job name of 52 characters (the CRD's
limit) yields children every one of which the server admits -- pod names and hostnames of the
highest rank, the headless Service, the ConfigMap, every label value including the Kueue group
label ``<job>-a<attempt>`` at the largest attempt the restart budget allows; 53 is refused at
the door with the limit named."""

from __future__ import annotations

import copy
import json

import pytest
from plane import ROOT

from ftjob.api import manifest
from ftjob.cli import validate
from ftjob.operator import render

NAMESPACE = "names"
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
MAX_NODES, MAX_BACKOFF = 1024, 100  # spec.resources.nodes' and runPolicy.backoffLimit's maxima


def job(name: str) -> dict:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    doc["spec"]["resources"] = {"nodes": MAX_NODES, "gpusPerNode": 8}
    doc["spec"]["runPolicy"] = {"backoffLimit": MAX_BACKOFF}
    doc["spec"]["scheduling"] = {"queue": "team-a"}
    return doc


@pytest.fixture(scope="module")
def names(installed):
    installed.namespace(NAMESPACE, volume=None)
    return installed


def test_a_52_character_job_yields_children_the_server_admits(names):
    name = "j" + "x" * 50 + "z"
    assert len(name) == 52
    names.apply(job(name))
    uid = names.get("ftj", name, NAMESPACE)["metadata"]["uid"]
    spec = validate.check(job(name)).spec
    # The longest names: the ConfigMap, the Service, and pods of rank 0 and the highest rank,
    # of the last attempt the budget allows (attempt 0 plus backoffLimit restarts).
    config_map, service = (
        render.config_map(name, NAMESPACE, spec, uid),
        render.service(name, NAMESPACE, spec, uid),
    )
    last = [render.pod(name, NAMESPACE, spec, r, MAX_BACKOFF, uid) for r in (0, MAX_NODES - 1)]
    objs = [config_map, service, *last]
    group = last[-1]["metadata"]["labels"][render.KUEUE_GROUP]
    assert group == f"{name}-a{MAX_BACKOFF}" and len(group) <= 63
    assert last[-1]["spec"]["hostname"] == f"{name}-node-{MAX_NODES - 1}"
    text = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
    names.kubectl("apply", "--dry-run=server", "-f", "-", input=text)


def test_a_53_character_job_is_refused_naming_the_limit(names):
    name = "j" + "x" * 51 + "z"
    result = names.apply(job(name), "--dry-run=server", ok=False)
    assert result.returncode != 0
    assert "metadata.name" in result.stderr and "52" in result.stderr, result.stderr
