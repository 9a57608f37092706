"""Every bad job is refused twice: by ftjob's validator and by the CRD (schema + CEL); every
job the API server takes as written (nulls, empty objects and lists) is taken by both.

Each corpus file names, in its `# expect:` line, the field both verdicts must point at, or
`valid`. A file with two documents is an update: the second is checked against the first.
tests/cluster/test_real_admission.py holds both verdicts to the real kube-apiserver's.
"""

import re
from pathlib import Path

import pytest

from ftjob.api import manifest
from ftjob.cli import validate

CORPUS = sorted((Path(__file__).resolve().parents[1] / "corpus").glob("*.yaml"))


def names(errors, field):
    return any(re.match(re.escape(field) + r"([.:\[]|$)", e) for e in errors)


def test_corpus_is_large_and_covers_every_kind_of_mistake():
    assert len(CORPUS) >= 40
    kinds = {p.name.split("-")[0] for p in CORPUS}
    assert kinds == {
        *("type", "range", "enum", "pattern", "unknown", "missing", "rule", "immutable"),
        *("null", "empty"),
    }


def expected(path: Path) -> str:
    return re.search(r"^# expect: (\S+)$", path.read_text(), re.M).group(1)


GOOD = [p for p in CORPUS if expected(p) == "valid"]
BAD = [p for p in CORPUS if expected(p) != "valid"]


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.stem)
def test_a_job_the_apiserver_takes_is_taken_by_both(path):
    checked = validate.check(manifest.load(path)[-1])
    assert checked.ok, (checked.errors, checked.server_errors)


def test_nulls_are_unset_fields_whose_defaults_hold():
    """A null is pruned before defaulting, at any depth: the job is the one without it."""
    nulls = manifest.load(CORPUS[0].parent / "null-optional-fields.yaml")[0]
    unset = manifest.load(CORPUS[0].parent / "null-optional-fields.yaml")[0]
    for section, key in [("model", "revision"), ("dataset", "evalFraction"),
                         ("dataset", "maxSeqLength"), ("method", "lora"),
                         ("training", "learningRate")]:  # fmt: skip
        del unset["spec"][section][key]
    del unset["spec"]["env"], unset["spec"]["image"]
    assert validate.check(nulls).spec == validate.check(unset).spec
    assert validate.check(nulls).spec.dataset.max_seq_length == 2048


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_job_is_refused_by_both_naming_the_field(path):
    expect = expected(path)
    docs = manifest.load(path)
    old = docs[0] if len(docs) == 2 else None
    checked = validate.check(docs[-1], old)
    assert names(checked.errors, expect), checked.errors
    assert names(checked.server_errors, expect), checked.server_errors
    # One defect, one message: the validator does not bury the cause in follow-on errors.
    assert len(checked.errors) == 1, checked.errors


UPDATES = [p for p in CORPUS if p.name.startswith("immutable-")]


@pytest.mark.parametrize("path", UPDATES, ids=lambda p: p.stem)
def test_the_job_each_update_starts_from_is_valid(path):
    """Guards the update cases: only the change may be refused, not the job as it was."""
    old, _ = manifest.load(path)
    assert validate.check(old).ok


def test_the_corpus_base_job_is_valid():
    """Each corpus file is this job with one defect; the job itself must pass."""
    base = manifest.load(UPDATES[0])[0]
    assert validate.check(base).ok
    for path in CORPUS:
        doc = manifest.load(path)[-1]
        assert doc["apiVersion"] == base["apiVersion"] and doc["kind"] == base["kind"], path
