"""PURE: what a source or destination string names (spec.model.source, spec.dataset.source,
spec.output.push): a Hub repository (hf://org/name), an object store's prefix
(s3://bucket/key), or a path (absolute on a volume, or relative to the job). Every reader asks
here, so each scheme is spelled once."""

from __future__ import annotations

HUB, S3 = "hf://", "s3://"
REMOTE = (HUB, S3)  # fetched by the trainer (into the volume), not read where they are


def is_hub(text: str) -> bool:
    return text.startswith(HUB)


def is_s3(text: str) -> bool:
    return text.startswith(S3)


def is_remote(text: str) -> bool:
    """Whether ``text`` is fetched by the trainer (the Hub, an object store), not a path on
    this machine or the volume."""
    return text.startswith(REMOTE)


def hub_repo(text: str) -> str | None:
    """org/name of an hf:// source or destination; None for any other."""
    return text.removeprefix(HUB) if is_hub(text) else None
