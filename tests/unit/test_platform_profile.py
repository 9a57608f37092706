"""FineTuneProfile (ftjob/api/profile.py): the pure merge of a profile's defaults under a job,
its limits, which profile a job takes, and the generated CRD."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kubernetes_validate
import pytest

from ftjob.api import admission, crd, manifest, profile
from ftjob.api.jobspec import parse_resource
from ftjob.api.profile import NAMESPACE_LABEL, NoProfile, NotServed, apply, choose, parse_profile
from ftjob.api.schema import SpecError
from ftjob.cli import validate
from ftjob.cli.commands import main

ROOT = Path(__file__).resolve().parents[2]
TEAM_A = ROOT / "examples" / "profiles" / "team-a.yaml"
TINY = ROOT / "examples" / "tiny.yaml"


def load(path: Path) -> dict:
    return manifest.load(str(path))[0]  # YAML as kubectl reads it (5e-5 is a number)


def team_a(**limits) -> profile.Profile:
    doc = load(TEAM_A)
    doc["spec"]["limits"].update(limits)
    return parse_profile(doc)


def gpu_job(nodes: int = 2, gpus: int = 8, **spec) -> dict:
    doc = load(ROOT / "examples" / "llama3-8b-lora-efa.yaml")
    doc["spec"]["resources"].update(nodes=nodes, gpusPerNode=gpus)
    doc["spec"].update(spec)
    return doc


def test_a_default_fills_only_what_the_job_leaves_unset():
    job = gpu_job()
    job["spec"].pop("image", None)
    job["spec"]["scheduling"] = {"priorityClassName": "urgent", "nodeSelector": {"zone": "b"}}
    job["spec"]["env"] = [{"name": "HF_HUB_ENABLE_HF_TRANSFER", "value": "0"}]
    merged = apply(job, team_a()).doc["spec"]
    assert merged["image"] == "registry.example.com/ml/ftjob-trainer:0.1.0"  # unset: the default
    s = merged["scheduling"]
    assert s["priorityClassName"] == "urgent"  # the job's wins
    assert s["queue"] == "team-a"  # unset: the profile's
    assert s["nodeSelector"] == {"zone": "b", "node.example.com/pool": "gpu"}  # key by key
    assert s["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert merged["env"] == [{"name": "HF_HUB_ENABLE_HF_TRANSFER", "value": "0"}]  # by name
    assert merged["resources"]["gpuType"] == job["spec"]["resources"]["gpuType"]  # job set it
    # The merged document is a job the job's own check and the API server's schema accept.
    checked = validate.check(apply(job, team_a()).doc)
    assert checked.ok, checked.errors + checked.server_errors
    assert checked.spec.scheduling.queue == "team-a"


def test_the_merge_leaves_its_inputs_alone_and_is_idempotent():
    job, p = gpu_job(), team_a()
    before = copy.deepcopy(job)
    once = apply(job, p).doc
    assert job == before
    assert apply(once, p).doc == once


def test_lists_add_up_and_affinity_is_taken_whole():
    default = {"tolerations": [{"key": "a"}], "affinity": {"nodeAffinity": {"x": [1]}}}
    job = {"tolerations": [{"key": "b"}, {"key": "a"}], "affinity": {"podAffinity": {}}}
    merged = profile.merge(default, job)
    assert merged["tolerations"] == [{"key": "b"}, {"key": "a"}]
    assert merged["affinity"] == {"podAffinity": {}}  # two affinities would OR their terms


def test_a_cpu_job_is_not_given_the_profiles_gpu_type():
    merged = apply(load(TINY), team_a())
    assert "gpuType" not in merged.doc["spec"]["resources"]
    assert validate.check(merged.doc, job_file=str(TINY)).ok


def test_every_limit_names_itself_the_profile_and_the_fix():
    job = gpu_job(nodes=8, gpus=8, image="docker.io/someone/trainer:latest")
    p = team_a(allowedMethods=["full", "qlora"])
    found = {e.path: str(e) for e in apply(job, p).violations}
    assert set(found) == {
        "spec.resources.nodes",
        "spec.resources.gpusPerNode",
        "spec.image",
        "spec.method.type",
    }
    assert "limits.maxNodes 4 of FineTuneProfile team-a" in found["spec.resources.nodes"]
    assert "fix: set resources.nodes to at most 4" in found["spec.resources.nodes"]
    assert (
        "64 GPUs (8 nodes x 8) exceed limits.maxGpusPerJob 32"
        in found["spec.resources.gpusPerNode"]
    )
    assert "fix: use an image starting with registry.example.com/ml/" in found["spec.image"]
    assert "fix: use method.type full or qlora" in found["spec.method.type"]


def test_a_job_within_the_limits_has_no_violation_and_the_edge_is_allowed():
    assert apply(gpu_job(nodes=4, gpus=8), team_a()).violations == []


def test_a_limit_is_never_overridden_by_the_job():
    # The image limit holds the operator's default image too, when neither job nor profile
    # names one; a job cannot carry limits of its own (the schema refuses the key).
    doc = load(TEAM_A)
    del doc["spec"]["defaults"]["image"]
    job = gpu_job()
    job["spec"].pop("image", None)
    found = apply(job, parse_profile(doc), default_image="ghcr.io/ftjob/trainer:0.1.0")
    assert [e.path for e in found.violations] == ["spec.image"]
    job["spec"]["limits"] = {"maxNodes": 100}
    with pytest.raises(SpecError, match="spec.limits: unknown field"):
        parse_resource(apply(job, team_a()).doc)


def test_spec_profile_then_the_namespace_label_then_a_selector():
    a, b = team_a(), parse_profile(load(TEAM_A) | {"metadata": {"name": "team-b"}})
    both = [a, b]
    b.spec.namespace_selector.match_labels.clear()
    assert choose("team-b", "ns", {"team": "a", NAMESPACE_LABEL: "team-b"}, both) is b
    # Named from a namespace it does not serve (no selector matches, no label names it).
    with pytest.raises(NotServed, match="FineTuneProfile team-b does not serve namespace ns"):
        choose("team-b", "ns", {"team": "a"}, both)
    assert choose(None, "ns", {"team": "a", NAMESPACE_LABEL: "team-b"}, both) is b
    assert choose(None, "ns", {"team": "a"}, both) is a
    assert choose(None, "ns", {"team": "c"}, both) is None
    with pytest.raises(NoProfile, match="spec.profile names FineTuneProfile gone"):
        choose("gone", "ns", {}, both)
    b.spec.namespace_selector.match_labels["team"] = "a"
    with pytest.raises(NoProfile, match="several FineTuneProfiles \\(team-a, team-b\\)"):
        choose(None, "ns", {"team": "a"}, both)


def test_a_bad_profile_is_refused_naming_its_fields():
    doc = load(TEAM_A)
    doc["spec"]["limits"]["maxNodes"] = 0
    doc["spec"]["defaults"]["scheduling"]["topology"] = "rack"
    del doc["spec"]["defaults"]["scheduling"]["queue"]
    with pytest.raises(SpecError) as e:
        parse_profile(doc)
    paths = {x.path for x in e.value.errors}
    assert paths == {"spec.limits.maxNodes", "spec.defaults.scheduling.topology"}


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_the_profile_crd_validates_against_kubernetes_schema(version):
    kubernetes_validate.validate(crd.profile_crd(), version, strict=True)
    assert crd.profile_crd()["spec"]["scope"] == "Cluster"


def test_the_api_server_schema_and_ftjob_agree_on_the_sample_and_a_bad_profile():
    schema = crd.profile_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    _, errors = admission.admit(schema, load(TEAM_A))
    assert errors == []
    bad = load(TEAM_A)
    bad["spec"]["limits"]["allowedMethods"] = ["dpo"]
    _, errors = admission.admit(schema, bad)
    assert any("allowedMethods" in e for e in errors), errors
    with pytest.raises(SpecError, match="allowedMethods"):
        parse_profile(bad)


def test_committed_profile_crd_copies_equal_the_generator():
    for path in ("manifests/profile-crd.yaml", "charts/ftjob/crds/finetuneprofiles.ftjob.dev.yaml"):
        assert (ROOT / path).read_text() == crd.render_profile_yaml(), path


def over_limit_file(tmp_path: Path) -> Path:
    """The tiny CPU job with 6 nodes (team-a allows 4), beside the tiny model it names."""
    text = TINY.read_text().replace("nodes: 2", "nodes: 6")
    path = tmp_path / "big.yaml"
    path.write_text(text)
    for name in ("tiny-model", "data"):
        (tmp_path / name).symlink_to(ROOT / "examples" / name)
    return path


def test_validate_plan_and_run_refuse_a_job_over_a_limit_of_the_profile(tmp_path, capsys):
    big = str(over_limit_file(tmp_path))
    want = "spec.resources.nodes: 6 nodes exceed limits.maxNodes 4 of FineTuneProfile team-a"
    for command in (["validate"], ["plan"], ["run", "--workdir", str(tmp_path / "run")]):
        assert main([*command, "--profile", str(TEAM_A), big]) == 1, command
        said = capsys.readouterr()
        assert want in said.out + said.err, command
    # Without the profile the same job is valid: the limit is the profile's, not the job's.
    assert main(["validate", big]) == 0
    assert not (tmp_path / "run").exists()  # run started nothing


def test_validate_plan_and_run_refuse_a_profile_file_that_cannot_be_read(tmp_path, capsys):
    """A bad --profile FILE is an error naming the file and each bad field with what it must
    be, as the operator refuses a job whose profile cannot be read; never run without it."""
    doc = load(TEAM_A)
    doc["spec"]["limits"]["maxNodes"] = 0
    bad = tmp_path / "bad-profile.yaml"
    bad.write_text(json.dumps(doc))
    want = f"{bad}: spec.limits.maxNodes: must be an integer between 1 and 1024, got 0"
    for command in (["validate"], ["plan"], ["run", "--workdir", str(tmp_path / "run")]):
        assert main([*command, "--profile", str(bad), str(TINY)]) == 1, command
        said = capsys.readouterr()
        assert want in said.out + said.err, command
    assert not (tmp_path / "run").exists()  # run started nothing


def test_validate_says_which_profile_it_applied_and_render_shows_the_merged_job(capsys):
    assert main(["validate", "-o", "json", "--profile", str(TEAM_A), str(TINY)]) == 0
    result = json.loads(capsys.readouterr().out)["items"][0]
    assert result["valid"] and result["profile"]["name"] == "team-a"
    assert result["profile"]["generation"] == 1
    assert main(["render", "-o", "json", "--profile", str(TEAM_A), str(TINY)]) == 0
    job = json.loads(capsys.readouterr().out)["items"][0]
    assert job["spec"]["scheduling"]["queue"] == "team-a"
    assert job["spec"]["image"] == "registry.example.com/ml/ftjob-trainer:0.1.0"


def test_a_job_naming_another_profile_is_refused_with_the_fix(tmp_path, capsys):
    doc = load(TINY)
    doc["spec"]["profile"] = "team-b"
    path = tmp_path / "named.yaml"
    path.write_text(json.dumps(doc))
    assert main(["validate", "--profile", str(TEAM_A), str(path)]) == 1
    out = capsys.readouterr().out
    assert "spec.profile: names FineTuneProfile team-b, but the profile given is team-a" in out


def test_a_multi_node_job_may_take_its_volume_from_the_profile_it_names_and_only_then():
    job = load(TINY)
    del job["spec"]["checkpoint"]["volume"]
    assert not validate.check(job).ok  # the door: two nodes and no volume, no profile named
    job["spec"]["profile"] = "team-a"
    assert validate.check(job).ok  # the door lets it in for its profile ...
    merged = apply(job, team_a())
    assert merged.violations == []  # ... which gives the volume
    assert merged.doc["spec"]["checkpoint"]["volume"] == {"claimName": "ftjob-shared"}
    bare = load(TEAM_A)
    del bare["spec"]["defaults"]["checkpoint"]
    found = apply(job, parse_profile(bare)).violations
    assert [e.path for e in found] == ["spec.checkpoint.volume"]
    assert "neither the job nor defaults.checkpoint.volume of FineTuneProfile team-a" in str(
        found[0]
    )


def test_the_profiles_pull_secrets_reach_the_pods_beside_the_jobs_own():
    from ftjob.operator import render

    job = gpu_job()
    job["spec"]["imagePullSecrets"] = [{"name": "team-registry"}]
    checked = validate.check(apply(job, team_a()).doc)
    assert checked.ok, checked.errors + checked.server_errors
    pod = render.pod("j", "ns", checked.spec, 0, 0, "uid")
    assert pod["spec"]["imagePullSecrets"] == [
        {"name": "registry-example-com"},
        {"name": "team-registry"},
    ]


def operator_merge(doc: dict, profile_doc: dict) -> dict:
    """The operator's merge, fed what it is fed on a cluster: the job and the profile as the
    API server stores them (each defaulted by its CRD's schema)."""
    from ftjob.operator.profiles import take

    stored, errors = admission.admit(crd.schema(), copy.deepcopy(doc))
    assert errors == []
    profile_schema = crd.profile_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stored_profile, errors = admission.admit(profile_schema, copy.deepcopy(profile_doc))
    assert errors == []
    stored["metadata"]["namespace"] = "team-a-ns"
    return take(stored, {"team": "a"}, [stored_profile], None).doc


def test_the_cli_and_the_operator_merge_a_job_into_the_same_spec():
    """``ftjob validate/plan/run --profile`` (validate.with_profile, on the job file) and the
    operator (profiles.take, on the job as stored) give the same spec, down to the fields the
    CRD's schema defaults inside objects both sides set: tracking.mlflow.experiment, a
    secret ref's key."""
    job = gpu_job()
    job["spec"]["tracking"] = {"mlflow": {"trackingUri": "http://mlflow.team:5000"}}
    job["spec"]["secrets"] = {"huggingFaceToken": {"name": "own-hf"}}
    team = load(TEAM_A)
    team["spec"]["defaults"]["tracking"] = {
        "mlflow": {"trackingUri": "http://mlflow.mlflow:5000", "experiment": "team-a-runs"}
    }
    team["spec"]["defaults"]["secrets"] = {"huggingFaceToken": {"name": "hf", "key": "hf-token"}}
    by_cli, refused, _ = validate.with_profile(copy.deepcopy(job), parse_profile(team))
    assert refused == []
    by_operator = operator_merge(job, team)
    cli_spec, operator_spec = parse_resource(by_cli)[1], parse_resource(by_operator)[1]
    assert cli_spec == operator_spec
    # What the job wrote won; what it left to the schema stays the schema's on both sides.
    assert cli_spec.tracking.mlflow.tracking_uri == "http://mlflow.team:5000"
    assert cli_spec.tracking.mlflow.experiment == "ftjob"
    assert cli_spec.secrets.hugging_face_token.name == "own-hf"
    assert cli_spec.secrets.hugging_face_token.key == "token"
    assert cli_spec.scheduling.queue == "team-a"  # a default the job left unset, both sides
