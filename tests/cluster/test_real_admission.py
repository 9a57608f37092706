"""Admission parity: every job the project shows or keeps (examples/, manifests/samples/, the
docs' YAML, tests/corpus/) gets the same verdict from ``ftjob validate`` as from the real
kube-apiserver's server-side dry run (``kubectl apply --dry-run=server``), and what validate
prints under "kubectl apply would be refused with" is exactly what the server refuses."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from plane import ROOT

from ftjob.api import manifest
from ftjob.cli import validate

NAMESPACE = "parity"
# The API server adds this line whenever schema errors kept it from running the CEL rules; it
# refuses nothing by itself, and validate does not print it.
NOT_CHECKED = "some validation rules were not checked because the object was invalid"


def split(text: str) -> list[str]:
    """A YAML stream's documents as text, each as the user wrote it."""
    parts = re.split(r"^---[ \t]*$", text, flags=re.M)
    return [p for p in parts if yaml.safe_load(p) is not None]


def docs_jobs() -> list[tuple[str, list[str]]]:
    """The YAML blocks of README.md and docs/*.md that are whole FineTuneJobs."""
    out = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```ya?ml\n(.*?)```", md.read_text(), flags=re.DOTALL)
        for i, block in enumerate(blocks):
            try:
                texts = split(block)
            except yaml.YAMLError:
                continue
            for text in texts:
                doc = yaml.safe_load(text)
                if isinstance(doc, dict) and doc.get("kind") == "FineTuneJob" and "spec" in doc:
                    out.append((f"{md.relative_to(ROOT)}#{i}", [text]))
    return out


def cases() -> list[tuple[str, list[str]]]:
    files = [
        *sorted((ROOT / "examples").glob("*.yaml")),
        *sorted((ROOT / "manifests" / "samples").glob("*.yaml")),
        *sorted((ROOT / "tests" / "corpus").glob("*.yaml")),
    ]
    return [(str(p.relative_to(ROOT)), split(p.read_text())) for p in files] + docs_jobs()


CASES = cases()


def refusal(stderr: str) -> list[str]:
    """kubectl's refusal as ``field: message`` lines, the form validate prints.

    "... is invalid: ...": the field errors, one per line. The strict decoder's "unknown field
    "X", ..." (before any schema check): one line per field. JSON's missing NaN/Infinity
    (kubectl itself refuses to send): the message, which validate prefixes with the field."""
    if match := re.search(r" is invalid: (.*)", stderr, flags=re.DOTALL):
        body = match.group(1).strip()
        if "\n* " in body:
            return sorted(x[2:] for x in body.splitlines() if x.startswith("* "))
        return [body]
    if match := re.search(r"strict decoding error: (.*)", stderr):
        fields = re.findall(r'unknown field "([^"]+)"', match.group(1))
        return sorted(f'{f}: unknown field "{f}"' for f in fields)
    if match := re.search(r"(json: unsupported value: \S+)", stderr):
        return [match.group(1)]
    raise AssertionError(f"refused for another reason than validation: {stderr}")


def dry_run(plane, text: str, old: str | None) -> list[str]:
    """The real API server's refusal of the job ``text`` (an update of ``old``): [] when it
    is admitted. kubectl reads the text as the user wrote it."""
    if old is not None:
        plane.kubectl("create", "--save-config", "-n", NAMESPACE, "-f", "-", input=old)
    try:
        result = plane.kubectl(
            "apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-", input=text, ok=False
        )
    finally:
        if old is not None:
            plane.kubectl("delete", "-n", NAMESPACE, "--wait=false", "-f", "-", input=old)
    return refusal(result.stderr) if result.returncode else []


def ftjob_refusal(checked) -> list[str]:
    """What validate prints under "kubectl apply would be refused with", in refusal()'s form."""
    lines = sorted(checked.server_errors)
    if lines and all("json: unsupported value" in x for x in lines):
        return [re.search(r"json: unsupported value: \S+", lines[0]).group(0)]
    return lines


@pytest.fixture(scope="module")
def parity(installed):
    installed.kubectl("create", "namespace", NAMESPACE)
    return installed


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_validate_and_the_real_apiserver_agree(parity, case):
    _, texts = case
    old = texts[0] if len(texts) == 2 else None
    docs = [manifest.loads(t)[0] for t in texts]
    checked = validate.check(docs[-1], docs[0] if old else None)
    if docs[-1]["metadata"].get("namespace") not in (None, NAMESPACE):
        # kubectl sends it to its own namespace; validate checks the name is a DNS label.
        namespace = docs[-1]["metadata"]["namespace"]
        found = parity.kubectl("get", "namespace", namespace, ok=False)
        assert found.returncode and checked.server_errors == [
            f"metadata.namespace: Invalid value: {namespace!r} is not a DNS label"
        ]
        return
    assert ftjob_refusal(checked) == dry_run(parity, texts[-1], old)
    # validate may refuse more, only for reasons it names as its own; never less.
    assert checked.ok or checked.errors


def test_the_cli_prints_the_servers_refusal_under_its_heading(parity, tmp_path):
    path = ROOT / "tests" / "corpus" / "enum-fabric.yaml"
    out = subprocess.run(
        [sys.executable, "-m", "ftjob", "validate", str(path)], capture_output=True, text=True
    ).stdout
    printed = out.split("kubectl apply would be refused with:\n", 1)[1].splitlines()
    assert [x.strip() for x in printed] == dry_run(parity, path.read_text(), None)


def test_the_corpus_and_the_examples_are_all_here():
    names = {c[0].split("/")[0].split("#")[0] for c in CASES}
    assert {"examples", "manifests", "tests", "README.md"} <= names
    assert len(CASES) >= 120
