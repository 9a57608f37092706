"""The GPU suite's code, run on CPU: bench/gpu.py's ``compare`` with ``SMOKE`` (the tiny
model, 2 CPU processes, fp32) instead of the ~1B model on GPUs.

    python -m pytest tests/e2e/test_bench_gpu_suite.py -q

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


# The kit's own limits (420 s in all) times the suite's margin for a shared machine, with the
# test's own setup (the venv, the wheels) beside it.
@pytest.mark.timeout(hangs.after(420) + hangs.RUN)
def test_the_gpu_call_rehearsed_on_cpu_installs_offline_and_measures_every_step(
    tmp_path, torch_floor
):
    """bash bench/gpu_kit/run.sh rehearse: the main call's install (the kit's wheels, offline,
    onto the torch 2.11 venv standing in for the image), steps and files, with the tiny model
    on one CPU process. Each step's cap and the budget are the device call's times
    hangs.SLOWER (KIT_CAP_SCALE): a loaded 2-core machine timed out honest steps at the
    device's own caps (env 60 s, ftjob-full 90 s)."""
    python = torch_floor
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
    done = subprocess.run(["bash", "bench/gpu_kit/run.sh", "rehearse"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=hangs.after(420))  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"^install: \d+ wheels into ", summary, re.MULTILINE), summary
    for name in ("env", "ftjob-full", "ftjob-compile", "trl", "gpu-tests", "memory"):
        assert re.search(rf"^{name}: ok in \d+s$", summary, re.MULTILINE), summary
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.parent == out for p in files)
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    by = {r["step"]: r for r in results}
    assert by["env"]["torch"].startswith("2.11.") and "cuda" in by["kernels"]  # no GPU here
    for name in ("ftjob-full", "ftjob-compile", "trl"):
        assert by[name]["tokensPerSecond"] > 0
        assert len(by[name]["losses"]) == gpu.REHEARSAL.steps
    assert (
        by["ftjob-full"]["attention"]
        == f"{attention.NAME}: scaled_dot_product_attention per document"
    )
    assert by["ftjob-full"]["plannedMiB"] > 0
    assert [r["method"] for r in results if r["step"] == "memory"] == ["lora", "qlora"]
    # The trainer's transformers and peft came from the carried wheels, not the venv's own.
    assert re.search(r"^ +transformers +\S+ +\S+/site$", (out / "env.log").read_text(), re.M)
