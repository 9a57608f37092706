"""s3:// sources in the spec, the pods and the cache's pure parts (the downloads themselves run
against a real server: tests/e2e/test_s3.py).

    python -m pytest tests/unit/test_s3_spec.py -q
"""

from __future__ import annotations

import pytest

from ftjob.api.jobspec import parse_spec
from ftjob.api.schema import SpecError
from ftjob.api.source import S3, Hub, Local, parse
from ftjob.operator import render, status
from ftjob.trainer.fetch import s3, storeerrors

UID = "0123456789abcdef"


def raw(**sections) -> dict:
    out = {
        "model": {"source": "s3://models/llama/8b"},
        "dataset": {"source": "s3://data-2026.team/sets/train.jsonl"},
        "training": {"maxSteps": 10},
    }
    return {**out, **sections}


def test_s3_sources_are_accepted_and_remote():
    spec = parse_spec(raw())
    model, data = parse(spec.model.source), parse(spec.dataset.source)
    assert model == S3("s3://models/llama/8b", "models", "llama/8b") and model.remote
    assert data == S3(spec.dataset.source, "data-2026.team", "sets/train.jsonl") and data.remote
    # One owner of the schemes (ftjob/api/source.py): the scheme at the start, nowhere else.
    assert parse("s3://bucket/hf://x") == S3("s3://bucket/hf://x", "bucket", "hf://x")
    assert parse("models/hf") == Local("models/hf") and not parse("models/hf").remote
    assert isinstance(parse("hf://org/name"), Hub) and parse("hf://org/name").remote


@pytest.mark.parametrize("bad", ["s3://My_Bucket/x", "s3://ab/x", "s3:///x", "s3://b c/x"])
def test_a_bucket_that_is_no_s3_bucket_name_is_refused_at_the_door(bad):
    with pytest.raises(SpecError) as e:
        parse_spec(raw(model={"source": bad}))
    assert "spec.model.source" in str(e.value) and "s3://bucket/prefix" in str(e.value)


def test_a_key_pair_comes_whole():
    ref = {"name": "s3", "key": "id"}
    with pytest.raises(SpecError) as e:
        parse_spec(raw(storage={"s3": {"accessKeyId": ref}}))
    assert "spec.storage.s3.accessKeyId" in str(e.value) and "set both" in str(e.value)


def test_pods_get_the_store_and_the_key_pair_only_as_secret_references():
    store = {
        "endpoint": "http://seaweedfs.storage:8333/",
        "region": "eu-west-1",
        "accessKeyId": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"},
        "secretAccessKey": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"},
    }
    spec = parse_spec(raw(storage={"s3": store}, resources={"gpusPerNode": 0}))
    c = render.pod("j", "ns", spec, 0, 0, UID)["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://seaweedfs.storage:8333"
    assert env["AWS_REGION"]["value"] == "eu-west-1"
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[var] == {"name": var, "valueFrom": {"secretKeyRef": {"name": "s3-creds",
                                                                        "key": var}}}  # fmt: skip
    # Without a key pair the pods keep their own AWS environment (a web identity token).
    bare = render.pod("j", "ns", parse_spec(raw(resources={"gpusPerNode": 0})), 0, 0, UID)
    names = {e["name"] for e in bare["spec"]["containers"][0]["env"]}
    assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}


def test_status_says_how_much_is_downloaded():
    shown = status.progress({"phase": "downloading", "downloadedBytes": 2**30,
                             "downloadBytes": 4 * 2**30})  # fmt: skip
    assert shown["download"] == "1.00 of 4.00 GiB (25%)"
    assert "download" not in status.progress({"phase": "training"})


def test_the_cache_is_keyed_by_content_not_by_spelling():
    objs = [s3.Obj("m/config.json", "config.json", 10, '"aa"')]
    m, slashed = parse("s3://b/m"), parse("s3://b/m/")
    assert s3.content_key(m, objs) == s3.content_key(slashed, objs)
    changed = [s3.Obj("m/config.json", "config.json", 10, '"bb"')]
    assert s3.content_key(m, objs) != s3.content_key(m, changed)
    one = [s3.Obj("m/train.jsonl", "train.jsonl", 5, '"cc"')]
    assert s3.local_path(s3.Path("/c/k"), parse("s3://b/m/train.jsonl"), one).name == "train.jsonl"
    assert s3.local_path(s3.Path("/c/k"), m, objs) == s3.Path("/c/k")


@pytest.mark.parametrize(
    ("message", "found"),
    [
        ("404 Not Found: <Error><Code>NoSuchBucket</Code>", "bucket"),
        ("403 Forbidden: <Error><Code>InvalidAccessKeyId</Code>", "credentials"),
        ("403 Forbidden: <Error><Code>SignatureDoesNotMatch</Code>", "credentials"),
        ("403 Forbidden: <Error><Code>AccessDenied</Code>", "denied"),
        ("no object at s3://b/x or under s3://b/x/", "missing"),
        ("error sending request for url (http://127.0.0.1:1/b): Connection refused", "unreachable"),
        # A retry's duration holds "404" (CI read it as a missing key): a number, no code.
        (
            "Generic S3 error: Error performing HEAD http://127.0.0.1:36307/models/tiny-model in "
            "2.871140436s, after 6 retries, max_retries: 50, retry_timeout: 2s - HTTP error: "
            "error sending request",
            "unreachable",
        ),
        # The key is echoed in the URL: its words are no answer of the store's.
        (
            "Error performing GET http://s3.local/b/AccessDenied-timed-out-403/x in 0.1s - "
            "Server returned non-2XX status code: 404 Not Found: <Code>NoSuchKey</Code>",
            "missing",
        ),
        ("the disk is full", "other"),
    ],
)
def test_each_answer_of_the_store_has_its_cause(message, found):
    assert storeerrors.kind(OSError(message)) == found
