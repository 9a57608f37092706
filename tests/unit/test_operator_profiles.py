"""operator/profiles.py: which profile the operator applies to a job, what status records, what
refuses a job, and that a profile edited later leaves the job's pinned sections alone."""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from pathlib import Path

from ftjob.api import manifest
from ftjob.api.profile import NAMESPACE_LABEL
from ftjob.operator import lifecycle
from ftjob.operator.profiles import take

ROOT = Path(__file__).resolve().parents[2]
TEAM_A = manifest.load(ROOT / "examples" / "profiles" / "team-a.yaml")[0]
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]


def job(**spec) -> dict:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": "tiny", "namespace": "team-a-ns", "generation": 1}
    doc["spec"].pop("checkpoint")  # the profile's volume, then
    doc["spec"].update(spec)
    return doc


def profile(generation: int = 1, **defaults) -> dict:
    doc = copy.deepcopy(TEAM_A)
    doc["metadata"]["generation"] = generation
    doc["spec"]["defaults"].update(defaults)
    return doc


def test_the_namespace_label_picks_the_profile_and_status_records_its_generation():
    taken = take(job(), {NAMESPACE_LABEL: "team-a"}, [profile(3)], None)
    assert taken.refused == []
    assert taken.doc["spec"]["scheduling"]["queue"] == "team-a"
    assert taken.record == {
        "name": "team-a",
        "generation": 3,
        "pinned": {"checkpoint": {"volume": {"claimName": "ftjob-shared"}}},
    }


def test_no_profile_applies_and_the_job_is_left_as_written():
    taken = take(job(), {"team": "b"}, [profile()], None)
    assert taken.doc == job() and taken.record is None and taken.refused == []


def test_over_a_limit_the_job_is_failed_before_any_pod_with_limit_profile_and_fix():
    taken = take(job(resources={"nodes": 6, "gpusPerNode": 0}), {"team": "a"}, [profile()], None)
    assert taken.reason == "OverLimit"
    decision = lifecycle.invalid(taken.refused, 1, None, datetime.now(timezone.utc), taken.reason)
    assert decision.create == [] and decision.status["phase"] == "Failed"
    failed = decision.status
    assert failed["failure"]["reason"] == "OverLimit"
    assert "limits.maxNodes 4 of FineTuneProfile team-a" in failed["failure"]["message"]
    assert "fix: set resources.nodes to at most 4" in failed["failure"]["message"]


def test_a_job_naming_a_missing_profile_is_refused_saying_which_exist():
    taken = take(job(profile="team-z"), {}, [profile()], None)
    assert taken.reason == "NoProfile"
    assert "FineTuneProfile team-z, which does not exist" in taken.refused[0]
    assert "team-a" in taken.refused[0]


def test_a_profile_that_cannot_be_read_refuses_its_jobs_naming_it_the_field_and_the_fix():
    """Named by spec.profile, by the namespace's label, or selecting the namespace: an
    unreadable profile (another ftjob version's) is never skipped as if absent; a job it does
    not concern runs on."""
    bad = profile()
    bad["spec"]["limits"]["maxNodes"] = 0  # the parser's bound (minimum 1)
    for labels, spec in (({}, {"profile": "team-a"}), ({NAMESPACE_LABEL: "team-a"}, {}),
                         ({"team": "a"}, {})):  # fmt: skip
        taken = take(job(**spec), labels, [bad], None)
        assert taken.reason == "InvalidProfile", (labels, spec)
        [said] = taken.refused
        assert "FineTuneProfile team-a, which cannot be read: spec.limits.maxNodes: " in said
        assert "fix the profile (kubectl edit ftp team-a) or name another" in said
        decision = lifecycle.invalid(taken.refused, 1, None, datetime.now(timezone.utc), "x")
        assert decision.create == [] and said in decision.status["failure"]["message"]
    assert take(job(), {"team": "b"}, [bad], None).refused == []


def test_a_profile_edited_later_fails_no_job_taken_and_keeps_its_volume():
    first = take(job(), {"team": "a"}, [profile(1)], None)
    status = {"profile": first.record | {"attempt": 0}, "phase": "Running"}
    edited = profile(
        2, checkpoint={"volume": {"claimName": "elsewhere"}}, image="registry.example.com/ml/t:2"
    )
    edited["spec"]["limits"]["maxNodes"] = 1  # tiny has 2 nodes: over it now
    later = take(job(), {"team": "a"}, [edited], status)
    assert later.refused == []  # let in under generation 1: not failed by generation 2
    # ... but its next gang is not made: handlers._decide fails it with these, then.
    assert later.reason == "OverLimit" and len(later.over) == 1
    assert "2 nodes exceed limits.maxNodes 1 of FineTuneProfile team-a" in later.over[0]
    assert later.doc["spec"]["checkpoint"]["volume"] == {"claimName": "ftjob-shared"}  # pinned
    assert later.doc["spec"]["image"] == "registry.example.com/ml/t:2"  # the next gang's
    assert later.record["generation"] == 2
    # The profile deleted: the job runs on with what it pinned.
    gone = take(job(), {"team": "a"}, [], status)
    assert gone.refused == [] and gone.doc["spec"]["checkpoint"]["volume"]["claimName"] == (
        "ftjob-shared"
    )


def test_a_named_profile_that_stops_serving_the_namespace_refuses_the_next_gang_only():
    """Named from a namespace its selector matched; the namespace relabelled since: the
    running gang is left alone, the next one is refused saying why and what to do."""
    first = take(job(profile="team-a"), {"team": "a"}, [profile()], None)
    assert first.refused == [] and first.over == []
    status = {"profile": first.record | {"attempt": 0}, "phase": "Running"}
    later = take(job(profile="team-a"), {"team": "b"}, [profile()], status)
    assert later.refused == [] and later.reason == "NotServed"
    [said] = later.over
    assert "FineTuneProfile team-a does not serve namespace team-a-ns" in said
    assert "ftjob.dev/profile=team-a or to set nameableFrom: Anywhere" in said
    never = take(job(profile="team-a"), {"team": "b"}, [profile()], None)
    assert never.refused == [said] and never.reason == "NotServed"
