"""The ftjob command line, run as a user runs it: a real process, its output and exit code."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CORPUS = ROOT / "tests" / "corpus"


def ftjob(*args):
    return subprocess.run(
        [sys.executable, "-m", "ftjob", *map(str, args)], capture_output=True, text=True, cwd=ROOT
    )


def test_samples_validate():
    assert len(SAMPLES) >= 4
    result = ftjob("validate", *SAMPLES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": valid -- ") == len(SAMPLES)


def test_invalid_job_exits_1_and_names_the_field_both_ways():
    result = ftjob("validate", CORPUS / "type-lora-r-string.yaml")
    assert result.returncode == 1
    assert 'spec.method.lora.r: must be an integer between 1 and 1024, got "big"' in result.stdout
    assert "kubectl apply would be refused with:" in result.stdout
    assert "spec.method.lora.r: Invalid value" in result.stdout


def test_update_checks_immutable_fields(tmp_path):
    old, new = yaml.safe_load_all((CORPUS / "immutable-model-source.yaml").read_text())
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(new))
    assert ftjob("validate", tmp_path / "new.yaml").returncode == 0
    result = ftjob("validate", "--old", tmp_path / "old.yaml", tmp_path / "new.yaml")
    assert result.returncode == 1 and "spec.model: is immutable" in result.stdout


def test_unreadable_input_exits_2_with_the_reason(tmp_path):
    missing = ftjob("validate", tmp_path / "nope.yaml")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (tmp_path / "broken.yaml").write_text("spec: [unclosed\n")
    broken = ftjob("validate", tmp_path / "broken.yaml")
    assert broken.returncode == 2 and "not valid YAML" in broken.stderr
    (tmp_path / "other.yaml").write_text("kind: Pod\n")
    other = ftjob("validate", tmp_path / "other.yaml")
    assert other.returncode == 2 and "holds no FineTuneJob" in other.stderr


def test_render_fills_every_default():
    result = ftjob("render", ROOT / "examples" / "tiny.yaml")
    assert result.returncode == 0, result.stderr
    (doc,) = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert doc["spec"]["runPolicy"]["backoffLimit"] == 3
    assert doc["spec"]["dataset"]["format"] == "chat"
    assert doc["metadata"] == {"name": "tiny", "namespace": "default"}


def test_render_refuses_an_invalid_job():
    result = ftjob("render", CORPUS / "rule-full-with-lora.yaml")
    assert result.returncode == 1 and "spec.method.lora" in result.stderr


def test_crd_command_prints_the_committed_crd():
    result = ftjob("crd")
    assert result.returncode == 0
    assert result.stdout == (ROOT / "manifests" / "crd.yaml").read_text()


@pytest.mark.parametrize("command", ["validate", "render", "crd"])
def test_every_command_has_help(command):
    result = ftjob(command, "--help")
    assert result.returncode == 0 and "usage: ftjob" in result.stdout
