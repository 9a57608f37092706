"""ftjob's declared dependencies and their pins, by normalised name: what the Dockerfile's
tests (tests/unit/test_dockerfile.py) and the built images' (tests/images) hold an image to."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def req_name(requirement: str) -> str:
    """The distribution a requirement names (``Torch_Ao[x]>=1; extra == "y"`` -> ``torch-ao``),
    normalised as pip compares names."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def pins() -> dict[str, str]:
    """constraints.txt: normalised name -> pinned version."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if version:
            out[req_name(name)] = version
    return out


# The extras each image target installs: the trainer's also has QLoRA's and the experiment
# trackers' (a pod runs whatever job it is given).
EXTRAS_OF_TARGET = {"operator": ("operator",), "trainer": ("trainer", "qlora", "tracking")}


def wanted(*extras: str) -> set[str]:
    """pyproject.toml's dependencies and the extras', by normalised name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + [
        r for extra in extras for r in project["optional-dependencies"][extra]
    ]
    return {req_name(r) for r in listed}
