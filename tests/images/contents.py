"""What an image holds: ftjob's dependencies and its target's extras', each at
constraints.txt's pin, every one importable (checked by a script run inside the image)."""

from __future__ import annotations

import json

from dependencies import EXTRAS_OF_TARGET, pins, wanted
from podrun import podman

# ftjob's entry point in each image: what the pods and the Deployment run.
ENTRY = {"trainer": "ftjob.trainer.__main__", "operator": "ftjob.operator.handlers"}

# Run inside the image: the distributions ftjob's installed metadata requires, with the
# extras argv[1] (comma-separated) and without any extra, their versions and top-level
# modules, each imported.
CHECK_IMPORTS = r"""
import importlib, importlib.metadata as md, json, re, sys
extras = sys.argv[1].split(",")
top = {}
for module, dists in md.packages_distributions().items():
    for dist in dists:
        top.setdefault(re.sub(r"[-_.]+", "-", dist).lower(), set()).add(module)
out = {}
for req in md.requires("ftjob"):
    name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]).lower()
    wanted = re.search(r'extra == "([^"]+)"', req)
    if wanted and wanted.group(1) not in extras:
        continue
    modules = sorted(m for m in top.get(name, ()) if not m.startswith("_") and m.isidentifier())
    for module in modules:
        importlib.import_module(module)
    out[name] = {"version": md.version(name), "modules": modules}
importlib.import_module(sys.argv[2])
print(json.dumps(out))
"""


def assert_extra_installed(image: str, target: str) -> None:
    extras = EXTRAS_OF_TARGET[target]
    out = podman("run", "--rm", "-i", "--network", "none", "--read-only", "--cap-drop", "ALL",
                 "--entrypoint", "python", image, "-", ",".join(extras), ENTRY[target],
                 input=CHECK_IMPORTS, timeout=300)  # fmt: skip
    found = json.loads(out.strip().splitlines()[-1])
    assert found.keys() == wanted(*extras), (sorted(found), sorted(wanted(*extras)))
    for name, info in found.items():
        assert info["modules"], f"{name} has no importable module in {image}"
        # torch is the base's build (2.13.0+cpu on the stand-in, +cu128 on the release base).
        assert info["version"].split("+")[0] == pins()[name], (name, info["version"])
