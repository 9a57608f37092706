"""`ftjob run` about its inputs, as a person sees it: data left out of training counted and
shown, fix lines that fit the cause, missing paths named before torch starts, a data error
fixed and run again without --restart, a finished job answered at once, and node logs free of
torchao's optional-kernel noise.

python -m pytest tests/e2e/test_run_inputs.py -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import hangs
import yaml

from ftjob.api import contract
from ftjob.cli import failure

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}


def tiny_job(tmp_path: Path, name: str, **sections) -> Path:
    """examples/tiny.yaml with absolute sources and ``sections`` updated (dataset={...})."""
    doc = yaml.safe_load(TINY.read_text())
    doc["metadata"]["name"] = name
    for key in ("model", "dataset"):
        doc["spec"][key]["source"] = str(ROOT / "examples" / doc["spec"][key]["source"])
    for section, values in sections.items():
        doc["spec"].setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def ftjob_run(job: Path, workdir: Path, timeout: float = hangs.RUN) -> tuple[int, str, float]:
    started = time.monotonic()
    cmd = [sys.executable, "-m", "ftjob", "run", str(job), "--workdir", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


# ------------------------------------------ a data error fixed, truncation, rerun, node logs


def test_a_fixed_data_error_runs_its_cut_records_are_shown_and_a_rerun_is_answered_at_once(
    tmp_path,
):
    """A run that fails on its data trains nothing: pointing dataset.source at fixed data and
    running the same command again trains, with no refusal, no --restart, no .old-* folder.
    That run's records cut at maxSeqLength are counted and shown; the same command once more
    is answered from the folder without starting torch."""
    workdir = tmp_path / "short"
    bad = tmp_path / "bad.jsonl"
    good = (ROOT / "examples" / "data" / "tiny-chat.jsonl").read_text().splitlines()
    bad.write_text("\n".join([good[0], '{"conversation": []}', *good[2:40]]) + "\n")
    sections = {"dataset": {"maxSeqLength": 16}, "checkpoint": {"every": 4},
                "training": {"maxSteps": 4, "logEvery": 2, "evalEvery": 0}}  # fmt: skip
    refused = tiny_job(tmp_path, "short", **{**sections, "dataset": {"source": str(bad)}})
    code, out, _ = ftjob_run(refused, workdir)
    assert code == 1 and "line 2: has no field 'messages'" in out, out[-3000:]
    assert not workdir.exists()  # refused before any folder was made
    job = tiny_job(tmp_path, "short", **sections)  # the bundled, valid data
    code, out, _ = ftjob_run(job, workdir)
    assert code == 0, out[-3000:]
    assert "another spec" not in out and "exported model" in out
    assert [p.name for p in tmp_path.iterdir() if ".old-" in p.name] == []
    # On screen: how many records were cut, the tokens lost, and what to change.
    cut = re.search(r"data: \S+: ([\d,]+) of ([\d,]+) records cut at dataset.maxSeqLength=16: "
                    r"([\d,]+) tokens not trained on", out)  # fmt: skip
    assert cut, out
    assert re.search(r"warning: \d+% of the data is not trained on; raise dataset.maxSeqLength "
                     r"\(the longest record has [\d,]+ tokens\)", out), out  # fmt: skip
    # In the prepared data's record, the same numbers.
    (info_file,) = (workdir / "data").glob("*/info.json")
    train = json.loads(info_file.read_text())["train"]
    assert train["cutRecords"] == int(cut[1].replace(",", "")) > 0
    assert train["cutTokens"] == int(cut[3].replace(",", "")) > 0
    assert train["lostTokens"] == train["tokens"] - train["sequenceTokens"] >= train["cutTokens"]
    assert train["lostTokenFraction"] > 0.05
    # In the trainer's log too; and no torchao "Failed to load ..._C_mxfp8" in any node log.
    logs = sorted((workdir / "logs").glob("node-*.log"))
    assert len(logs) == 2 and cut[0] in logs[0].read_text()
    for log in logs:
        assert "_C_mxfp8" not in log.read_text() and "_C_cutlass" not in log.read_text()

    # The same command again: answered without starting torch, progress.json untouched.
    progress = (workdir / "progress.json").read_bytes()
    sizes = [log.stat().st_size for log in logs]
    code, again, seconds = ftjob_run(job, workdir)
    assert code == 0, again
    assert f"already trained (4 steps); the exported model is in {workdir / 'model'}" in again
    assert seconds < 5, seconds
    assert (workdir / "progress.json").read_bytes() == progress
    assert json.loads(progress)["step"] == 4 and json.loads(progress)["loss"] is not None
    assert [log.stat().st_size for log in logs] == sizes  # no process was started


# ---------------------------------------------------------------- local inputs, at once


def test_missing_model_and_data_are_named_before_any_process_starts(tmp_path):
    job = tiny_job(
        tmp_path, "gone", model={"source": "no-such-model"}, dataset={"source": "no/data.jsonl"}
    )
    code, out, seconds = ftjob_run(job, tmp_path / "gone")
    assert code == 1
    assert seconds < 5, seconds
    assert (
        f"ftjob run: {job}: spec.model.source: no-such-model: no such folder "
        f"(looked at {tmp_path / 'no-such-model'})"
    ) in out
    assert "  fix: set spec.model.source to a Hugging Face model folder (with config.json" in out
    assert (
        f"spec.dataset.source: no/data.jsonl: no such file or folder (looked at {tmp_path}" in out
    )
    assert "  fix: set spec.dataset.source to an existing file or folder" in out
    assert "fix the record" not in out
    assert not (tmp_path / "gone").exists()  # nothing started, nothing written


def test_a_model_folder_without_config_and_a_missing_resume_from_are_named_at_once(tmp_path):
    (tmp_path / "weights").mkdir()
    job = tiny_job(
        tmp_path, "seeded", model={"source": "weights"}, checkpoint={"resumeFrom": "other-job"}
    )
    code, out, seconds = ftjob_run(job, tmp_path / "seeded")
    assert code == 1 and seconds < 5, (seconds, out)
    assert "spec.model.source: weights: no config.json in that folder" in out
    assert f"spec.checkpoint.resumeFrom: other-job: no such folder (looked at {tmp_path}" in out
    assert not (tmp_path / "seeded" / "logs").exists()


def test_a_pickled_checkpoint_is_named_at_once_with_the_conversion(tmp_path):
    """The trainer reads safetensors only; `ftjob run` says so before torch starts."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text((ROOT / "examples" / "tiny-model" /
                                                   "config.json").read_text())  # fmt: skip
    (tmp_path / "old" / "pytorch_model.bin").write_bytes(b"pickled")
    code, out, seconds = ftjob_run(tiny_job(tmp_path, "old", model={"source": "old"}),
                                   tmp_path / "run")  # fmt: skip
    assert code == 1 and seconds < 5, (seconds, out)
    assert "spec.model.source: model.source old: the weights are in PyTorch's pickle format " \
           "only (pytorch_model.bin)" in out  # fmt: skip
    assert "  fix: convert it to safetensors once, e.g. python -c" in out
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ fix lines by cause


def refusal(out: str) -> tuple[str, str]:
    """(headline, fix) of a run refused before it started anything."""
    lines = out.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("ftjob run: "))
    return lines[i], lines[i + 1]


def test_a_chat_file_with_conversations_gets_the_messages_field_fix_before_anything_starts(
    tmp_path,
):
    """Issue 40: the data is read by `ftjob run` itself, not after each trainer's imports."""
    data = tmp_path / "sharegpt.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"id": 1, "conversations": turns}) + "\n")
    job = tiny_job(tmp_path, "convs", dataset={"source": str(data)})
    code, out, _ = ftjob_run(job, tmp_path / "convs")
    assert code == 1
    headline, fix = refusal(out)
    assert headline == (
        f"ftjob run: {job}: BadData: {data} line 1: has no field 'messages' "
        "(dataset.messagesField); it has ['conversations', 'id']"
    ), out
    assert fix == "  fix: set dataset.messagesField: conversations", out
    # No trainer was started: no job folder, so no node log, progress or recorded spec.
    assert not (tmp_path / "convs").exists()


def test_a_json_error_names_its_column_and_the_fix_is_the_json(tmp_path):
    data = tmp_path / "broken.jsonl"
    whole = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    data.write_text(f'{whole}\n{{"messages": [{{"role": "user", "content": "hi"}}], "x": nope}}\n'
                    f"{whole[:-1]}\n")  # fmt: skip
    job = tiny_job(tmp_path, "json", dataset={"source": str(data)})
    code, out, _ = ftjob_run(job, tmp_path / "json")
    assert code == 1
    headline, fix = refusal(out)
    assert f"BadData: {data} line 2: not valid JSON at column 56 (Expecting value)" in headline
    assert fix == "  fix: fix the JSON at that line and column of spec.dataset.source"
    # A line cut short at the end (a download that stopped) is named too.
    data.write_text(f"{whole}\n{whole}\n{whole[:-1]}\n")
    code, out, _ = ftjob_run(job, tmp_path / "json")
    headline, _ = refusal(out)
    assert code == 1 and f"{data} line 3: not valid JSON at column" in headline, out
    assert "(the line ends before the JSON does: cut short?)" in headline
    assert not (tmp_path / "json").exists()


def test_a_pods_trainer_names_a_missing_data_file_with_the_source_fix(tmp_path):
    """On a cluster no `ftjob run` checks first: the trainer's record and log carry the fix,
    and the summary read from either says to change the source, not to fix a record."""
    doc = yaml.safe_load(tiny_job(tmp_path, "pod", dataset={"source": "gone.jsonl"}).read_text())
    spec_file = tmp_path / "pod-spec.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    record = tmp_path / "termination-log"
    env = {**ENV, "FTJOB_JOB_DIR": str(tmp_path / "job"), "FTJOB_TERMINATION_LOG": str(record),
           "FTJOB_SOURCE_ROOT": str(tmp_path)}  # fmt: skip
    cmd = [sys.executable, "-m", "ftjob.trainer", "--spec", str(spec_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hangs.RUN)
    assert proc.returncode == 1
    fix = "set spec.dataset.source to an existing file or folder"
    assert json.loads(record.read_text())["fix"].startswith(fix)
    lines = proc.stderr.splitlines()
    said = next(i for i, x in enumerate(lines) if x.startswith("error: rank 0: BadData: "))
    assert f"gone.jsonl: no such file (looked at {tmp_path / 'gone.jsonl'})" in lines[said]
    assert lines[said + 1] == f"  fix: {json.loads(record.read_text())['fix']}"
    # What `ftjob run` and the operator's log fallback make of it, record or not.
    for rec in (contract.parse(record.read_text()), None):
        s = failure.summarize([failure.NodeOutcome(0, 1, rec, lines, "node-0.log")])
        assert s.fix.startswith(fix) and "record" not in s.fix


def without(tmp_path: Path, module: str) -> dict[str, str]:
    """The environment of a Python (and of every process it starts) where ``module`` cannot
    be imported and find_spec finds nothing, as where its extra is not installed."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(hide), ENV.get("PYTHONPATH", "")])}


def test_a_tracker_whose_client_is_not_installed_is_refused_at_once_with_the_install(tmp_path):
    """Without the tracking extra, a job asking for TensorBoard is refused before anything
    starts, with the install command: not trained untracked and then "already trained"."""
    job = tiny_job(tmp_path, "tracked", tracking={"tensorboard": {"enabled": True}})
    env = without(tmp_path, "tensorboard")
    cmd = [sys.executable, "-m", "ftjob", "run", str(job), "--workdir", str(tmp_path / "t")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hangs.RUN)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"ftjob run: {job}: spec.tracking.tensorboard: the tensorboard client " in out, out
    assert "  fix: pip install 'ftjob[tracking]' (or remove spec.tracking.tensorboard)" in out
    assert not (tmp_path / "t").exists()  # nothing trained untracked


# The lines torchao's import prints (torch's pytree warnings for its enums; on a CPU-only
# torch, "Failed to load .../_C_mxfp8...so"), in any script that imports transformers' models.
TORCHAO_NOISE = re.compile(r"torchao|_C_mxfp8|_C_cutlass|KernelPreference|register_constant")
USER_SCRIPT = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokens = AutoTokenizer.from_pretrained(sys.argv[1])("hello", return_tensors="pt")
imported = sys.modules.get("torchao") is not None
print("logits", tuple(model(**tokens).logits.shape), imported)
"""


def test_a_trainer_only_install_trains_and_its_export_loads_without_torchao_noise(tmp_path):
    """With ftjob[trainer] alone (torchao is the qlora extra's), a LoRA job trains and
    exports, and a user's own script that loads the export (the adapter on its base, as
    transformers loads one) prints nothing of torchao."""
    env = without(tmp_path, "torchao")
    steps = {"maxSteps": 2, "logEvery": 1, "evalEvery": 0}
    job = tiny_job(tmp_path, "lora", method={"type": "lora"}, training=steps)
    cmd = [sys.executable, "-m", "ftjob", "run", str(job), "--workdir", str(tmp_path / "w")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hangs.RUN)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    user = [sys.executable, "-c", USER_SCRIPT, str(tmp_path / "w" / "model")]
    loaded = subprocess.run(user, capture_output=True, text=True, env=env, timeout=hangs.RUN)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.startswith("logits (1, ") and loaded.stdout.endswith(" False\n")
    assert not TORCHAO_NOISE.search(loaded.stderr), loaded.stderr
