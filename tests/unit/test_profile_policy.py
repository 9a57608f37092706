"""The profiles' ValidatingAdmissionPolicy (ftjob/api/policy.py) says what the merge's limits
(ftjob/api/profile.py) say: the same jobs refused, in the same words, by the same profile.
Its CEL runs here in the cel library (Kubernetes' strings extension's join() supplied as a
function); tests/cluster/test_real_profiles.py holds the real kube-apiserver to it."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import cel
import pytest

from ftjob.api import manifest, policy
from ftjob.api.profile import NAMESPACE_LABEL, NoProfile, apply, choose, parse_profile

ROOT = Path(__file__).resolve().parents[2]
TEAM_A = manifest.load(ROOT / "examples" / "profiles" / "team-a.yaml")[0]
GPU_JOB = manifest.load(ROOT / "examples" / "llama3-8b-lora-efa.yaml")[0]
FUNCTIONS = {"join": lambda items, sep: sep.join(items)}


def door(
    job: dict, profiles: list[dict], labels: dict[str, str], old: dict | None = None
) -> list[str]:
    """The messages of every validation that fails, over every profile as a param (an
    update of ``old`` when given)."""
    p = policy.policy()["spec"]
    namespace = {"metadata": {"name": "ns", "labels": labels}}
    request = {"operation": "UPDATE" if old else "CREATE"}
    out = []
    for params in profiles:
        ctx = {"object": job, "params": params, "namespaceObject": namespace, "request": request}
        ctx |= {"oldObject": old} if old else {}
        variables = {}
        for v in p["variables"]:
            env = cel.Context(variables=ctx | {"variables": variables}, functions=FUNCTIONS)
            variables[v["name"]] = cel.evaluate(v["expression"], env)
        env = cel.Context(variables=ctx | {"variables": variables}, functions=FUNCTIONS)
        for check in p["validations"]:
            if not cel.evaluate(check["expression"], env):
                out.append(cel.evaluate(check["messageExpression"], env))
    return out


def merge_says(job: dict, profiles: list[dict], labels: dict[str, str]) -> list[str]:
    parsed = [parse_profile(d) for d in profiles]
    chosen = choose(job["spec"].get("profile"), "ns", labels, parsed)
    if chosen is None:
        return []
    found = apply(job, chosen).violations
    return [str(e) for e in found if e.path != "spec.checkpoint.volume"]


def team(name: str, selector: dict | None, **limits) -> dict:
    doc = copy.deepcopy(TEAM_A)
    doc["metadata"] = {"name": name}
    doc["spec"]["limits"] = limits
    if selector is None:
        del doc["spec"]["namespaceSelector"]
    else:
        doc["spec"]["namespaceSelector"] = {"matchLabels": selector}
    return doc


PROFILES = [
    team(
        "team-a",
        {"team": "a"},
        maxNodes=2,
        maxGpusPerJob=16,
        maxGpuHoursPerJob=100.5,
        allowedMethods=["lora"],
    ),
    team("team-b", None, allowedImagePrefixes=["registry.example.com/b/", "ghcr.io/b/"]),
]
JOBS = {
    "within": {},
    "nodes": {"resources": {"nodes": 3, "gpusPerNode": 4, "gpuType": "H100-SXM-80GB"}},
    "gpus": {"resources": {"nodes": 2, "gpusPerNode": 16, "gpuType": "H100-SXM-80GB"}},
    "method": {"method": {"type": "qlora"}},
    "image": {"image": "docker.io/someone/trainer:1"},
    "named-b": {"profile": "team-b", "image": "docker.io/someone/trainer:1"},
    "named-a": {"profile": "team-a", "resources": {"nodes": 4, "gpusPerNode": 8}},
    "budget": {"budget": {"gpuHours": 250}},
    "budget-within": {"budget": {"gpuHours": 100.5}},
}
LABELS = {
    "selected": {"team": "a"},
    "labelled-b": {"team": "a", NAMESPACE_LABEL: "team-b"},
    "none": {"team": "c"},
}


@pytest.mark.parametrize(
    "job_name, labels_name", list(itertools.product(JOBS, LABELS)), ids="-".join
)
def test_the_door_refuses_what_the_merge_refuses_in_its_words(job_name, labels_name):
    job = copy.deepcopy(GPU_JOB)
    job["spec"].update(JOBS[job_name])
    job["spec"]["method"].pop("quantization", None)
    labels = LABELS[labels_name]
    try:
        want = merge_says(job, PROFILES, labels)
    except NoProfile:
        pytest.fail("no case here names a missing profile")
    assert door(job, PROFILES, labels) == want


def test_the_cases_above_are_refused_somewhere():
    """Guards the table: most combinations break a limit, so the equality means something."""
    refused = 0
    for job_name, labels in itertools.product(JOBS, LABELS.values()):
        job = copy.deepcopy(GPU_JOB)
        job["spec"].update(JOBS[job_name])
        refused += bool(door(job, PROFILES, labels))
    assert refused >= 10


def test_an_update_is_held_only_to_the_budget_cap_and_only_when_it_changes_the_budget():
    """A stopped job's budget raised over its profile's cap is refused with the cap, the
    profile and the fix; an edit leaving the budget alone passes whatever the limits say now
    (team-a's maxNodes 2 is broken by this job, as by one let in before it was lowered)."""
    old = copy.deepcopy(GPU_JOB)
    old["spec"].update(JOBS["nodes"] | {"budget": {"gpuHours": 10}})
    old["spec"]["method"].pop("quantization", None)
    selected = LABELS["selected"]
    assert len(door(old, PROFILES, selected)) == 1  # on create: maxNodes
    suspended = copy.deepcopy(old)
    suspended["spec"]["runPolicy"] = {"suspend": True}
    assert door(suspended, PROFILES, selected, old) == []
    raised = copy.deepcopy(old)
    raised["spec"]["budget"] = {"gpuHours": 250}
    assert door(raised, PROFILES, selected, old) == [
        "spec.budget.gpuHours: 250 GPU-hours exceed limits.maxGpuHoursPerJob 100.5 of "
        "FineTuneProfile team-a; fix: set budget.gpuHours to at most 100.5"
    ]
    raised["spec"]["budget"] = {"gpuHours": 100}
    assert door(raised, PROFILES, selected, old) == []


def test_the_policy_matches_creates_and_updates_of_jobs_not_their_status():
    rules = policy.policy()["spec"]["matchConstraints"]["resourceRules"]
    assert rules == [
        {
            "apiGroups": ["ftjob.dev"],
            "apiVersions": ["v1alpha1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["finetunejobs"],
        }
    ]
    assert policy.binding()["spec"]["paramRef"]["parameterNotFoundAction"] == "Allow"
