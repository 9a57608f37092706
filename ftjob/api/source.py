"""PURE: what a source or destination string names (spec.model.source, spec.dataset.source,
spec.output.push, checkpoint.resumeFrom), parsed once into one typed value:

    hf://org/name          Hub(repo="org/name")                   fetched by the trainer
    s3://bucket/some/key   S3(bucket="bucket", key="some/key")     fetched by the trainer
    data/train.jsonl       Local("data/train.jsonl")               read where it is

A local path is absolute (on the volume in a pod, on this machine under ``ftjob run``) or
relative to the job's source root (the job file's folder; the volume's mount in a pod):
:meth:`Local.at` joins it. Every reader asks :func:`parse`, so each scheme is spelled here
only. The spec's pattern (jobspec.fields.SOURCE) has refused a malformed one at the door.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

_HUB, _S3 = "hf://", "s3://"


@dataclass(frozen=True)
class Hub:
    """A Hugging Face Hub repository; its revision is a field of its own (model.revision)."""

    url: str  # as written
    repo: str  # org/name, what huggingface_hub takes
    remote: ClassVar[bool] = True

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        """The repository's name, without its organization."""
        return self.repo.rpartition("/")[2]


@dataclass(frozen=True)
class S3:
    """An object store's key: one object, or the prefix of the objects below it."""

    url: str  # as written: s3://b/p and s3://b/p/ name the same objects
    bucket: str
    key: str  # without its slashes at either end; "" for the whole bucket
    remote: ClassVar[bool] = True

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        """The key's last part (the bucket's name for the whole bucket)."""
        return (self.key or self.bucket).rpartition("/")[2]

    @property
    def under(self) -> str:
        """The key as a folder, for a listing: s3://bucket/some/key/."""
        return f"{_S3}{self.bucket}/{self.key}/" if self.key else f"{_S3}{self.bucket}/"


@dataclass(frozen=True)
class Local:
    """A path of a file system: read where it is, never fetched."""

    path: str
    remote: ClassVar[bool] = False

    def __str__(self) -> str:
        return self.path

    @property
    def name(self) -> str:
        """The file's or folder's own name."""
        return Path(self.path).name

    def at(self, root: str | Path) -> Path:
        """The path itself when absolute, else beside ``root`` (joined, not looked at)."""
        return Path(root) / self.path


Source = Hub | S3 | Local


def parse(text: str) -> Source:
    """The value ``text`` names. Raises ValueError for a Hub URL without a repository or an
    S3 URL without a bucket, naming the form to write."""
    if text.startswith(_HUB):
        repo = text.removeprefix(_HUB).strip("/")
        if not repo:
            raise ValueError(f"{text!r} names no repository: write {_HUB}org/name")
        return Hub(text, repo)
    if text.startswith(_S3):
        bucket, _, key = text.removeprefix(_S3).partition("/")
        if not bucket:
            raise ValueError(f"{text!r} names no bucket: write {_S3}bucket/prefix")
        return S3(text, bucket, key.strip("/"))
    return Local(text)
