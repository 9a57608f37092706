"""The GPU kit's calls rehearsed on CPU: run before a device call (bench/README.md).

    python -m bench.gpu_kit.rehearse                 # compare, main, rest, tests and fp8
    python -m bench.gpu_kit.rehearse main --keep DIR # one call, its files kept in DIR

``compare`` is bench/gpu.py's ``compare`` on the tiny model (2 CPU processes, fp32): ftjob and
the TRL worker side by side, read into rows. Each other mode is the call itself, ``bash
bench/gpu_kit/run.sh MODE rehearse``, on the torch 2.11 venv of scripts/torch-floor.sh (the GPU
image's torch) with the kit's wheels installed offline, the tiny model on one CPU process; every
step must end ok and every figure be there. It checks the plumbing a GPU session relies on, not
speed. All four took 218 s on an idle 2-core machine (2026-12-05: compare 43 s, main 58 s,
rest and fp8 117 s), minutes CI's 40 have no room for: a tool's dress rehearsal, a command of
the kit and not a test of the suite (tests/ is what CI runs, whole).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import gpu
from ftjob.trainer.model import attention

ROOT = Path(__file__).resolve().parents[2]
MODES = ("compare", "main", "rest", "tests", "fp8", "long", "grpo")
# Each step's cap and the budget are the device call's times this (KIT_CAP_SCALE): a loaded
# 2-core machine timed out honest steps at the device's own caps (env 60 s, ftjob-full 90 s).
CAP_SCALE = 5


class Mismatch(Exception):
    """What the rehearsal found that a device call would also get wrong."""


def expect(holds: bool, what: object) -> None:
    if not holds:
        raise Mismatch(str(what)[-3000:])


def floor_python() -> Path:
    """The torch 2.11 venv's python (scripts/torch-floor.sh builds it on first use)."""
    built = subprocess.run(["bash", "scripts/torch-floor.sh"], cwd=ROOT, capture_output=True,
                           text=True, check=True)  # fmt: skip
    return Path(built.stdout.strip().splitlines()[-1]) / "bin" / "python"


def call(work: Path, python: Path, mode: str) -> Path:
    """``bash bench/gpu_kit/run.sh MODE rehearse`` on ``python`` with the kit's wheels
    installed offline on top; its output folder, once the install and the files are right."""
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    wheels = python.parents[2] / f"kit-wheels-{version}"  # beside the venv, reused
    subprocess.run([sys.executable, "-m", "bench.gpu_kit.gather", "--python", version, "--dest",
                    str(wheels)], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    out = work / "out"
    env = {**os.environ, "OUT": str(out), "KIT_WORKDIR": str(work / "work"),
           "KIT_WHEELS": str(wheels), "PYTHON": str(python),
           "KIT_CAP_SCALE": str(CAP_SCALE)}  # fmt: skip
    env.pop("PYTHONPATH", None)  # the kit puts the checkout and its wheels there itself
    done = subprocess.run(["bash", "bench/gpu_kit/run.sh", mode, "rehearse"], cwd=ROOT, env=env,
                          capture_output=True, text=True)  # fmt: skip
    summary = (out / "summary.txt").read_text()
    expect(done.returncode == 0, done.stdout)
    expect(re.search(r"^install: \d+ wheels into ", summary, re.MULTILINE), summary)
    files = [p for p in out.rglob("*") if p.is_file()]
    expect(len(files) <= 8 and all(p.parent == out for p in files), files)
    return out


def results(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def steps_ok(out: Path, names: list[str]) -> dict[str, dict]:
    """Each step said ok; the results by step."""
    summary = (out / "summary.txt").read_text()
    for name in names:
        expect(re.search(rf"^{name}: ok in \d+s$", summary, re.MULTILINE), summary)
    return {r["step"]: r for r in results(out)}


def compare(work: Path) -> None:
    result = gpu.compare(work, gpu.SMOKE, ["full", "lora"])
    expect([c["method"] for c in result["cases"]] == ["full", "lora"], result["cases"])
    for case in result["cases"]:
        expect(case["ftjob"] > 0 and case["trl"] > 0, case)
        expect(case["trlWrapper"] == "DistributedDataParallel", case)  # accelerate on CPU
        # Like with like: TRL packs as ftjob does, through ftjob's packed attention.
        expect(case["trlPacking"] == "bfd" and case["trlAttention"] == attention.NAME, case)
        expect(1 < case["attentionLength"] <= gpu.SMOKE.seq, case)  # documents, not rows
        expect(case["ftjobMfu"] is None and case["trlMfu"] is None, case)  # no peak on CPU
        for losses in (case["ftjobLosses"], case["trlLosses"]):
            expect(len(losses) == gpu.SMOKE.steps and all(map(math.isfinite, losses)), losses)
    rows = result["rows"]
    expect(len(rows) == 4 and rows[0]["measurement"].startswith("tokens/s, "), rows)
    expect(rows[0]["ratio"] > 0 and rows[1]["goal"] == f">= {gpu.MFU_GOAL}", rows)
    expect(rows[1]["met"] is False, rows)


def main_call(out: Path) -> None:
    """env, then the profile of ftjob's default job, then ftjob against TRL twice."""
    by = steps_ok(out, ["env", "profile", "versus-trl"])
    expect(list(by) == ["env", "kernels", "profile", "ftjob-default", "trl-defaults",
                        "trl-same"], list(by))  # fmt: skip
    expect(by["env"]["torch"].startswith("2.11.") and "cuda" in by["kernels"], by["env"])
    # The profile: 3 steps after the trainer's warm-up, of ftjob's default job as auto chose it.
    profiled = by["profile"]
    expect(profiled["steps"] == 3 and profiled["device"] == "cpu", profiled)
    expect(profiled["busyFraction"] is None and profiled["cpuOpFraction"] > 0, profiled)
    expect(0 < len(profiled["longest"]) <= 10 and profiled["longest"][0]["selfMs"] > 0, profiled)
    expect(profiled["hostSyncs"]["localScalarDense"] >= 0, profiled)
    expect(profiled["compiled"] is False, profiled)
    left = ("step", "time", "sharding", "activationCheckpointing", "compiled", "setup")
    summary = {k: v for k, v in profiled.items() if k not in left}
    expect(json.loads((out / "profile.json").read_text()) == summary, summary)
    ours = by["ftjob-default"]
    expect(ours["tokensPerSecond"] > 0 and len(ours["losses"]) == gpu.REHEARSAL.steps, ours)
    expect(ours["attention"] == f"{attention.NAME}: scaled_dot_product_attention per document",
           ours)  # fmt: skip
    expect(ours["plannedMiB"] > 0 and ours["sharding"] == profiled["sharding"], ours)
    # TRL left alone: no packing, transformers' sdpa, recomputation on (TRL's defaults) ...
    theirs = by["trl-defaults"]
    expect((theirs["packing"], theirs["attention"], theirs["gradientCheckpointing"])
           == (None, "sdpa", True), theirs)  # fmt: skip
    # ... and with ftjob's settings: its packing, its attention, recomputation as it chose.
    same = by["trl-same"]
    expect((same["packing"], same["attention"]) == ("bfd", attention.NAME), same)
    expect(same["gradientCheckpointing"] == (ours["activationCheckpointing"] != "none"), same)
    for r in (theirs, same):
        expect(r["tokensPerSecond"] > 0 and len(r["losses"]) == gpu.REHEARSAL.steps, r)
    # The trainer's transformers and peft came from the carried wheels, not the venv's own.
    env_log = (out / "steps.log").read_text().split("\n== ")[0]
    expect(re.search(r"^ +transformers +\S+ +\S+/site$", env_log, re.M), env_log)


def rest_call(out: Path) -> None:
    """compile at a second size, offload, the checkpoint stall, an 8B-shaped LoRA."""
    names = ["env", "compile-3b", "offload", "ckpt-stall", "lora-8b"]
    by = steps_ok(out, names)
    expect(list(by) == ["env", "kernels", *names[1:]], list(by))
    expect(by["compile-3b"]["compiled"] is True and by["compile-3b"]["plannedMiB"] > 0, by)
    offload = by["offload"]
    expect(offload["method"] == "qlora + cpuOffload" and offload["plannedMiB"] > 0, offload)
    stall = by["ckpt-stall"]
    expect(len(stall["stepSeconds"]) == 8 and all(x > 0 for x in stall["stepSeconds"]), stall)
    expect((stall["savedAfterStep"], stall["asyncSave"]) == (4, True), stall)
    lora = by["lora-8b"]
    expect(lora["tokensPerSecond"] > 0 and lora["yardstick"] == 12473, lora)
    for name in ("compile-3b", "offload", "lora-8b"):
        expect(len(by[name]["losses"]) == gpu.REHEARSAL.steps, by[name])


def tests_call(out: Path) -> None:
    """The GPU tests (skipped on CPU), LoRA's and QLoRA's peaks, DDP against full sharding."""
    steps_ok(out, ["env", "gpu-tests", "memory", "ddp"])
    memory = [r for r in results(out) if r["step"] == "memory"]
    expect([r["method"] for r in memory] == ["lora", "qlora"], memory)
    # DDP and FSDP on 2 CPU processes: the same job, the same losses to rounding.
    ddp = [r for r in results(out) if r["step"] == "ddp"]
    expect([(r["sharding"], r["processes"]) for r in ddp] == [("none", 2), ("full", 2)], ddp)
    expect(all(r["tokensPerSecond"] > 0 for r in ddp), ddp)
    for a, b in zip(ddp[0]["losses"], ddp[1]["losses"], strict=True):
        expect(math.isclose(a, b, rel_tol=1e-3), ddp)


def long_call(out: Path) -> None:
    """The LoRA job unsplit and with each sequence split over the 2 processes: both trained."""
    steps_ok(out, ["env", "context"])
    split = [r for r in results(out) if r["step"] == "context"]
    expect([r["contextParallel"] for r in split] == [1, 2], split)
    expect(all(r["tokensPerSecond"] > 0 and len(r["losses"]) > 0 for r in split), split)


def grpo_call(out: Path) -> None:
    """GRPO's sampling engine timed on the model (2 rows on CPU: no peak, so no share of it)."""
    steps_ok(out, ["env", "grpo-sampling"])
    found = [r for r in results(out) if r["step"] == "grpo-sampling"]
    expect([r["rows"] for r in found] == [2] and found[0]["tokensPerSecond"] > 0, found)
    expect(found[0]["hfu"] is None and found[0]["plannedHfu"] > 0, found)


def fp8_call(out: Path) -> None:
    """bf16 then fp8, compiled, at the 1B full and the 8B-shaped LoRA's shapes (issue 58)."""
    steps_ok(out, ["env", "fp8-1b", "fp8-8b"])
    found = results(out)
    expect([(r["step"], r.get("precision")) for r in found] == [
        ("env", None), ("kernels", None), ("fp8-1b", "bf16"), ("fp8-1b", "fp8"),
        ("fp8-8b", "bf16"), ("fp8-8b", "fp8")], found)  # fmt: skip
    for r in found[2:]:
        expect(r["compiled"] is True and r["tokensPerSecond"] > 0 and r["plannedMiB"] > 0, r)
        expect(len(r["losses"]) == gpu.REHEARSAL.steps, r)  # 12 on the GPU
    expect([r["method"] for r in found[2:]] == ["full", "full", "lora", "lora"], found)
    # Float8 rounding happened: each fp8 curve differs from its bf16 twin.
    expect(found[3]["losses"] != found[2]["losses"], found)
    expect(found[5]["losses"] != found[4]["losses"], found)


CHECKS = {"main": main_call, "rest": rest_call, "tests": tests_call, "fp8": fp8_call,
          "long": long_call, "grpo": grpo_call}  # fmt: skip


def rehearse(mode: str, work: Path) -> None:
    if mode == "compare":
        compare(work)
    else:
        CHECKS[mode](call(work, floor_python(), mode))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="*", help=f"any of {', '.join(MODES)} (default: all)")
    parser.add_argument("--keep", type=Path, help="keep each mode's files under DIR/MODE")
    args = parser.parse_args(argv)
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"unknown mode {', '.join(sorted(unknown))}: choose from {', '.join(MODES)}")
    failed = 0
    for mode in args.modes or MODES:
        with tempfile.TemporaryDirectory(prefix=f"kit-{mode}-") as scratch:
            work = args.keep / mode if args.keep else Path(scratch)
            work.mkdir(parents=True, exist_ok=True)
            try:
                rehearse(mode, work)
                print(f"{mode}: ok")
            except (Mismatch, subprocess.CalledProcessError, OSError, KeyError) as e:
                failed += 1
                print(f"{mode}: FAILED: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
