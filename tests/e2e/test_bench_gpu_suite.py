"""The GPU suite's code, run on CPU: bench/gpu.py's ``compare`` with ``SMOKE`` (the tiny
model, 2 CPU processes, fp32) instead of the ~1B model on GPUs.

    python -m pytest tests/e2e/test_bench_gpu_suite.py -q -m kit

Every test here is marked ``kit``: the GPU kit's own tests, run before a device call, not in
CI (pyproject's addopts leave them out; bench/README.md).

It checks the plumbing a GPU session relies on (the generated job, ``ftjob run``, the TRL
worker with the same packing and attention as ftjob, reading both sides' numbers into rows),
not speed: no timing is asserted.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import hangs
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder of the repo, not an installed package

from bench import gpu  # noqa: E402
from ftjob.trainer.model import attention  # noqa: E402


@pytest.mark.kit
def test_gpu_suite_compares_ftjob_and_trl_for_full_and_lora(tmp_path):
    result = gpu.compare(tmp_path, gpu.SMOKE, ["full", "lora"])
    assert [c["method"] for c in result["cases"]] == ["full", "lora"]
    for case in result["cases"]:
        assert case["ftjob"] > 0 and case["trl"] > 0
        assert case["trlWrapper"] == "DistributedDataParallel"  # accelerate on CPU
        # Like with like: TRL packs as ftjob does, through ftjob's packed attention.
        assert case["trlPacking"] == "bfd" and case["trlAttention"] == attention.NAME
        assert 1 < case["attentionLength"] <= gpu.SMOKE.seq  # documents, not whole rows
        assert case["ftjobMfu"] is None and case["trlMfu"] is None  # no peak FLOP/s on CPU
        for losses in (case["ftjobLosses"], case["trlLosses"]):
            assert len(losses) == gpu.SMOKE.steps and all(math.isfinite(x) for x in losses)
    rows = result["rows"]
    assert len(rows) == 4
    assert rows[0]["measurement"].startswith("tokens/s, ") and rows[0]["ratio"] > 0
    assert rows[1]["goal"] == f">= {gpu.MFU_GOAL}" and rows[1]["met"] is False


def rehearse(tmp_path: Path, python: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    """bash bench/gpu_kit/run.sh MODE rehearse on ``python`` (the torch 2.11 venv standing in
    for the image) with the kit's wheels installed offline on top; its output folder."""
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    wheels = python.parents[2] / f"kit-wheels-{version}"  # beside the venv, reused
    subprocess.run([sys.executable, "-m", "bench.gpu_kit.gather", "--python", version, "--dest",
                    str(wheels)], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "KIT_WORKDIR": str(tmp_path / "work"),
           "KIT_WHEELS": str(wheels), "PYTHON": str(python),
           "KIT_CAP_SCALE": str(hangs.SLOWER)}  # fmt: skip
    env.pop("PYTHONPATH", None)  # the kit puts the checkout and its wheels there itself
    done = subprocess.run(["bash", "bench/gpu_kit/run.sh", mode, "rehearse"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=hangs.after(420))  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"^install: \d+ wheels into ", summary, re.MULTILINE), summary
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.parent == out for p in files)
    return done, out


def results(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def steps_ok(out: Path, names: list[str]) -> None:
    summary = (out / "summary.txt").read_text()
    for name in names:
        assert re.search(rf"^{name}: ok in \d+s$", summary, re.MULTILINE), summary


# The kit's own limits (420 s in all) times the suite's margin for a shared machine, with the
# test's own setup (the venv, the wheels) beside it.
@pytest.mark.kit
@pytest.mark.timeout(hangs.after(420) + hangs.RUN)
def test_the_main_call_rehearsed_on_cpu_profiles_first_then_measures_ftjob_against_trl(
    tmp_path, torch_floor
):
    """bash bench/gpu_kit/run.sh main rehearse: the main call's install (the kit's wheels,
    offline, onto the torch 2.11 venv standing in for the image), steps and files, with the
    tiny model on one CPU process. Each step's cap and the budget are the device call's times
    hangs.SLOWER (KIT_CAP_SCALE): a loaded 2-core machine timed out honest steps at the
    device's own caps (env 60 s, ftjob-full 90 s)."""
    _, out = rehearse(tmp_path, torch_floor, "main")
    steps_ok(out, ["env", "profile", "versus-trl"])
    found = results(out)
    assert [r["step"] for r in found] == ["env", "kernels", "profile", "ftjob-default",
                                          "trl-defaults", "trl-same"]  # fmt: skip
    by = {r["step"]: r for r in found}
    assert by["env"]["torch"].startswith("2.11.") and "cuda" in by["kernels"]  # no GPU here
    # The profile: 3 steps after the trainer's warm-up, of ftjob's default job as auto chose it.
    profiled = by["profile"]
    assert profiled["steps"] == 3 and profiled["device"] == "cpu"
    assert profiled["busyFraction"] is None and profiled["cpuOpFraction"] > 0  # no device
    assert 0 < len(profiled["longest"]) <= 10 and profiled["longest"][0]["selfMs"] > 0
    assert profiled["hostSyncs"]["localScalarDense"] >= 0 and profiled["compiled"] is False
    assert json.loads((out / "profile.json").read_text()) == {
        k: v for k, v in profiled.items()
        if k not in ("step", "time", "sharding", "activationCheckpointing", "compiled", "setup")
    }  # fmt: skip
    ours = by["ftjob-default"]
    assert ours["tokensPerSecond"] > 0 and len(ours["losses"]) == gpu.REHEARSAL.steps
    assert ours["attention"] == f"{attention.NAME}: scaled_dot_product_attention per document"
    assert ours["plannedMiB"] > 0 and ours["sharding"] == profiled["sharding"]
    # TRL left alone: no packing, transformers' sdpa, recomputation on (TRL's defaults) ...
    theirs = by["trl-defaults"]
    assert (theirs["packing"], theirs["attention"], theirs["gradientCheckpointing"]) == (
        None, "sdpa", True)  # fmt: skip
    # ... and with ftjob's settings: its packing, its attention, recomputation as it chose.
    same = by["trl-same"]
    assert (same["packing"], same["attention"]) == ("bfd", attention.NAME)
    assert same["gradientCheckpointing"] == (ours["activationCheckpointing"] != "none")
    for r in (theirs, same):
        assert r["tokensPerSecond"] > 0 and len(r["losses"]) == gpu.REHEARSAL.steps
    # The trainer's transformers and peft came from the carried wheels, not the venv's own.
    assert re.search(r"^ +transformers +\S+ +\S+/site$", (out / "env.log").read_text(), re.M)


@pytest.mark.kit
@pytest.mark.timeout(hangs.after(420) + hangs.RUN)
def test_the_second_call_rehearsed_on_cpu_measures_compile_offload_the_stall_and_8b_lora(
    tmp_path, torch_floor
):
    """bash bench/gpu_kit/run.sh rest rehearse: every step of the second call runs on CPU
    before it first runs on a GPU (the tiny model stands in for the 3B and 8B shapes)."""
    _, out = rehearse(tmp_path, torch_floor, "rest")
    steps_ok(out, ["env", "compile-3b", "offload", "ckpt-stall", "lora-8b"])
    found = results(out)
    assert [r["step"] for r in found] == ["env", "kernels", "compile-3b", "offload",
                                          "ckpt-stall", "lora-8b"]  # fmt: skip
    by = {r["step"]: r for r in found}
    assert by["compile-3b"]["compiled"] is True and by["compile-3b"]["plannedMiB"] > 0
    assert by["offload"]["method"] == "qlora + cpuOffload" and by["offload"]["plannedMiB"] > 0
    stall = by["ckpt-stall"]
    assert len(stall["stepSeconds"]) == 8 and all(x > 0 for x in stall["stepSeconds"])
    assert (stall["savedAfterStep"], stall["asyncSave"]) == (4, True)
    lora = by["lora-8b"]
    assert lora["tokensPerSecond"] > 0 and lora["yardstick"] == 12473
    for name in ("compile-3b", "offload", "lora-8b"):
        assert len(by[name]["losses"]) == gpu.REHEARSAL.steps


@pytest.mark.kit
@pytest.mark.timeout(hangs.after(420) + hangs.RUN)
def test_the_fp8_call_rehearsed_on_cpu_runs_bf16_then_fp8_compiled_at_both_shapes(
    tmp_path, torch_floor
):
    """bash bench/gpu_kit/run.sh fp8 rehearse: issue 58's call on the image's torch with the
    kit's torchao, float8 emulated and compile on aot_eager; the tiny model stands in for the
    1B full fine-tune and the 8B-shaped LoRA."""
    _, out = rehearse(tmp_path, torch_floor, "fp8")
    steps_ok(out, ["env", "fp8-1b", "fp8-8b"])
    found = results(out)
    assert [(r["step"], r.get("precision")) for r in found] == [
        ("env", None), ("kernels", None), ("fp8-1b", "bf16"), ("fp8-1b", "fp8"),
        ("fp8-8b", "bf16"), ("fp8-8b", "fp8")]  # fmt: skip
    for r in found[2:]:
        assert r["compiled"] is True and r["tokensPerSecond"] > 0 and r["plannedMiB"] > 0
        assert len(r["losses"]) == gpu.REHEARSAL.steps  # 12 on the GPU
    assert [r["method"] for r in found[2:]] == ["full", "full", "lora", "lora"]
    # Float8 rounding happened: each fp8 curve differs from its bf16 twin.
    assert found[3]["losses"] != found[2]["losses"] and found[5]["losses"] != found[4]["losses"]
