"""The ftjob command line, run as a user runs it: a real process, its output and exit code."""

import json
import re
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


@pytest.mark.parametrize("command", ["validate", "render", "plan", "run", "crd"])
def test_every_command_has_help(command):
    result = ftjob(command, "--help")
    assert result.returncode == 0 and "usage: ftjob" in result.stdout


# ------------------------------------------------------------------ -o json|yaml (docs/cli.md)


def test_validate_json_lists_every_document_with_its_field_errors():
    result = ftjob("validate", "-o", "json", ROOT / "examples" / "tiny.yaml",
                   CORPUS / "rule-full-with-lora.yaml")  # fmt: skip
    assert result.returncode == 1 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert (doc["kind"], doc["valid"]) == ("ValidationList", False)
    tiny, bad = doc["items"]
    assert tiny["valid"] and tiny["name"] == "tiny" and tiny["errors"] == []
    assert tiny["summary"].startswith("full, 2 nodes")
    assert not bad["valid"] and bad["summary"] is None
    assert {"field": "spec.method.lora", "message": bad["errors"][0]["message"]} in bad["errors"]
    assert bad["serverErrors"][0]["field"] == "spec.method.lora"


def test_validate_yaml_is_the_same_document():
    as_json = json.loads(ftjob("validate", "-o", "json", ROOT / "examples" / "tiny.yaml").stdout)
    result = ftjob("validate", "-o", "yaml", ROOT / "examples" / "tiny.yaml")
    assert result.returncode == 0
    assert yaml.safe_load(result.stdout) == as_json


def test_plan_takes_several_files_and_prints_json():
    files = [ROOT / "examples" / "tiny.yaml", ROOT / "examples" / "llama3-8b-full-1gpu.yaml"]
    text = ftjob("plan", *files)
    assert text.returncode == 1  # the 8B full fine-tune will not fit on one 40 GB GPU
    assert text.stdout.count(": FineTuneJob ") == 2
    result = ftjob("plan", "-o", "json", *files)
    assert result.returncode == 1
    tiny, qlora = json.loads(result.stdout)["items"]
    assert tiny["fits"] is None and tiny["stepSeconds"] is None
    assert tiny["model"]["parameters"] == 223_552 and tiny["perDevice"]["deviceBytes"] is None
    assert qlora["fits"] is False and qlora["verdict"].startswith("WILL NOT FIT")
    assert qlora["perDevice"]["totalBytes"] > qlora["perDevice"]["deviceBytes"] == 40 * 2**30
    assert qlora["options"] and all(o["perDeviceBytes"] > 0 for o in qlora["options"])


def value_columns(text: str) -> set[int]:
    """Where each row's value starts, after its label ("model", "per GPU", "fits with")."""
    rows = text.splitlines()[1:]
    return {len(re.match(r"^( +\S+(?: \S+)* {2,})", row)[1]) for row in rows}


def test_plan_of_a_cpu_job_is_an_aligned_table_without_gpu_advice():
    result = ftjob("plan", ROOT / "examples" / "tiny.yaml")
    assert result.returncode == 0
    assert "per process" in result.stdout and "gpuType" not in result.stdout
    assert len(value_columns(result.stdout)) == 1, result.stdout


def test_plan_of_a_gpu_job_is_aligned_too():
    result = ftjob("plan", ROOT / "examples" / "llama3-8b-full-1gpu.yaml")
    assert "per GPU" in result.stdout and "fits with" in result.stdout
    assert len(value_columns(result.stdout)) == 1, result.stdout


def test_render_json_is_a_list_kubectl_can_apply():
    result = ftjob("render", "-o", "json", "--children", ROOT / "examples" / "tiny.yaml")
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert (doc["apiVersion"], doc["kind"]) == ("v1", "List")
    kinds = [item["kind"] for item in doc["items"]]
    assert kinds[0] == "FineTuneJob" and kinds.count("Pod") == 2
    assert {"ConfigMap", "Service"} <= set(kinds)
    as_yaml = yaml.safe_load(ftjob("render", "-o", "yaml", "--children",
                                   ROOT / "examples" / "tiny.yaml").stdout)  # fmt: skip
    assert as_yaml == doc


def test_an_unknown_output_format_is_a_usage_error():
    result = ftjob("plan", "-o", "xml", ROOT / "examples" / "tiny.yaml")
    assert result.returncode == 2 and "invalid choice: 'xml'" in result.stderr
