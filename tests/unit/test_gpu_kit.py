"""The first-contact kit for a GPU machine (bench/gpu_kit): what it carries and what it runs.

The kit itself runs only where a GPU is lent; here: its wheel list agrees with the versions CI
tests, and run.sh's plan (a dry run) puts the steps in order within the device's time limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def plan(tmp_path: Path, *args: str) -> list[str]:
    env = {**os.environ, "OUT": str(tmp_path), "KIT_BUDGET_S": "560"}
    done = subprocess.run(["bash", "bench/gpu_kit/run.sh", *args, "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.splitlines()[-1].startswith(f"run.sh {args[0] if args else 'all'}: ")
    return (tmp_path / "summary.txt").read_text().splitlines()


def test_quick_runs_environment_cuda_tests_then_the_quick_suite(tmp_path):
    lines = plan(tmp_path, "quick")
    steps = [line.split(":")[0] for line in lines[1:-1]]
    assert steps == ["env", "gpu-tests", "bench-quick"]
    assert all("dry run" in line for line in lines[1:-1])


def test_all_defers_what_does_not_fit_one_call_to_a_second(tmp_path):
    """Counting every step at its whole limit, the full suite does not fit after the others:
    it is named, with the command for a call of its own, instead of being cut off."""
    lines = plan(tmp_path)
    assert [line.split(":")[0] for line in lines[1:-1]] == [
        "env", "gpu-tests", "bench-quick", "bench-full"]  # fmt: skip
    assert lines[-2].startswith("bench-full: not run")
    assert lines[-2].endswith("bash bench/gpu_kit/run.sh full")
    full = plan(tmp_path, "full")
    assert [line.split(":")[0] for line in full[1:-1]] == ["env", "bench-full"]
    assert "dry run, limit" in full[-2]


def test_no_more_files_than_a_device_call_returns(tmp_path):
    """$OUT comes back with at most 8 files: the summary, a log per step, the suites' JSON."""
    lines = plan(tmp_path)
    logs = {line.split(":")[0] for line in lines[1:-1]}
    assert len({"summary.txt", *logs, "bench-quick.json", "bench-full.json"}) <= 8
