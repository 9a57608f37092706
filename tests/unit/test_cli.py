"""The ftjob command line, run as a user runs it: a real process, its output and exit code."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from ftjob.api import manifest
from ftjob.cli import validate as validate_cli
from ftjob.job import inputs

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


def without(modules, *args, cwd=ROOT):
    """ftjob in a Python where ``modules`` cannot be imported (an extra not installed)."""
    code = (
        "import sys\n"
        f"for m in {list(modules)!r}: sys.modules[m] = None\n"
        "from ftjob.cli.commands import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


@pytest.mark.parametrize(
    "blocked, args, line",
    [
        (["kopf"], ["operator", "-A"], "ftjob: ftjob operator needs ftjob's operator extra (kopf "
         "not installed); install it with: pip install 'ftjob[operator]'"),
        (["torch", "peft"], ["run", "examples/tiny.yaml"], "ftjob: ftjob run needs ftjob's "
         "trainer extra (torch, peft not installed); install it with: "
         "pip install 'ftjob[trainer]'"),
    ],
)  # fmt: skip
def test_a_command_without_its_extra_says_how_to_install_it(blocked, args, line):
    result = without(blocked, *args)
    assert (result.returncode, result.stderr, result.stdout) == (2, line + "\n", "")
    assert without(blocked, "validate", "examples/tiny.yaml").returncode == 0  # needs no extra


def test_run_names_a_trackers_missing_client_before_it_starts(tmp_path):
    tracking = {"mlflow": {"trackingUri": "http://127.0.0.1:1", "experiment": "e"}}
    path, _ = tiny_job(tmp_path, tracking=tracking)
    result = without(["mlflow"], "run", path, "--workdir", tmp_path / "run")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert (
        f"ftjob run: {path}: spec.tracking.mlflow: the mlflow client (mlflow) is not installed "
        "in this Python, so the run would not be tracked"
    ) in lines
    assert "  fix: pip install 'ftjob[tracking]' (or remove spec.tracking.mlflow)" in lines
    assert not (tmp_path / "run" / "logs").exists()  # no process was started


def test_run_refuses_a_qlora_job_without_torchao_at_once_with_the_install(tmp_path):
    """torchao is the qlora extra's, not the trainer's: a QLoRA job where it is missing is
    refused before anything starts, not ended by an import deep in the trainer."""
    job = ROOT / "examples" / "tiny-qlora.yaml"
    result = without(["torchao"], "run", job, "--workdir", tmp_path / "run")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert (
        f"ftjob run: {job}: spec.method.type: qlora needs ftjob's qlora extra (torchao not "
        "installed), the 4-bit storage of the base model"
    ) in lines
    assert "  fix: pip install 'ftjob[qlora]' (or use method.type lora)" in lines
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_a_trainer_started_without_torchao_refuses_qlora_before_reading_weights(monkeypatch):
    """A trainer started otherwise than by `ftjob run` (torchrun, a pod) names the extra too,
    not an import error halfway through reading the weights."""
    from ftjob.api.contract import BAD_SPEC, TrainerError
    from ftjob.api.jobspec import parse_resource
    from ftjob.trainer.model import load as model

    (doc,) = manifest.load(ROOT / "examples" / "tiny-qlora.yaml")
    monkeypatch.chdir(ROOT / "examples")
    spec = parse_resource(doc)[1]
    built = model.build(spec, model.load_tokenizer(spec))
    model.check_shardable(built, 2)  # with torchao: nothing to refuse
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(TrainerError) as refused:
        model.check_shardable(built, 2)
    assert (refused.value.reason, refused.value.where) == (BAD_SPEC, ".method.type")
    assert refused.value.fix == "pip install 'ftjob[qlora]' (or use method.type lora)"
    assert "qlora needs ftjob's qlora extra (torchao not installed)" in str(refused.value)


def test_torchao_is_the_qlora_extras_alone():
    """transformers imports torchao whenever it is installed (and torchao's import prints
    warnings), so ``ftjob[trainer]`` must not install it; ``ftjob[qlora]`` and the tests do."""
    from dependencies import wanted

    from ftjob.cli import extras

    extras_of = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "torchao" not in wanted("trainer")
    assert "torchao" in wanted("qlora") and "ftjob[qlora]" in extras_of["test"]
    # What `ftjob run` checks is what pyproject installs (bench and test are not the product).
    assert extras.extra_of("torchao") == "qlora" and "torchao" not in extras.MODULES["trainer"]
    assert set(extras.MODULES) == set(extras_of) - {"bench", "test"}


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


def test_validate_json_says_what_the_text_says(tmp_path):
    """-o json carries the not-checked notes and the warnings the text prints; the text prints
    the image warning once, after every job, naming the GPU jobs only (a CPU job is what
    `ftjob run` runs here, where no image is pulled)."""
    path, _ = tiny_job(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["dataset"]["source"] = "data/none.jsonl"
    path.write_text(yaml.safe_dump(doc))
    gpu_jobs = [
        ROOT / "examples" / n for n in ("llama3-8b-full-1gpu.yaml", "llama31-70b-qlora.yaml")
    ]
    text = ftjob("validate", path, *gpu_jobs)
    assert text.returncode == 0, text.stdout
    note = DATA_NOTE.format(tmp_path / "data/none.jsonl")
    (warning,) = [line for line in text.stdout.splitlines() if "spec.image is unset" in line]
    (misfit,) = [line for line in text.stdout.splitlines() if "will not fit" in line]
    # After every job: the image's warning once, then the plan's on the job that will not fit.
    assert text.stdout.endswith(warning + "\n" + misfit + "\n")
    assert warning.startswith("warning (llama3-8b-full-1gpu, llama31-70b-qlora): spec.image")
    assert misfit.startswith("warning (llama3-8b-full-1gpu): the plan says it will not fit: "
                             "WILL NOT FIT: 141.7 GiB of 40.0 GiB per GPU (354%)")  # fmt: skip
    items = json.loads(ftjob("validate", "-o", "json", path, *gpu_jobs).stdout)["items"]
    found = [(i["notes"], len(i["warnings"])) for i in items]
    assert found == [([note], 0), ([], 2), ([], 1)]
    assert f"  {note}" in text.stdout.splitlines()
    assert warning.endswith(items[1]["warnings"][0])


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


# ------------------------------------------------------------------ one verdict everywhere


def tiny_job(tmp_path, name="job.yaml", **spec_changes):
    """examples/tiny.yaml with its sources made absolute (the job file lives in tmp_path)."""
    (doc,) = manifest.load(ROOT / "examples" / "tiny.yaml")
    doc["spec"]["model"]["source"] = str(ROOT / "examples" / "tiny-model")
    doc["spec"]["dataset"]["source"] = str(ROOT / "examples" / "data" / "tiny-chat.jsonl")
    for key, value in spec_changes.items():
        doc["spec"][key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path, doc


TINY_QLORA = (
    "spec.method.type: qlora: q_proj (64x64) has 4096 values, not a multiple of 16384: this "
    "model cannot be stored in NF4; fix: use method.type lora, or a model whose hidden and "
    "intermediate sizes are multiples of 128, as most released models' are (e.g. "
    "hf://Qwen/Qwen2.5-0.5B); to try QLoRA on CPU: ftjob run examples/tiny-qlora.yaml (its "
    "base, tiny-qlora-model, is a small Llama of hidden size 256 that NF4 can store)"
)


def test_qlora_on_the_tiny_model_is_refused_alike_by_validate_plan_and_the_trainer(
    tmp_path, monkeypatch
):
    """`type: qlora` alone (no quantization block: nf4 is the default) on a model whose
    weights cannot be stored in NF4: validate, plan and the trainer's own check say the same
    field and fix, so the trainer's "see ftjob validate" points at a command that agrees."""
    path, doc = tiny_job(tmp_path, method={"type": "qlora"})
    validate = ftjob("validate", path)
    assert validate.returncode == 1
    assert f"  {TINY_QLORA}\n" in validate.stdout and ": INVALID" in validate.stdout
    planned = ftjob("plan", path)
    assert planned.returncode == 1 and planned.stderr == f"{path}: {TINY_QLORA}\n"

    from ftjob.api.contract import BAD_SPEC, TrainerError
    from ftjob.api.jobspec import parse_resource
    from ftjob.trainer.model import load as model

    monkeypatch.chdir(tmp_path)
    spec = parse_resource(doc)[1]
    built = model.build(spec, model.load_tokenizer(spec))
    with pytest.raises(TrainerError) as refused:
        model.check_shardable(built, 2)
    field, message = TINY_QLORA.split(": ", 1)
    assert f"{refused.value}; fix: {refused.value.fix}" == message
    assert refused.value.reason == BAD_SPEC
    assert refused.value.where == field.removeprefix("spec")


def test_qlora_needs_no_quantization_block(tmp_path):
    """Every field has a default: qlora stores its base in nf4 unless told otherwise."""
    (doc,) = manifest.load(ROOT / "examples" / "llama31-70b-qlora.yaml")
    del doc["spec"]["method"]["quantization"]
    path = tmp_path / "qlora.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = ftjob("validate", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": valid -- qlora, 1 node x 2 GPUs" in result.stdout
    planned = ftjob("plan", path)
    assert planned.returncode == 0 and "4-bit base sharded" in planned.stdout, planned.stderr


# ------------------------------------------------------- plans never admit the impossible


def llama70b_full_one_gpu(tmp_path, name="big.yaml", **resources_and_parallelism):
    """Llama-2-70B full on one A100-80GB, no resources.memory unless given."""
    resources = {"nodes": 1, "gpusPerNode": 1, "gpuType": "A100-80GB"}
    parallelism = {}
    for key, value in resources_and_parallelism.items():
        (parallelism if key == "cpuOffload" else resources)[key] = value
    doc = {
        "apiVersion": "ftjob.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "big"},
        "spec": {"model": {"source": "hf://meta-llama/Llama-2-70b-hf"},
                 "dataset": {"source": "hf://org/chat", "maxSeqLength": 2048},
                 "method": {"type": "full"}, "training": {"maxSteps": 10},
                 "resources": resources, "parallelism": parallelism},
    }  # fmt: skip
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def verdict_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.strip().startswith("verdict"))


def test_host_memory_is_checked_or_the_verdict_says_it_was_not(tmp_path):
    """The states offloaded to CPU need ~1 TiB a pod while training, and the export 1.4 TiB
    (the whole model gathered in fp32 beside them): without resources.memory that is not FITS
    but "not checked"; with too little memory it will not fit."""
    unchecked = ftjob("plan", llama70b_full_one_gpu(tmp_path, cpuOffload=True))
    line = verdict_line(unchecked.stdout)
    assert unchecked.returncode == 0, unchecked.stderr  # nothing failed; nothing claimed
    assert "FITS" not in line and "CPU MEMORY NOT CHECKED: a pod needs up to 1.4 TiB" in line
    assert "set resources.memory to check it" in line
    small = ftjob("plan", llama70b_full_one_gpu(tmp_path, cpuOffload=True, memory="200Gi"))
    assert small.returncode == 1
    assert "WILL NOT FIT" in verdict_line(small.stdout)
    assert "1.4 TiB of 200.0 GiB CPU memory per pod (peak while exporting" in verdict_line(
        small.stdout
    )
    big = ftjob("plan", llama70b_full_one_gpu(tmp_path, cpuOffload=True, memory="1500Gi"))
    assert big.returncode == 0 and verdict_line(big.stdout).split()[1] == "FITS:"


def test_cpu_offload_is_suggested_only_where_the_pod_has_the_memory(tmp_path):
    no_memory = ftjob("plan", llama70b_full_one_gpu(tmp_path))
    # Offload alone would move ~1 TiB of states to CPU memory nobody checked: not advice. (A
    # stack with LoRA asks less CPU memory than the job's own export and may be offered.)
    assert no_memory.returncode == 1 and "fits with  cpuOffload" not in no_memory.stdout
    with_memory = ftjob("plan", llama70b_full_one_gpu(tmp_path, memory="1500Gi"))
    offload = [line for line in with_memory.stdout.splitlines() if "fits with  cpuOffload" in line]
    assert offload and offload[0].endswith("1.4 TiB CPU memory per pod"), with_memory.stdout
    too_little = ftjob("plan", "-o", "json", llama70b_full_one_gpu(tmp_path, memory="500Gi"))
    (item,) = json.loads(too_little.stdout)["items"]
    changes = [o["change"] for o in item["options"]]
    assert changes and not any(c.startswith("cpuOffload") for c in changes)  # 1.4 TiB > 500


def test_stacked_suggestions_change_each_field_once_and_fit(tmp_path):
    """70B full on one A100 once suggested "method: lora + gpuType: H100-NVL-94GB + gpuType:
    H200-141GB": two GPU types joined, the estimate of neither."""
    result = ftjob("plan", "-o", "json", llama70b_full_one_gpu(tmp_path, memory="1200Gi"))
    options = json.loads(result.stdout)["items"][0]["options"]
    assert options
    for option in options:
        fields = [part.split(":")[0] for part in option["change"].split(" (")[0].split(" + ")]
        assert len(fields) == len(set(fields)), option["change"]
        assert option["perDeviceBytes"] <= 80 * 2**30, option


def test_plan_names_a_missing_model_once_with_the_fix_and_notes_missing_data(tmp_path):
    """plan estimates from the model's config.json, so a missing model folder refuses the job,
    named once with its field; missing data (on a cluster's volume) is only a note in both
    plan and validate (a job for a cluster, where a path names the volume)."""
    path, _ = tiny_job(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["model"]["source"] = "no-model"
    doc["spec"]["dataset"]["source"] = "data/none.jsonl"
    path.write_text(yaml.safe_dump(doc))
    planned = ftjob("plan", path)
    assert planned.returncode == 1 and planned.stdout == ""
    # The same words `ftjob run` prints before starting (ftjob/job/inputs.py: one check, one text).
    assert planned.stderr.splitlines() == [
        f"{path}: spec.model.source: no-model: no such folder (looked at "
        f"{tmp_path / 'no-model'}); fix: {inputs.MODEL_FIX}",
    ]
    validate = ftjob("validate", path)
    assert validate.returncode == 0, validate.stdout
    lines = [line.strip() for line in validate.stdout.splitlines()[1:]]
    notes = [line for line in lines if line.startswith("not checked")]  # (and the image warning)
    assert notes == [
        f"not checked: spec.model.source: no-model: no such folder (looked at "
        f"{tmp_path / 'no-model'}) on this machine (a cluster reads the path from the "
        "checkpoint volume)",
        DATA_NOTE.format(tmp_path / "data/none.jsonl"),
        validate_cli.MEMORY_UNCHECKED,  # the plan's memory verdict needs the model's shape
    ]


DATA_NOTE = (
    "not checked: spec.dataset.source: data/none.jsonl: no such file or folder (looked at {}) "
    "on this machine (a cluster reads the path from the checkpoint volume)"
)


def test_plan_plans_a_cluster_job_whose_data_is_on_the_volume_beside_a_refused_one(tmp_path):
    """`dataset.source: data/...` names the checkpoint volume on a cluster: plan prints the
    plan, its data row "data not checked here" and the note validate prints; a refused job in
    another file is reported on stderr and in -o json's "invalid", hiding no other plan."""
    path, _ = tiny_job(tmp_path, name="volume.yaml")
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["dataset"]["source"] = "data/none.jsonl"
    path.write_text(yaml.safe_dump(doc))
    bad, _ = tiny_job(tmp_path, name="bad.yaml", method={"type": "full", "lora": {"r": 8}})
    planned = ftjob("plan", bad, path)
    assert planned.returncode == 1
    assert planned.stderr.startswith(f"{bad}: spec.method.lora: ")
    assert planned.stdout.startswith(f"{path}: FineTuneJob tiny\n")
    (row,) = [line for line in planned.stdout.splitlines() if line.lstrip().startswith("data ")]
    assert "data not checked here (data/none.jsonl is not on this machine" in row
    assert f"  {DATA_NOTE.format(tmp_path / 'data/none.jsonl')}" in planned.stdout.splitlines()
    alone = ftjob("plan", path)
    assert alone.returncode == 0 and alone.stderr == "", alone.stderr
    as_json = json.loads(ftjob("plan", "-o", "json", bad, path).stdout)
    (item,) = as_json["items"]
    assert item["file"] == str(path) and item["notes"] == [
        DATA_NOTE.format(tmp_path / "data/none.jsonl")
    ]
    (refused,) = as_json["invalid"]
    assert refused["file"] == str(bad) and refused["errors"][0]["field"] == "spec.method.lora"


def test_h100_80gb_is_planned_with_its_memory_and_an_assumed_peak(tmp_path):
    """`gpuType: H100-80GB` is a valid job: 80 GB is certain, only the board's peak is not; the
    plan says which peak it assumed, and never suggests the name (a guessed step time)."""
    path = llama70b_full_one_gpu(tmp_path, gpuType="H100-80GB", memory="1200Gi")
    validated = ftjob("validate", path)
    assert validated.returncode == 0 and ": valid -- " in validated.stdout, validated.stdout
    planned = ftjob("plan", "-o", "json", path)
    (item,) = json.loads(planned.stdout)["items"]
    assert item["perDevice"]["deviceBytes"] == 80 * 2**30 and item["stepSeconds"] > 0
    text = ftjob("plan", path).stdout
    (row,) = [line for line in text.splitlines() if line.lstrip().startswith("throughput")]
    assert row.endswith(
        "; peak assumed 756 TFLOP/s (H100-80GB names no board: the slowest's; the trainer's MFU "
        "uses the device's own name)"
    )
    a100 = ftjob("plan", "-o", "json", llama70b_full_one_gpu(tmp_path, memory="1200Gi"))
    changes = [o["change"] for o in json.loads(a100.stdout)["items"][0]["options"]]
    assert not any("H100-80GB" in change for change in changes)


def test_plan_says_where_offloaded_states_live():
    """A plan showing 0 bytes of weights per GPU says they are in CPU memory, not missing."""
    planned = ftjob("plan", ROOT / "examples" / "llama31-70b-qlora.yaml")
    assert planned.returncode == 0, planned.stderr
    (row,) = [line for line in planned.stdout.splitlines() if line.lstrip().startswith("per GPU")]
    assert "weights 0.0 MiB" in row
    assert row.endswith("weights, gradients and optimizer states live in CPU memory (cpuOffload)")
    full = ftjob("plan", ROOT / "examples" / "llama3-8b-full-40gb.yaml").stdout
    assert "cpuOffload)" not in full


def test_settings_that_cannot_do_what_they_say_are_warned_of(tmp_path):
    """Valid, but a warmup longer than the run never reaches the peak rate, and evalEvery
    without held-out data never evaluates: validate says both; the example does not."""
    training = {"maxSteps": 60, "warmup": 500, "evalEvery": 20, "learningRate": 3e-3}
    path, doc = tiny_job(tmp_path, training=training)
    doc["spec"]["dataset"].pop("evalFraction")
    path.write_text(yaml.safe_dump(doc))
    result = ftjob("validate", path)
    assert result.returncode == 0, result.stdout
    # Each once, after the jobs, naming the job (as the image warning is).
    assert (
        "warning (tiny): spec.training.warmup: 500 is 500 steps of warmup with maxSteps 60: the "
        "learning rate never reaches its peak; lower warmup" in result.stdout
    )
    assert (
        "warning (tiny): spec.training.evalEvery: 20, but no eval data is held out" in result.stdout
    )
    quiet = ftjob("validate", ROOT / "examples" / "tiny.yaml")
    assert "spec.training" not in quiet.stdout


def unknown_lines(stdout: str) -> tuple[set[str], set[str]]:
    """(ftjob's, kubectl's) unknown fields as validate prints them, by field path."""
    ours, server = stdout.split("kubectl apply would be refused with:")
    return (
        set(re.findall(r"^  (\S+): unknown field", ours, re.M)),
        set(re.findall(r'unknown field "([^"]+)"', server)),
    )


@pytest.mark.parametrize(
    ("changes", "top", "fields"),
    [
        # two in one object
        ({"training": {"maxSteps": 5, "bogusOne": 1, "bogusTwo": 2}}, {},
         {"spec.training.bogusOne", "spec.training.bogusTwo"}),
        # two in two objects
        ({"training": {"maxSteps": 5, "bogusOne": 1}, "output": {"bogusTwo": 2}}, {},
         {"spec.training.bogusOne", "spec.output.bogusTwo"}),
        # two beside spec, at the document's top
        ({}, {"foo": 1, "bar": 2}, {"foo", "bar"}),
    ],
)  # fmt: skip
def test_every_unknown_field_is_named_both_ways(tmp_path, changes, top, fields):
    path, doc = tiny_job(tmp_path, **changes)
    path.write_text(yaml.safe_dump({**doc, **top}))
    result = ftjob("validate", path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert unknown_lines(result.stdout) == (fields, fields)


def test_a_schema_refusal_of_extra_keys_names_each_of_them():
    import jsonschema

    from ftjob.api import admission

    schema = {
        "properties": {"a": {"type": "object", "properties": {}, "additionalProperties": False}}
    }
    (err,) = jsonschema.Draft4Validator(schema).iter_errors({"a": {"x": 1, "y": 2}})
    assert admission._schema_message(err) == ("a.x", 'unknown field "a.x", unknown field "a.y"')


def test_plan_reads_nulls_as_the_api_server_does(tmp_path):
    """A null is an unset field in plan too (and in run: the same parse_resource): the plan of
    a job with nulls at every depth is the plan of the job without them."""
    with_nulls, doc = tiny_job(tmp_path, "nulls.yaml")
    spec = doc["spec"]
    spec["dataset"].update(evalFraction=None, maxSeqLength=None)
    spec["model"]["revision"] = None
    spec["training"]["learningRate"] = None
    spec.update(env=None, output=None, runPolicy=None)
    spec["scheduling"] = {"tolerations": [{"key": "a", "operator": "Exists", "value": None}]}
    with_nulls.write_text(yaml.safe_dump(doc))
    for key in ("env", "output", "runPolicy"):
        del spec[key]
    del spec["model"]["revision"], spec["training"]["learningRate"]
    del spec["dataset"]["evalFraction"], spec["dataset"]["maxSeqLength"]
    del spec["scheduling"]["tolerations"][0]["value"]
    without = tmp_path / "without.yaml"
    without.write_text(yaml.safe_dump(doc))
    a, b = ftjob("plan", with_nulls), ftjob("plan", without)
    assert a.returncode == b.returncode == 0, a.stderr
    assert a.stdout.replace("nulls.yaml", "without.yaml") == b.stdout
