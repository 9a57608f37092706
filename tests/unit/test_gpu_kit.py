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


def plan(tmp_path: Path, *args: str, scale: int = 1) -> list[str]:
    env = {**os.environ, "OUT": str(tmp_path), "KIT_BUDGET_S": "360", "KIT_CAP_SCALE": str(scale)}
    done = subprocess.run(["bash", "bench/gpu_kit/run.sh", *args, "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.splitlines()[-1].startswith(f"run.sh {args[0] if args else 'main'}: ")
    return (tmp_path / "summary.txt").read_text().splitlines()


MAIN = ["env", "ftjob-full", "ftjob-compile", "trl", "gpu-tests", "memory"]


def test_the_main_call_measures_the_most_valuable_first_within_its_budget(tmp_path):
    """Counting every step at its whole limit, the 360 s budget (the call's 420 s limit less a
    margin) reaches the environment, ftjob, ftjob compiled, TRL and the CUDA tests; what does
    not fit is named with the call that runs it."""
    lines = plan(tmp_path)
    assert [line.split(":")[0] for line in lines[1:-1]] == MAIN
    limits = [int(line.split("limit ")[1].split("s,")[0]) for line in lines[1:-1] if "dry" in line]
    assert len(limits) >= 5 and sum(limits) <= 360
    assert lines[-2] == lines[-2].split(":")[0] + ": " + lines[-2].split(": ", 1)[1]
    assert lines[-2].startswith("memory: not run") and lines[-2].endswith("run.sh rest")


def test_the_rehearsal_is_the_main_call(tmp_path):
    main = [line.split(",")[0] for line in plan(tmp_path)[1:-1]]
    assert [line.split(",")[0] for line in plan(tmp_path, "rehearse")[1:-1]] == main


def test_a_rehearsal_on_a_shared_machine_scales_every_limit_and_keeps_the_plan(tmp_path):
    """KIT_CAP_SCALE (the test suite's margin for a loaded machine) multiplies each step's cap
    and the budget: the same steps in the same order, each limit that many times longer."""

    def limits(lines):
        return [
            (x.split(":")[0], int(x.split("limit ")[1].split("s,")[0]))
            for x in lines
            if "dry run, limit" in x
        ]

    device = plan(tmp_path, "rehearse")
    scaled = plan(tmp_path, "rehearse", scale=5)
    assert [(n, 5 * s) for n, s in limits(device)] == limits(scaled) and len(limits(device)) >= 5
    assert [x.split(":")[0] for x in device] == [x.split(":")[0] for x in scaled]


def test_the_second_call_runs_the_rest(tmp_path):
    steps = [line.split(":")[0] for line in plan(tmp_path, "rest")[1:-1]]
    assert steps == ["env", "lora", "offload", "gpu-tests", "memory"]


def test_no_more_files_than_a_device_call_returns(tmp_path):
    """$OUT comes back with at most 8 files: the summary, the results, a log per step."""
    for mode in ("main", "rest"):
        logs = {line.split(":")[0] for line in plan(tmp_path, mode)[1:-1]}
        assert len({"summary.txt", "results.jsonl", *logs}) <= 8


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
