"""Reading job files: YAML as kubectl reads it, with kubectl's limits.

PyYAML follows YAML 1.1, where ``5e-5`` is a string; kubectl (YAML 1.2) reads it as a number.
Job files say ``learningRate: 5e-5``, so the loader here resolves floats the YAML 1.2 way.

kubectl (sigs.k8s.io/yaml) turns YAML into JSON before sending it: ``maxSteps: 1e3`` is read
as the float64 1000 and Go's encoding/json writes a float64 without a fraction as ``1000``
(it switches to exponent form only from 1e21), which the API server decodes as the integer
1000. The loader does the same, so an integer field takes ``1e3`` as kubectl makes it do.

Bounds, so that no file makes validation hang: a file is at most the API server's request
size, and aliases may not multiply the document (kubectl refuses such a file as "excessive
aliasing"; a few nested aliases otherwise expand to billions of values).
"""

from __future__ import annotations

import math
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


MAX_BYTES = 3 * 1024 * 1024  # the API server reads no request body larger than 3 MiB
MAX_ALIASED_VALUES = 10_000  # values that aliases may repeat, in all of a document


def loads(text: str, source: str = "<string>") -> list[dict[str, Any]]:
    """The non-empty documents of a YAML stream."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise _too_large(source)
    loader = _Loader(text)
    docs = []
    try:
        while loader.check_node():
            node = loader.get_node()
            _check_aliases(node, source, len(docs) + 1)
            doc = _as_kubectl_sends(loader.construct_document(node))
            if doc is not None:
                docs.append(doc)
    except yaml.YAMLError as e:
        raise ManifestError(f"{source}: not valid YAML: {e}") from e
    except RecursionError as e:
        raise ManifestError(f"{source}: nested too deeply to be a job file") from e
    finally:
        loader.dispose()
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ManifestError(f"{source}: document {i + 1} is not an object")
    return docs


def _too_large(source: str) -> ManifestError:
    return ManifestError(
        f"{source}: larger than {MAX_BYTES // 2**20} MiB, the most the API server takes in one "
        "request; a job file holds a job, not its data"
    )


def _check_aliases(root: yaml.Node, source: str, number: int) -> None:
    """Refuse a document whose aliases repeat more than MAX_ALIASED_VALUES values (or that
    contains itself). Counted on the node graph, where each anchored node exists once."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ManifestError(f"{source}: document {number} contains itself through an alias")
        open_nodes.add(key)
        children: list = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        total = 1 + sum(size(child) for child in children)
        open_nodes.discard(key)
        sizes[key] = total
        return total

    repeated = size(root) - len(sizes)
    if repeated > MAX_ALIASED_VALUES:
        raise ManifestError(
            f"{source}: document {number}: excessive aliasing (aliases repeat {repeated} "
            f"values, at most {MAX_ALIASED_VALUES}); write the values out or use fewer aliases"
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
