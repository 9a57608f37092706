"""ftjob/api/source.py: every source and destination string parsed into one typed value, its
scheme spelled there only, and what each value tells its readers.

    python -m pytest tests/unit/test_source.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftjob.api.jobspec import parse_spec
from ftjob.api.source import S3, Hub, Local, parse


def test_a_hub_url_names_its_repository():
    found = parse("hf://meta-llama/Meta-Llama-3-8B")
    assert found == Hub("hf://meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B")
    assert found.remote and found.name == "Meta-Llama-3-8B"
    assert str(found) == "hf://meta-llama/Meta-Llama-3-8B"  # as written, in every message
    # A legacy repository without an organization, and a slash too many, name the repository.
    assert parse("hf://gpt2").repo == "gpt2" and parse("hf://gpt2").name == "gpt2"
    assert parse("hf://org/name/").repo == "org/name"
    assert parse("hf://org/name/").url == "hf://org/name/"


@pytest.mark.parametrize(
    ("text", "bucket", "key"),
    [
        ("s3://models/llama/8b", "models", "llama/8b"),
        ("s3://models/llama/8b/", "models", "llama/8b"),  # the same objects, slash or not
        ("s3://data/train.jsonl", "data", "train.jsonl"),
        ("s3://bucket", "bucket", ""),  # the whole bucket
        ("s3://bucket/", "bucket", ""),
        ("s3://b/hf://x", "b", "hf://x"),  # a scheme counts only at the start
    ],
)
def test_an_s3_url_is_split_into_bucket_and_key(text, bucket, key):
    found = parse(text)
    assert found == S3(text, bucket, key) and found.remote and str(found) == text


def test_an_s3_url_names_its_folder_and_its_last_part():
    assert parse("s3://b/m").under == parse("s3://b/m/").under == "s3://b/m/"
    assert parse("s3://b").under == "s3://b/"
    assert parse("s3://b/sets/train.jsonl").name == "train.jsonl" and parse("s3://b").name == "b"


@pytest.mark.parametrize("text", ["data/train.jsonl", "/mnt/ckpt/models/llama", "./x", "models/hf"])
def test_anything_else_is_a_local_path(text):
    found = parse(text)
    assert found == Local(text) and not found.remote and str(found) == text


def test_a_local_path_is_read_beside_the_root_unless_absolute():
    assert parse("data/train.jsonl").at("/jobs/a") == Path("/jobs/a/data/train.jsonl")
    assert parse("/volume/train.jsonl").at("/jobs/a") == Path("/volume/train.jsonl")
    assert parse("data/x.jsonl").at(".") == Path("data/x.jsonl")  # here: the working folder
    assert parse("models/llama/").name == "llama"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("s3://", "names no bucket: write s3://bucket/prefix"),
        ("s3:///key", "names no bucket: write s3://bucket/prefix"),
        ("hf://", "names no repository: write hf://org/name"),
        ("hf:///", "names no repository: write hf://org/name"),
    ],
)
def test_a_url_without_its_bucket_or_repository_is_refused_with_the_form_to_write(text, says):
    with pytest.raises(ValueError, match=says):
        parse(text)


def test_the_spec_refuses_an_s3_url_without_a_bucket_with_its_field():
    # The spec's own pattern names the field and the form first; parse is never reached.
    with pytest.raises(ValueError) as e:
        parse_spec({"model": {"source": "s3:///models"}, "dataset": {"source": "d.jsonl"}})
    assert "spec.model.source" in str(e.value) and "s3://bucket/prefix" in str(e.value)
