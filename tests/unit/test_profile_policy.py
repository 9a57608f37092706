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
from ftjob.api.profile import (
    NAMESPACE_LABEL,
    NoProfile,
    NotServed,
    apply,
    choose,
    parse_profile,
)

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
    """The Python check's refusals; a profile named from a namespace it does not serve is
    refused for that, and the door lists the limits it breaks too (the operator stops at
    the first)."""
    parsed = [parse_profile(d) for d in profiles]
    first = []
    try:
        chosen = choose(job["spec"].get("profile"), "ns", labels, parsed)
    except NotServed as e:
        first, chosen = [str(e)], next(p for p in parsed if p.name == job["spec"]["profile"])
    if chosen is None:
        return []
    found = apply(job, chosen).violations
    return first + [str(e) for e in found if e.path != "spec.checkpoint.volume"]


def team(name: str, selector: dict | None, nameable: str = "Selected", prices=(), **limits) -> dict:
    doc = copy.deepcopy(TEAM_A)
    doc["metadata"] = {"name": name}
    doc["spec"]["nameableFrom"] = nameable
    doc["spec"]["limits"] = limits
    doc["spec"]["prices"] = [{"gpuType": t, "perGpuHour": 2.5} for t in prices]
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
        allowedServiceAccounts=["trainer-irsa"],
        prices=("A100-80GB",),
    ),
    team("team-b", None, allowedImagePrefixes=["registry.example.com/b/", "quay.io/b"]),
    team("anywhere", None, "Anywhere", maxNodes=1),
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
    "money": {"budget": {"amount": 100}},
    "money-unpriced": {
        "budget": {"amount": 100},
        "resources": {"nodes": 1, "gpusPerNode": 8, "gpuType": "H100-SXM-80GB"},
    },
    "named-anywhere": {"profile": "anywhere"},
    # quay.io/b (no / at its end) on a boundary: a path, a tag or a digest, not a longer name.
    "image-path": {"image": "quay.io/b/trainer:1"},
    "image-tag": {"image": "quay.io/b:1"},
    "image-digest": {"image": "quay.io/b@sha256:" + "0" * 64},
    "image-longer": {"image": "quay.io/b.evil.io/trainer:1"},
    "image-longer-slash": {"image": "registry.example.com/bb/trainer:1"},
    # An identity: team-a allows one by name; team-b lists none, so allows none.
    "identity-allowed": {"serviceAccountName": "trainer-irsa"},
    "identity-other": {"serviceAccountName": "platform-admin"},
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


def gpu_job(**spec) -> dict:
    job = copy.deepcopy(GPU_JOB)
    job["spec"].update(spec)
    job["spec"]["method"].pop("quantization", None)
    return job


def test_a_job_may_name_only_a_profile_that_serves_its_namespace():
    named = gpu_job(profile="team-b")
    said = (
        "spec.profile: FineTuneProfile team-b does not serve namespace ns (neither its "
        "namespaceSelector nor the namespace's label ftjob.dev/profile selects it); fix: name "
        "the namespace's own profile or none, or ask the platform team to label namespace ns "
        "ftjob.dev/profile=team-b or to set nameableFrom: Anywhere on FineTuneProfile team-b"
    )
    assert door(named, PROFILES, LABELS["selected"])[0] == said  # then team-b's image limit
    parsed = [parse_profile(d) for d in PROFILES]
    with pytest.raises(NotServed) as refused:
        choose("team-b", "ns", LABELS["selected"], parsed)
    assert str(refused.value) == said
    # The namespace labelled for team-b may name it; team-a serves its selector's namespaces.
    named["spec"]["image"] = "quay.io/b/trainer:1"
    assert door(named, PROFILES, LABELS["labelled-b"]) == []
    assert choose("team-a", "ns", LABELS["selected"], parsed).name == "team-a"
    # A profile nameable from anywhere: its limits, from any namespace.
    anywhere = gpu_job(profile="anywhere")
    for labels in LABELS.values():
        assert choose("anywhere", "ns", labels, parsed).name == "anywhere"
        assert [m.split(":")[0] for m in door(anywhere, PROFILES, labels)] == [
            "spec.resources.nodes"
        ]


def test_an_image_prefix_matches_on_a_registry_or_path_boundary():
    """quay.io/b allows its paths, tags and digests, never quay.io/b.evil.io; a prefix ending
    in / (registry.example.com/b/) matches as written."""
    labels = LABELS["labelled-b"]
    verdicts = {
        name: bool(door(gpu_job(**JOBS[name]), PROFILES, labels))
        for name in JOBS
        if name.startswith("image-")
    }
    assert verdicts == {
        "image-path": False,
        "image-tag": False,
        "image-digest": False,
        "image-longer": True,
        "image-longer-slash": True,
    }
    assert door(gpu_job(**JOBS["image-longer"]), PROFILES, labels) == [
        "spec.image: quay.io/b.evil.io/trainer:1 is not under limits.allowedImagePrefixes of "
        "FineTuneProfile team-b; fix: use an image starting with registry.example.com/b/ or "
        "quay.io/b"
    ]


def test_a_money_budget_needs_a_price_for_the_jobs_gpu_type():
    selected = LABELS["selected"]
    assert door(gpu_job(**JOBS["money"]), PROFILES, selected) == []  # A100-80GB is priced
    assert door(gpu_job(**JOBS["money-unpriced"]), PROFILES, selected) == [
        "spec.budget.amount: a budget in money needs a price, and FineTuneProfile team-a has "
        "no price for gpuType H100-SXM-80GB; fix: set budget.gpuHours instead, or ask the "
        "platform team to add that gpuType to prices of FineTuneProfile team-a"
    ]


EDITS = {
    # field edited: (its value over a limit, the limit's words)
    "image": ({"image": "docker.io/evil/miner"}, "spec.image: docker.io/evil/miner is not"),
    "method": ({"method": {"type": "qlora"}}, "spec.method.type: qlora is not in"),
    "budget": ({"budget": {"gpuHours": 250}}, "spec.budget.gpuHours: 250 GPU-hours exceed"),
    "amount": (JOBS["money-unpriced"], "spec.budget.amount: a budget in money needs a price"),
    "profile": ({"profile": "team-b"}, "spec.profile: FineTuneProfile team-b does not serve"),
    "identity": (JOBS["identity-other"], "spec.serviceAccountName: platform-admin is not in"),
}


def test_a_job_runs_as_a_service_account_only_where_its_profile_names_it():
    selected, labelled_b = LABELS["selected"], LABELS["labelled-b"]
    assert door(gpu_job(**JOBS["identity-allowed"]), PROFILES, selected) == []
    assert door(gpu_job(**JOBS["identity-other"]), PROFILES, selected) == [
        "spec.serviceAccountName: platform-admin is not in limits.allowedServiceAccounts of "
        "FineTuneProfile team-a; fix: use serviceAccountName trainer-irsa, or ask the platform "
        "team to add it to limits.allowedServiceAccounts"
    ]
    b_job = gpu_job(**JOBS["identity-allowed"], image="quay.io/b/trainer:1")
    assert door(b_job, PROFILES, labelled_b) == [
        "spec.serviceAccountName: trainer-irsa is not in limits.allowedServiceAccounts of "
        "FineTuneProfile team-b; fix: ask the platform team to add it to "
        "limits.allowedServiceAccounts"
    ]


@pytest.mark.parametrize("field", EDITS)
def test_an_edit_that_breaks_a_limit_is_refused_with_the_words_of_a_create(field):
    """One rule: a check runs on an update that changes a field it reads. The edited job is
    refused as a new one with the same spec would be, word for word."""
    team_a = copy.deepcopy(PROFILES[0])
    team_a["spec"]["limits"]["allowedImagePrefixes"] = ["registry.example.com/ml/"]
    profiles = [team_a, team("team-b", None, allowedImagePrefixes=["quay.io/b/"])]
    labels = LABELS["selected"]
    one_node = {"nodes": 1, "gpusPerNode": 8, "gpuType": "A100-80GB"}
    old = gpu_job(resources=one_node, image="registry.example.com/ml/trainer:1")
    assert door(old, profiles, labels) == []
    edit, words = EDITS[field]
    new = copy.deepcopy(old)
    new["spec"].update(copy.deepcopy(edit))
    created = door(new, profiles, labels)
    assert any(m.startswith(words) for m in created), created
    assert door(new, profiles, labels, old) == created


def test_a_limit_lowered_later_refuses_no_edit_that_leaves_its_fields_alone():
    """team-a allows 2 nodes; this job (3) was let in before that. Suspending it passes; an
    edit of its image is held to the image limit alone; naming its profile anew (spec.profile
    changed) re-reads every limit."""
    old = gpu_job(**JOBS["nodes"], budget={"gpuHours": 10})
    selected = LABELS["selected"]
    assert len(door(old, PROFILES, selected)) == 1  # on create: maxNodes
    suspended = copy.deepcopy(old)
    suspended["spec"]["runPolicy"] = {"suspend": True}
    assert door(suspended, PROFILES, selected, old) == []
    reimaged = copy.deepcopy(old)
    reimaged["spec"]["image"] = "registry.example.com/ml/trainer:2"
    assert door(reimaged, PROFILES, selected, old) == []
    raised = copy.deepcopy(old)
    raised["spec"]["budget"] = {"gpuHours": 100}
    assert door(raised, PROFILES, selected, old) == []
    renamed = copy.deepcopy(old)
    renamed["spec"]["profile"] = "team-a"
    assert [m.split(":")[0] for m in door(renamed, PROFILES, selected, old)] == [
        "spec.resources.nodes"
    ]


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
