"""The first-contact kit for a GPU machine (bench/gpu_kit): what it carries and what it runs.

The kit itself runs only where a GPU is lent; here: its wheel list agrees with the versions CI
tests, and run.sh's plan (a dry run) puts the steps in order within the device's time limit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hangs
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder of the repo, not an installed package

from bench.gpu_kit import gather  # noqa: E402


def test_carried_wheels_are_the_versions_ci_tests():
    wanted = gather.pins(gather.WHEELS)
    assert gather.drift(wanted, gather.pins(gather.CONSTRAINTS)) == []
    assert "torch" not in wanted  # the image's CUDA build; a wheel would be ~900 MB
    for name in ("transformers", "trl", "datasets", "peft", "torchao"):
        assert name in wanted


def test_a_pin_that_drifts_from_constraints_is_named_with_the_fix():
    problems = gather.drift({"trl": "1.15.0", "dill": "0.4.1"}, {"trl": "1.16.0"})
    assert problems == [
        "trl: wheels.txt has 1.15.0, constraints.txt 1.16.0; carry what CI tests "
        "(edit bench/gpu_kit/wheels.txt)"
    ]


@pytest.mark.parametrize("line", ["trl", "trl>=1.16", "trl==1.16.0\ntrl==1.16.0"])
def test_an_unpinned_or_repeated_wheel_is_refused(tmp_path, line):
    listed = tmp_path / "wheels.txt"
    listed.write_text(f"# a comment\n{line}\n")
    with pytest.raises(ValueError, match=r"wheels\.txt:\d: "):
        gather.pins(listed)


def test_wheel_file_names_give_name_and_version():
    name = "common_expression_language-0.10.0-cp312-cp312-manylinux_2_17_x86_64.whl"
    assert gather.wheel_key(name) == ("common-expression-language", "0.10.0")


def test_the_wheels_and_the_runs_output_stay_out_of_git():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/.whl/" in ignored and "/gpu-out/" in ignored


def plan(tmp_path: Path, *args: str, scale: int = 1, budget: int = 360) -> list[str]:
    env = {**os.environ, "OUT": str(tmp_path), "KIT_BUDGET_S": str(budget),
           "KIT_CAP_SCALE": str(scale)}  # fmt: skip
    done = subprocess.run(["bash", "bench/gpu_kit/run.sh", *args, "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, check=True)  # fmt: skip
    named = " ".join(a for a in args if a not in ("rehearse",)) or "main"
    assert done.stdout.splitlines()[-1].startswith(f"run.sh {named}: ")
    return (tmp_path / "summary.txt").read_text().splitlines()


# The order of issue 50 item 5: the profile first, then ftjob's default job against TRL (main);
# compile's peak at a second size, QLoRA with cpuOffload, the checkpoint stall, 8B LoRA (rest).
MAIN = ["env", "profile", "versus-trl"]
REST = ["env", "compile-3b", "offload", "ckpt-stall", "lora-8b"]
# When time is left: the GPU tests, the LoRA and QLoRA peaks, DDP against FSDP (2+ GPUs).
TESTS = ["env", "gpu-tests", "memory", "ddp"]
# Issue 58's call: float8 against bf16, compiled, at the 1B and an 8B shape.
FP8 = ["env", "fp8-1b", "fp8-8b"]
# Issue 76's: a sequence split over 2 GPUs against unsplit (2+ GPUs).
LONG = ["env", "context"]
# Issue 75's: GRPO's sampling speed, the figure the planner assumes.
GRPO = ["env", "grpo-sampling"]


def limits_of(lines: list[str]) -> list[int]:
    return [
        int(line.split("limit ")[1].split("s,")[0]) for line in lines if "dry run, limit" in line
    ]


@pytest.mark.parametrize(
    ("mode", "steps"),
    [
        ("main", MAIN),
        ("rest", REST),
        ("tests", TESTS),
        ("fp8", FP8),
        ("long", LONG),
        ("grpo", GRPO),
    ],
)
def test_each_call_runs_its_steps_in_order_each_at_its_whole_limit(tmp_path, mode, steps):
    """Counting every step at its whole limit, the 360 s budget (the call's 420 s limit less a
    margin) reaches every step of the call: none is cut to less than its cap, none left out."""
    lines = plan(tmp_path, mode)
    assert [line.split(":")[0] for line in lines[1:-1]] == steps
    assert all("dry run, limit" in line for line in lines[1:-1])
    assert sum(limits_of(lines)) <= 360 - 10


def test_a_step_the_budget_cannot_hold_is_named_with_the_call_that_runs_it(tmp_path):
    lines = plan(tmp_path, "rest", budget=280)
    assert lines[-2] == "lora-8b: not run, 20s of the 280s budget left; it runs again in: " \
        "bash bench/gpu_kit/run.sh lora-8b"  # fmt: skip
    cut = plan(tmp_path, "main", budget=170)
    assert cut[-2] == "versus-trl: not run, 20s of the 170s budget left; it runs again in: " \
        "bash bench/gpu_kit/run.sh versus-trl"  # fmt: skip


def test_calls_and_steps_given_together_make_one_call_in_their_order_env_once(tmp_path):
    """A lease with room for one call only runs main and then the steps it names, under one
    budget: env once, each step at its whole limit while the budget holds."""
    lines = plan(tmp_path, "main", "fp8-8b", "compile-3b", budget=540)
    assert [line.split(":")[0] for line in lines[1:-1]] == MAIN + ["fp8-8b", "compile-3b"]
    assert lines[-1].startswith("run.sh main fp8-8b compile-3b: ")
    assert limits_of(lines) == [60, 90, 190, 170, 540 - 10 - 510]  # the last one cut to fit


def test_an_unknown_call_or_step_is_refused_with_the_usage(tmp_path):
    done = subprocess.run(["bash", "bench/gpu_kit/run.sh", "lora-9b", "--dry-run"], cwd=ROOT,
                          env={**os.environ, "OUT": str(tmp_path)}, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 2 and "usage: bash bench/gpu_kit/run.sh [main|rest" in done.stderr


@pytest.mark.parametrize("mode", ["main", "rest", "tests", "fp8"])
def test_the_rehearsal_is_the_same_call(tmp_path, mode):
    device = [line.split(",")[0] for line in plan(tmp_path, mode)[1:-1]]
    assert [line.split(",")[0] for line in plan(tmp_path, mode, "rehearse")[1:-1]] == device


def test_every_step_the_calls_run_is_one_the_steps_module_has():
    from bench.gpu_kit import steps

    measured = [s for s in MAIN + REST + TESTS + FP8 + LONG + GRPO if s not in ("env", "gpu-tests")]
    assert set(measured) == set(steps.STEPS) == set(steps.STEP_FUNCTIONS)


def test_a_rehearsal_on_a_shared_machine_scales_every_limit_and_keeps_the_plan(tmp_path):
    """KIT_CAP_SCALE (the test suite's margin for a loaded machine) multiplies each step's cap
    and the budget: the same steps in the same order, each limit that many times longer."""

    def limits(lines):
        return [
            (x.split(":")[0], int(x.split("limit ")[1].split("s,")[0]))
            for x in lines
            if "dry run, limit" in x
        ]

    device = plan(tmp_path, "rest", "rehearse")
    scaled = plan(tmp_path, "rest", "rehearse", scale=5)
    assert [(n, 5 * s) for n, s in limits(device)] == limits(scaled) and len(limits(device)) >= 5
    assert [x.split(":")[0] for x in device] == [x.split(":")[0] for x in scaled]


def test_no_more_files_than_a_device_call_returns(tmp_path):
    """A device call returns at most 8 files: whatever calls and steps run together, $OUT
    holds the summary, the results, the profile's summary and one log of every step (a
    call of 7 steps with a log each once lost its results.jsonl to that count)."""
    every = ["main", "rest", "tests", "fp8"]
    lines = plan(tmp_path, *every, budget=3600)
    assert all("dry run, limit" in x for x in lines[1:-1]) and len(lines) > 12
    assert {x.split(", log ")[1] for x in lines[1:-1]} == {str(tmp_path / "steps.log")}
    assert {p.name for p in tmp_path.iterdir()} <= {"summary.txt", "results.jsonl",
                                                     "profile.json", "steps.log"}  # fmt: skip


def test_the_gpu_tests_run_on_without_x_each_with_a_limit():
    script = (ROOT / "bench" / "gpu_kit" / "run.sh").read_text()
    (line,) = [x for x in script.splitlines() if "pytest tests/gpu" in x]
    assert " -x" not in line and "--timeout 60" in line and " -v" in line


def test_a_steps_leftover_processes_are_ended_by_their_tag_and_no_other():
    """A process in a session of its own (as torch starts trainer ranks) outlives its parent
    and its group's signal; reap ends it by the tag in its environment, and leaves alone a
    process without the tag."""
    from bench.gpu_kit import reap

    tag = f"test-{os.getpid()}"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    tagged = subprocess.Popen(sleep, env={**os.environ, reap.VARIABLE: tag},
                              start_new_session=True)  # fmt: skip
    other = subprocess.Popen(sleep, env={**os.environ, reap.VARIABLE: tag + "-other"})
    try:
        deadline = time.monotonic() + hangs.FLOOR
        while tagged.pid not in reap.tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)  # until python has started (its environ readable)
        assert reap.reap(tag, grace=5) == [tagged.pid]
        assert tagged.wait(timeout=hangs.FLOOR) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        for proc in (tagged, other):
            proc.kill()
            proc.wait()


def test_the_rehearsal_names_each_call_of_the_kit_and_refuses_another(capsys):
    """``python -m bench.gpu_kit.rehearse``: the kit's own check before a device call (its
    calls take 218 s on CPU in all, so it is a command, not one of CI's tests)."""
    from bench.gpu_kit import rehearse

    usage = (ROOT / "bench" / "gpu_kit" / "run.sh").read_text()
    calls = set(rehearse.MODES) - {"compare"}
    assert calls == set(rehearse.CHECKS) and all(f" {m} " in usage for m in calls)
    with pytest.raises(SystemExit) as refused:
        rehearse.main(["mian"])
    assert refused.value.code == 2 and "unknown mode mian: choose from compare, main" in (
        capsys.readouterr().err
    )
