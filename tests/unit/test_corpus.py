"""Every bad job is refused twice: by ftjob's validator and by the CRD (schema + CEL).

Each corpus file names, in its `# expect:` line, the field both verdicts must point at. A
file with two documents is an update: the second is checked against the first.
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
    assert kinds == {"type", "range", "enum", "pattern", "unknown", "missing", "rule", "immutable"}


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_bad_job_is_refused_by_both_naming_the_field(path):
    expect = re.search(r"^# expect: (\S+)$", path.read_text(), re.M).group(1)
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
