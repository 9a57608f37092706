"""Reading job files: YAML as kubectl reads it, with kubectl's limits.

PyYAML follows YAML 1.1, where ``5e-5`` is a string; kubectl (YAML 1.2) reads it as a number.
Job files say ``learningRate: 5e-5``, so the loader here resolves floats the YAML 1.2 way.

kubectl (sigs.k8s.io/yaml) turns YAML into JSON before sending it: ``maxSteps: 1e3`` is read
as the float64 1000 and Go's encoding/json writes a float64 without a fraction as ``1000``
(it switches to exponent form only from 1e21), which the API server decodes as the integer
1000. The loader does the same, so an integer field takes ``1e3`` as kubectl makes it do.

A value that looks like a date (``2024-01-01``) stays the string written, as kubectl sends it.

Bounds, so that no file makes validation hang: a file's size and the number of values in a
document are bounded, counting what aliases repeat (kubectl refuses a file whose aliases
multiply it as "excessive aliasing"; a few nested aliases can expand to billions of values).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml


class ManifestError(ValueError):
    """A job file that cannot be read: missing, not YAML, or not a list of objects."""


# libyaml's parser where PyYAML has it (its wheels do): many times faster on a large file.
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
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
# kubectl's YAML reader (go-yaml v2 into interface{}) keeps a value that looks like a timestamp
# as the string written, for "backward compatibility"; PyYAML would make it a date. So
# `name: 2024-01-01` is the string "2024-01-01" here too, as the API server receives it.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}


# Bounds on what one job file may make ftjob read. The largest useful job (64 environment
# variables of 4 KiB, 64 NCCL variables of 1 KiB, a long affinity) is ~350 KiB and ~2,000
# values; the bounds leave room above that while keeping validate within a second or two.
MAX_BYTES = 512 * 1024
MAX_VALUES = 20_000  # in all of a file, counting each value an alias repeats


def loads(text: str, source: str = "<string>") -> list[dict[str, Any]]:
    """The non-empty documents of a YAML stream."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise _too_large(source)
    try:
        _count_values(text, source)
        docs = [_as_kubectl_sends(d) for d in yaml.load_all(text, Loader=_Loader)]
    except yaml.YAMLError as e:
        raise ManifestError(f"{source}: not valid YAML: {e}") from e
    except RecursionError as e:
        raise ManifestError(f"{source}: nested too deeply to be a job file") from e
    docs = [d for d in docs if d is not None]
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ManifestError(f"{source}: document {i + 1} is not an object")
    return docs


def _too_large(source: str) -> ManifestError:
    return ManifestError(
        f"{source}: larger than {MAX_BYTES // 1024} KiB; a job file holds a job (a few KiB), "
        "not its data"
    )


def _count_values(text: str, source: str) -> None:
    """Refuse a stream of more than MAX_VALUES values, each alias counting as the values it
    repeats, before any of it is built. Counted on the parser's events, so reading stops at
    the limit: an alias bomb costs no more than its few lines."""
    values, aliased = 0, False
    sizes: dict[str, int] = {}  # anchor -> values under it, once its node is complete
    opened: list[tuple[str | None, int]] = []  # collections being read: (anchor, values before)
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.DocumentStartEvent):
            sizes.clear()  # anchors belong to their document
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:
                raise ManifestError(f"{source}: a value contains itself through an alias")
            values, aliased = values + sizes[event.anchor], True
        elif isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            values += 1
            if isinstance(event, yaml.CollectionStartEvent):
                opened.append((event.anchor, values - 1))
            elif event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, before = opened.pop()
            if anchor:
                sizes[anchor] = values - before
        if values > MAX_VALUES:
            if aliased:
                raise ManifestError(
                    f"{source}: excessive aliasing: its aliases expand it beyond {MAX_VALUES} "
                    "values; write the values out or use fewer aliases"
                )
            raise ManifestError(
                f"{source}: holds more than {MAX_VALUES} values; a job needs a few hundred"
            )


def _as_kubectl_sends(value: Any) -> Any:
    """Integral floats become integers, as in the JSON kubectl sends (see the module doc)."""
    if isinstance(value, float) and math.isfinite(value):
        return int(value) if value.is_integer() and abs(value) < 1e21 else value
    if isinstance(value, dict):
        return {k: _as_kubectl_sends(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_kubectl_sends(v) for v in value]
    return value


def load(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # never more: the file might be anything
        if len(data) > MAX_BYTES:
            raise _too_large(str(path))
        text = data.decode("utf-8")
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
