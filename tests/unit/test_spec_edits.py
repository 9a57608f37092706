"""Which edits of an existing FineTuneJob are taken: docs/operator.md ("Editing a job"), the
CRD's CEL rules and `ftjob validate --old` say the same."""

import copy
import re
import subprocess
import sys
from pathlib import Path

import yaml

from ftjob.api import crd, manifest

ROOT = Path(__file__).resolve().parents[2]


def documented() -> list[str]:
    text = (ROOT / "docs" / "operator.md").read_text()
    block = re.search(r"<!-- immutable:.*?-->(.*?)<!-- /immutable -->", text, re.S).group(1)
    return re.findall(r"`(spec\.[\w.]+)`", block)


def crd_immutable(schema: dict, path: str) -> list[str]:
    """The paths whose schema carries the rule `self == oldSelf`."""
    out = []
    rules = [r["rule"] for r in schema.get("x-kubernetes-validations", [])]
    if "self == oldSelf" in rules:
        out.append(path)
    for key, sub in (schema.get("properties") or {}).items():
        out += crd_immutable(sub, f"{path}.{key}")
    return out


def ftjob(*args):
    return subprocess.run(
        [sys.executable, "-m", "ftjob", *map(str, args)], capture_output=True, text=True, cwd=ROOT
    )


EDITS = {  # one edit inside each section; a deeper field than the section itself
    "spec.model": ("model", "attention", "eager"),
    "spec.dataset": ("dataset", "maxSeqLength", 128),
    "spec.method": ("method", "type", "lora"),
    "spec.training": ("training", "logEvery", 7),
    "spec.resources": ("resources", "nodes", 1),
    "spec.parallelism": ("parallelism", "cpuOffload", True),
    "spec.checkpoint": ("checkpoint", "every", 5),
}


def test_the_documented_immutable_sections_are_the_crds_and_validate_olds(tmp_path):
    """The docs' list equals the CRD's rules; validate --old refuses an edit inside each listed
    section, naming it, and takes an edit of a section not listed."""
    spec_schema = crd.schema()["properties"]["spec"]
    assert documented() == crd_immutable(spec_schema, "spec")
    assert sorted(documented()) == sorted(EDITS)
    (old,) = manifest.load(ROOT / "examples" / "tiny.yaml")
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    files = []
    for section, key, value in EDITS.values():
        new = copy.deepcopy(old)
        new["spec"].setdefault(section, {})[key] = value
        files.append(tmp_path / f"{section}.yaml")
        files[-1].write_text(yaml.safe_dump(new))
    mutable = copy.deepcopy(old)
    mutable["spec"]["runPolicy"] = {"backoffLimit": 5}
    mutable["spec"]["image"] = "registry.example.com/t:2"
    (tmp_path / "mutable.yaml").write_text(yaml.safe_dump(mutable))
    result = ftjob("validate", "-o", "yaml", "--old", tmp_path / "old.yaml", *files,
                   tmp_path / "mutable.yaml")  # fmt: skip
    items = yaml.safe_load(result.stdout)["items"]
    for path, item in zip(EDITS, items[:-1], strict=True):
        assert not item["valid"], path
        assert path in {e["field"] for e in item["errors"]}, item
        assert path in {e["field"] for e in item["serverErrors"]}, item
    assert items[-1]["valid"], items[-1]
