"""Reading job files: YAML as kubectl reads it.

PyYAML follows YAML 1.1, where ``5e-5`` is a string; kubectl (YAML 1.2) reads it as a number.
Job files say ``learningRate: 5e-5``, so the loader here resolves floats the YAML 1.2 way.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


class ManifestError(ValueError):
    """A job file that cannot be read: missing, not YAML, or not a list of objects."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def loads(text: str, source: str = "<string>") -> list[dict[str, Any]]:
    """The non-empty documents of a YAML stream."""
    try:
        docs = [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except yaml.YAMLError as e:
        raise ManifestError(f"{source}: not valid YAML: {e}") from e
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ManifestError(f"{source}: document {i + 1} is not an object")
    return docs


def load(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ManifestError(f"{path}: no such file") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: cannot be read: {e}") from e
    return loads(text, str(path))


def load_one(path: str | Path, kind: str) -> dict[str, Any]:
    """The one document of ``kind`` in ``path`` (a job file holds exactly one job)."""
    docs = [d for d in load(path) if d.get("kind") == kind]
    if len(docs) != 1:
        raise ManifestError(f"{path}: needs exactly one {kind}, found {len(docs)}")
    return docs[0]


def dumps(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, width=100)
