"""The trainer end to end: `ftjob run` with 2 real processes (2 nodes x 1 CPU process).

    python -m pytest tests/e2e/test_trainer_run.py -q

Runs are module-scoped and shared between the assertions about them: a full fine-tune, the
same job killed (SIGKILL of rank 1) and resumed, a LoRA run whose model source is relative to
the job file (QLoRA: test_qlora.py).
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import hangs
import in_process
import pytest
import torch
import yaml

from ftjob.api import contract

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
INJECT = Path(__file__).resolve().parent / "inject"
RUN_TIMEOUT = hangs.RUN  # one tiny run (tests/hangs.py)

BASE = {
    "apiVersion": "ftjob.dev/v1alpha1",
    "kind": "FineTuneJob",
    "metadata": {"name": "t"},
    "spec": {
        "model": {"source": str(EXAMPLES / "tiny-model")},
        "dataset": {
            "source": str(EXAMPLES / "data" / "tiny-text.jsonl"),
            "format": "text",
            "maxSeqLength": 128,
            "evalFraction": 0.02,
        },
        "method": {"type": "full"},
        "training": {
            "maxSteps": 30,
            "learningRate": 3e-3,
            "warmup": 2,
            "microBatchSize": 2,
            "activationCheckpointing": "all",
            "logEvery": 1,
            "evalEvery": 0,
        },
        "resources": {"nodes": 2, "gpusPerNode": 0},
        # Sharded, as on GPUs: auto would replicate the tiny model (test_sharding_layouts.py),
        # and these tests check that checkpoints, resume and export work from shards.
        "parallelism": {"sharding": "full"},
        "checkpoint": {"volume": {"claimName": "shared"}, "every": 4, "keep": 2},
    },
}


def job(name: str, **changes) -> dict:
    """BASE with spec sections updated, e.g. job("x", method={"type": "lora"})."""
    doc = copy.deepcopy(BASE)
    doc["metadata"]["name"] = name
    for section, values in changes.items():
        doc["spec"].setdefault(section, {}).update(values)
    return doc


def start(doc: dict, workdir: Path) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    job_file = workdir.parent / f"{workdir.name}.yaml"
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    cmd = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(workdir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip


def injected(monkeypatch, fault: str) -> None:
    """Every process of the next run imports tests/e2e/inject with ``fault``."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{INJECT}{os.pathsep}{path}" if path else str(INJECT))
    monkeypatch.setenv("FTJOB_TEST_INJECT", fault)


def hold_after(monkeypatch, step: int, gate: Path) -> None:
    """Rank 1 of the next run waits before its step ``step + 1`` until ``gate`` exists or its
    SIGTERM arrived: a test that acts on a run at ``step`` (a signal, a stopped process) must
    act before it ends, and a step of this job takes ~0.1 s, less than a busy machine gives a
    test to find a pid. Only the first gang waits (the SIGTERM makes ``gate``)."""
    injected(monkeypatch, f"hold:1:{step + 1}:{gate}")


def start_held(doc: dict, workdir: Path, step: int) -> subprocess.Popen:
    """:func:`start` with rank 1 held before step ``step + 1`` (:func:`hold_after`) until the
    test kills it; a rerun started later runs without the hold."""
    with pytest.MonkeyPatch.context() as patch:
        hold_after(patch, step, workdir.parent / f"{workdir.name}-gate")
        return start(doc, workdir)


def killed_mid_run(doc: dict, workdir: Path, step: int, ready=None) -> tuple[int, str, int]:
    """Run ``doc`` in ``workdir`` with no restart in place, rank 1 held before step
    ``step + 1``, and SIGKILL rank 1 once step ``step`` is logged (or ``ready(workdir)``
    holds): the run's exit code, its output and the last step logged. A rerun resumes."""
    doc["spec"]["runPolicy"] = {"inPlaceRestarts": 0}
    ready = ready or (lambda folder: max(losses(folder), default=0) >= step)
    proc = start_held(doc, workdir, step)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ready(workdir):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(rank_pid(workdir, 1), signal.SIGKILL)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    return proc.returncode, out, max(losses(workdir))


def run(doc: dict, workdir: Path) -> tuple[int, str]:
    proc = start(doc, workdir)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    return proc.returncode, out


def history(workdir: Path, event: str = "step") -> list[dict]:
    path = workdir / "progress.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written while we read
            continue
    return [r for r in rows if r["event"] == event]


def losses(workdir: Path) -> dict[int, float]:
    """step -> loss; a resumed run's later lines overwrite the first attempt's."""
    return {r["step"]: r["loss"] for r in history(workdir)}


def eval_loss_of(model, workdir: Path) -> float:
    """Eval loss of a reloaded model, on the eval set the trainer used (one process)."""
    from ftjob.api.jobspec import parse_resource
    from ftjob.trainer.data import batches as data
    from ftjob.trainer.model.load import load_tokenizer
    from ftjob.trainer.objectives.loss import token_loss

    _, spec = parse_resource(json.loads((workdir / "spec.json").read_text()))
    # Relative sources resolve beside the job file, which start() writes beside the workdir.
    with mock.patch.dict(os.environ, {"FTJOB_SOURCE_ROOT": str(workdir.parent)}):
        ds = data.load(spec, load_tokenizer(spec), workdir)  # the trainer's prepared data
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for batch in data.eval_batches(ds, 0, 1, spec.training.micro_batch_size):
            loss, n = token_loss(model, batch, torch.device("cpu"))
            total, count = total + float(loss), count + n
    return total / count


def final(workdir: Path) -> dict:
    return json.loads((workdir / "progress.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


# ------------------------------------------------------------------------------ formats


def unicode_and_long_records(path: Path) -> Path:
    """Text records in several scripts, with emoji, and some far longer than maxSeqLength."""
    lines = ["Ünïcødé ✓ naïve café 🚀", "日本語のテキストです。", "Ελληνικά και русский текст"]
    rows = [{"text": f"{lines[i % 3]} {i}. " + ("lorem ipsum " * (400 if i % 10 == 0 else 3))}
            for i in range(300)]  # fmt: skip
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["chat", "instruction", "unicode-long-text"])
def test_every_usual_format_trains(runs, fmt, monkeypatch):
    """Chat (system prompts, multi-turn, assistant turns only), prompt/completion and unicode
    text with records longer than a sequence: each trains, and its loss drops. What a format
    changes is one rank's data and loss, so the trainer runs here as a gang of one
    (tests/in_process.py): no process start per format."""
    if fmt == "unicode-long-text":
        kind, source = "text", unicode_and_long_records(runs / f"{fmt}.jsonl")
    else:
        kind, source = fmt, EXAMPLES / "data" / f"tiny-{fmt.removesuffix('ion')}.jsonl"
    doc = job(fmt, dataset={"source": str(source), "format": kind},
              training={"maxSteps": 15}, checkpoint={"every": 15})  # fmt: skip
    doc["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 0}
    in_process.train(doc, runs / fmt, monkeypatch)
    curve = losses(runs / fmt)
    assert sorted(curve) == list(range(1, 16))
    assert sum(curve[s] for s in (13, 14, 15)) / 3 < curve[1] - 0.5, curve


# ---------------------------------------------------------------------------------- full


@pytest.fixture(scope="module")
def full(runs):
    code, out = run(job("full"), runs / "full")
    assert code == 0, out
    return runs / "full", out


def test_full_run_lowers_the_loss_and_prints_the_export(full):
    workdir, out = full
    curve = losses(workdir)
    assert sorted(curve) == list(range(1, 31))
    first, last = curve[1], sum(curve[s] for s in (28, 29, 30)) / 3
    assert last < first - 1.5, curve
    assert f"the exported model is in {workdir / 'model'}" in out


def test_full_run_keeps_the_last_k_committed_checkpoints(full):
    workdir, _ = full
    kept = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    assert kept == ["step-00000024", "step-00000028"]
    for name in kept:
        folder = workdir / "checkpoints" / name
        assert (folder / "COMMITTED").is_file() and (folder / ".metadata").is_file()
        assert {p.name for p in folder.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}


def test_full_export_reloads_with_the_trained_models_eval_loss(full):
    from transformers import AutoModelForCausalLM

    workdir, _ = full
    export = workdir / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in export.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(export)
    trained = final(workdir)["evalLoss"]
    assert eval_loss_of(model, workdir) == pytest.approx(trained, abs=1e-5)


def modes(export: Path) -> dict[str, str]:
    return {str(p.relative_to(export)): oct(p.stat().st_mode & 0o777) for p in export.rglob("*")}


def umasked(kind: str) -> str:
    umask = os.umask(0)  # the mode the trainer's processes (this one's children) give files
    os.umask(umask)
    return oct((0o777 if kind == "dir" else 0o666) & ~umask)


def test_full_export_is_readable_like_the_rest_of_the_folder(full):
    """Every file of the export has the umask's mode, as spec.json and progress.json do
    (safetensors writes 0600: a serving pod with another uid could not read the weights)."""
    workdir, _ = full
    export = workdir / "model"
    assert (
        modes(export)["model.safetensors"]
        == umasked("file")
        == oct((workdir / "spec.json").stat().st_mode & 0o777)
    )
    assert set(modes(export).values()) == {umasked("file")}
    assert oct(export.stat().st_mode & 0o777) == umasked("dir")


def test_progress_json_is_the_documented_contract(full):
    workdir, _ = full
    snap = final(workdir)
    assert snap["phase"] == "succeeded"
    assert (snap["step"], snap["totalSteps"]) == (30, 30)
    assert snap["exportPath"] == str(workdir / "model")
    assert snap["mfu"] is None  # CPU: no meaningful peak FLOP/s
    assert snap["tokensPerSecond"] > 0 and snap["lastCheckpointStep"] == 28
    assert snap["activationCheckpointing"] == 1  # "all": every layer recomputed
    # Tokens are counted on every rank and summed (not rank 0's times the world size): the
    # real tokens of every sequence the sampler gave either rank, padding left out.
    from ftjob.trainer.data import batches as data

    (train,) = (workdir / "data").glob("*/train")
    seqs = data.Sequences.open(train)
    sampler = data.Sampler(len(seqs), 42, world=2, micro_batch=2, accumulation=1)
    picked = [i for s in range(30) for r in (0, 1) for i in sampler.indices(s, 0, r)]
    assert snap["tokensSeen"] == sum(len(row["input_ids"]) for row in seqs.rows(picked))
    assert isinstance(snap["port"], int) and snap["port"] > 0
    # Each node's termination record (ftjob.api.contract), as a pod's message file.
    record = json.loads((workdir / "logs" / "node-0.termination").read_text())
    # Rank 0's record carries the numbers it ended with (the operator shows them).
    progress = contract.final_progress(snap)
    assert progress["step"] == 30 and progress["lastCheckpointStep"] == 28
    assert record == {"outcome": "succeeded", "exportPath": str(workdir / "model"),
                      "progress": progress}  # fmt: skip


# ---------------------------------------------------------------------------------- resume


def job_processes(workdir: Path):
    """(pid, environment, command line) of every process of the job in ``workdir`` (found by
    its FTJOB_JOB_DIR)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(
                item.split("=", 1)
                for item in (proc / "environ").read_text().split("\0")
                if "=" in item
            )
            cmdline = (proc / "cmdline").read_text()
        except OSError:
            continue
        if env.get("FTJOB_JOB_DIR") == str(workdir):
            yield int(proc.name), env, cmdline


def rank_pid(workdir: Path, rank: int) -> int | None:
    """The trainer process of ``rank`` in this job (found by its environment)."""
    for pid, env, cmdline in job_processes(workdir):
        if (
            env.get("RANK") == str(rank)
            and "ftjob.trainer" in cmdline
            and "torch.distributed.run" not in cmdline
        ):
            return pid
    return None


@pytest.fixture(scope="module")
def killed(runs):
    """The full job again: rank 1 SIGKILLed mid-run, then `ftjob run` once more."""
    workdir = runs / "killed"
    # No restart in place (test_recovery.py has those): the ladder's last rung, then a rerun.
    code1, out, killed_at = killed_mid_run(job("full"), workdir, 6)
    # Leftovers a crash can leave: a half-written save and a folder that was never committed.
    (workdir / "checkpoints" / ".tmp-step-00000032").mkdir()
    (workdir / "checkpoints" / "step-00000096").mkdir()
    (workdir / "checkpoints" / "step-00000096" / "__0_0.distcp").write_bytes(b"partial")
    code, out2 = run(job("full"), workdir)
    return workdir, code1, out, killed_at, code, out2


def test_a_killed_rank_fails_the_run_with_its_error(killed):
    _, code, out, killed_at, _, _ = killed
    assert killed_at < 30
    assert code == 1
    # The rank killed from outside leaves no record: its log's exit code says what happened.
    assert re.search(r"ftjob run: node 1 \(rank 1\) failed: killed \(SIGKILL\)", out), out
    assert "run it again: it resumes from the newest checkpoint" in out


def test_restart_resumes_from_newest_complete_checkpoint_ignoring_partial(killed):
    workdir, _, _, killed_at, code, out = killed
    assert code == 0, out
    assert f"resuming from checkpoint {workdir / 'checkpoints'}/step-" in out
    line = next(x for x in out.splitlines() if "resuming from checkpoint" in x)
    step = int(line.rsplit("(step ", 1)[1].rstrip(")"))
    assert 4 <= step <= killed_at and step % 4 == 0
    assert "step-00000096" not in line


def test_resumed_losses_equal_the_uninterrupted_run(killed, full):
    workdir = killed[0]
    resumed, reference = losses(workdir), losses(full[0])
    assert sorted(resumed) == list(range(1, 31))
    diffs = [abs(resumed[s] - reference[s]) for s in range(1, 31)]
    print(f"resume parity: max |loss difference| = {max(diffs)}")
    assert max(diffs) == 0.0


# ---------------------------------------------------------------------------------- lora


# The tiny base is random: adapters learn visibly only with the output head adapted too.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
LORA = {"type": "lora", "lora": {"r": 16, "alpha": 16, "dropout": 0.0, "targetModules": TARGETS}}
ADAPTER_TRAINING = {"maxSteps": 20, "learningRate": 1e-2, "evalEvery": 10}


@pytest.fixture(scope="module")
def lora(runs):
    # The base named as a job file beside it names it: relative to the job file's folder.
    (runs / "tiny-model").symlink_to(EXAMPLES / "tiny-model")
    doc = job(
        "lora",
        model={"source": "tiny-model"},
        method=LORA,
        training=ADAPTER_TRAINING,
        output={"mergeAdapter": True},
        checkpoint={"every": 8, "asyncSave": True},
    )
    code, out = run(doc, runs / "lora")
    assert code == 0, out
    return runs / "lora"


def test_lora_run_lowers_the_loss(lora):
    curve = losses(lora)
    assert sorted(curve) == list(range(1, 21))
    assert sum(curve[s] for s in (18, 19, 20)) / 3 < curve[1] - 1.5, curve
    # the async checkpoints were committed too
    assert sorted(p.name for p in (lora / "checkpoints").iterdir()) == [
        "step-00000008",
        "step-00000016",
    ]


def test_lora_adapter_and_merged_model_reload_with_equal_loss(lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export = lora / "model"
    trained = final(lora)["evalLoss"]
    base = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model")
    adapted = PeftModel.from_pretrained(base, export)
    assert eval_loss_of(adapted, lora) == pytest.approx(trained, abs=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(export / "merged")
    assert eval_loss_of(merged, lora) == pytest.approx(trained, abs=1e-4)


def test_lora_adapter_names_the_jobs_model_source_and_is_readable(lora, tmp_path, monkeypatch):
    """adapter_config.json names the base by its absolute path (the job's tiny-model is
    relative to the job file), so from_pretrained loads the adapter from any working folder;
    every file, merged/ included, is readable like the rest of the folder."""
    from peft import PeftConfig
    from transformers import AutoModelForCausalLM

    export = lora / "model"
    config = json.loads((export / "adapter_config.json").read_text())
    base = config["base_model_name_or_path"]
    assert Path(base).is_absolute() and (Path(base) / "config.json").is_file(), base
    assert PeftConfig.from_pretrained(export).base_model_name_or_path == base
    monkeypatch.chdir(tmp_path)  # not the job file's folder: a relative base would not resolve
    assert AutoModelForCausalLM.from_pretrained(export) is not None
    assert "base_model" not in (export / "README.md").read_text()  # no training-machine path
    found = modes(export)
    assert {"adapter_model.safetensors", "merged/model.safetensors"} <= set(found)
    assert found["merged"] == umasked("dir")
    assert {m for name, m in found.items() if name != "merged"} == {umasked("file")}


# ---------------------------------------------------------------------------------- errors


def test_bad_data_fails_at_once_naming_file_and_line(runs, tmp_path, monkeypatch):
    """`ftjob run` reads the records before it starts any process; a pod's trainer, which no
    `ftjob run` checked for, names the same line in its termination record (reading data is
    one rank's: the trainer in this process, as a gang of one, tests/in_process.py)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine too"}\n{"text": oops}\n')
    doc = job("bad-data", dataset={"source": str(bad)})
    code, out = run(doc, runs / "bad-data")
    assert code == 1
    assert f"BadData: {bad} line 3: not valid JSON" in out, out
    assert not (runs / "bad-data" / "logs").exists()  # no node was started
    doc["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 0}
    record = tmp_path / "termination-log"
    monkeypatch.setenv("FTJOB_TERMINATION_LOG", str(record))
    in_process.fails(doc, tmp_path / "job", monkeypatch)
    written = json.loads(record.read_text())
    assert written["reason"] == "BadData" and f"{bad} line 3" in written["message"], written


def test_bad_spec_is_refused_before_any_process_starts(tmp_path):
    doc = job("bad-spec", training={"maxSteps": 0})
    code, out = run(doc, tmp_path / "bad-spec")
    assert code == 1
    assert "spec.training.maxSteps" in out
    assert not (tmp_path / "bad-spec" / "spec.json").exists()


def test_ctrl_c_stops_every_process(runs):
    workdir = runs / "interrupted"
    proc = start(job("interrupted", training={"maxSteps": 500}), workdir)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not losses(workdir):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    assert rank_pid(workdir, 0) and rank_pid(workdir, 1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted; every process stopped" in out
    assert rank_pid(workdir, 0) is None and rank_pid(workdir, 1) is None


def test_trainer_entry_refuses_a_bad_spec_naming_the_field(tmp_path):
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(yaml.safe_dump(job("bad", dataset={"maxSeqLength": 4})))
    cmd = [sys.executable, "-m", "ftjob.trainer", "--spec", str(spec_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "spec.dataset.maxSeqLength: must be an integer between 16" in proc.stderr
