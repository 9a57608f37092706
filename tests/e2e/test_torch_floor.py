"""The GPU image's torch (2.11) on CPU: the tiny model's full fine-tune, the DPO example, a LoRA
and a QLoRA job run to their exports in a venv with torch 2.11 and the project's other pins,
and train to the same losses as the same jobs on CI's torch (this process's: each the run
another e2e module made of the same job, so that CI torch trains each job once).

    python -m pytest tests/e2e/test_torch_floor.py -q

scripts/torch-floor.sh builds that venv once per machine (a cache folder outside the checkout;
tests/envs.py runs it); a build that fails fails these tests under CI (CI=true) and skips them
elsewhere: the GPU path must not go untested there.
Every torch and transformers call the trainer and its agent make runs here on torch 2.11. The
DPO, LoRA and QLoRA jobs share one test, whose exports one process on torch 2.11 loads.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from test_dpo_run import beside_the_examples
from test_qlora import job as qlora_job
from test_recovery import STEPS, recovery_job
from test_trainer_run import losses

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RUN_TIMEOUT = 300
LOAD_TIMEOUT = 120
# Both torches run the same float32 CPU kernels here; the losses agree to the printed digits.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def floor(torch_floor) -> Path:  # tests/conftest.py: built once, started at collection
    return torch_floor


def ftjob_run(python: Path | str, job_file: Path, workdir: Path) -> dict[int, float]:
    """``ftjob run`` with ``python`` (the checkout's ftjob on its path); the losses by step."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "FTJOB_PROGRESS_PORT": "0"}  # fmt: skip
    cmd = [str(python), "-m", "ftjob", "run", str(job_file), "--workdir", str(workdir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "the exported model is in" in done.stdout
    steps = (json.loads(x) for x in (workdir / "progress.jsonl").read_text().splitlines() if x)
    return {e["step"]: e["loss"] for e in steps if e.get("event") == "step"}


def assert_same_losses(old: dict[int, float], new: dict[int, float], job: str) -> None:
    assert old and old.keys() == new.keys(), (job, old, new)
    for step in old:
        assert abs(old[step] - new[step]) <= TOLERANCE * abs(new[step]), (job, step, old, new)


def loads(python: Path, *exports: tuple[Path, Path | None]) -> list[str]:
    """Load each (export, base) with transformers on torch 2.11, an adapter with peft on its
    base, all in one process: a summary of each model."""
    script = (
        "import json, sys, transformers as t\n"
        "for export, base in json.loads(sys.argv[1]):\n"
        "    m = t.AutoModelForCausalLM.from_pretrained(base or export)\n"
        "    if base:\n"
        "        import peft\n"
        "        m = peft.PeftModel.from_pretrained(m, export)\n"
        "    print(type(m).__name__, sum(p.numel() for p in m.parameters()))\n"
    )
    pairs = json.dumps([[str(e), str(b) if b else None] for e, b in exports])
    return subprocess.run([python, "-c", script, pairs], capture_output=True, text=True,
                          check=True, timeout=LOAD_TIMEOUT).stdout.splitlines()  # fmt: skip


def test_the_tiny_job_trains_as_on_ci_torch_and_its_export_loads(
    floor, tmp_path, recovery_reference
):
    """The tiny model's full fine-tune of test_recovery (2 nodes, 12 steps, checkpoints):
    CI torch's side is the session's uninterrupted run of it (tests/e2e/conftest.py)."""
    doc = recovery_job("floor")
    old = ftjob_run(floor, write(doc, tmp_path / "floor.yaml"), tmp_path / "floor")
    assert_same_losses(old, losses(recovery_reference), "tiny")
    assert sorted(old) == list(range(1, STEPS + 1)) and old[STEPS] < old[1]  # learning
    (summary,) = loads(floor, (tmp_path / "floor" / "model", None))
    assert summary.startswith("LlamaForCausalLM ")


def write(doc: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# Three runs, each guarded by RUN_TIMEOUT, and the load; CI torch's three are the session's.
@pytest.mark.slow  # tests/deadline.py: the tiny job is the core's check of torch 2.11
@pytest.mark.timeout(3 * RUN_TIMEOUT + LOAD_TIMEOUT)
def test_dpo_lora_and_qlora_train_as_on_ci_torch_and_their_exports_load(
    floor, tmp_path, dpo, qlora_runs, qlora, lora
):
    """The DPO example (LoRA adapters, the reference their network with adapters off), and
    test_qlora's jobs: a bf16 base whose weights split into whole NF4 blocks over 2 ranks,
    FSDP2-sharded (NF4 by torchao for QLoRA), the adapter merged into a second export. CI
    torch's side of each is the run test_dpo_run and test_qlora made of the same job
    (tests/e2e/conftest.py): the job's name is all that differs, and it is in no loss."""
    dpo_dir, _, dpo_doc = dpo
    folder = beside_the_examples(tmp_path)
    old = ftjob_run(floor, write(dpo_doc, folder / "dpo.yaml"), folder / "dpo")
    assert_same_losses(old, losses(dpo_dir), "dpo")
    exports = [(folder / "dpo" / "model", EXAMPLES / "tiny-model")]
    base = qlora_runs / "base"
    for method, ci in (("lora", lora), ("qlora", qlora[0])):
        job = write(qlora_job(f"floor-{method}", base, method), tmp_path / f"{method}.yaml")
        old = ftjob_run(floor, job, tmp_path / method)
        assert_same_losses(old, losses(ci), method)
        exports += [
            (tmp_path / method / "model", base),
            (tmp_path / method / "model" / "merged", None),
        ]
    summaries = loads(floor, *exports)
    kinds = [s.split()[0] for s in summaries]
    assert kinds == ["PeftModelForCausalLM"] + ["PeftModelForCausalLM", "LlamaForCausalLM"] * 2
