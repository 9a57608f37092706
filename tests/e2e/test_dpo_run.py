"""DPO end to end: `ftjob run` of examples/tiny-dpo.yaml (LoRA, 2 processes on CPU) on the
tiny model and its synthetic preference pairs, whose preference is learnable.

    python -m pytest tests/e2e/test_dpo_run.py -q
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_TIMEOUT = 240


def history(workdir: Path, event: str) -> list[dict]:
    lines = (workdir / "progress.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.fixture(scope="module")
def dpo(tmp_path_factory) -> tuple[Path, str, dict]:
    doc = yaml.safe_load((EXAMPLES / "tiny-dpo.yaml").read_text())
    doc["spec"]["training"]["logEvery"] = 1  # step 1's loss is the untrained policy's
    runs = tmp_path_factory.mktemp("dpo")
    job_file, workdir = runs / "tiny-dpo.yaml", runs / "tiny-dpo"
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    # Relative sources, as in the example: beside the job file.
    for name in ("tiny-model", "data"):
        (runs / name).symlink_to(EXAMPLES / name)
    cmd = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(workdir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return workdir, proc.stdout, doc


def test_reward_accuracy_rises_well_above_chance_and_the_eval_margin_grows(dpo):
    workdir, out, _ = dpo
    steps = history(workdir, "step")
    assert [s["step"] for s in steps] == list(range(1, 41))
    # Step 1: the adapters are zero, so the policy is its reference: every reward is 0.
    first = steps[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert (first["rewardAccuracy"], first["rewardMargin"]) == (0.0, 0.0)
    # Later the policy moves away from the reference (the adapter-free network) and learns.
    last = steps[-10:]
    assert sum(s["rewardAccuracy"] for s in last) / 10 > 0.7
    assert sum(s["loss"] for s in last) / 10 < math.log(2) - 0.05
    evals = history(workdir, "eval")
    assert [e["evalStep"] for e in evals] == [20, 40]
    assert evals[-1]["evalRewardAccuracy"] >= 0.7
    assert 0 < evals[0]["evalRewardMargin"] < evals[-1]["evalRewardMargin"]
    assert evals[-1]["evalLoss"] < evals[0]["evalLoss"] < math.log(2)
    # What `ftjob run` prints: the log lines with the reward accuracy and margin.
    assert "450 train / 50 eval preference pairs" in out
    assert "eval  step 40/40  eval loss" in out and "reward accuracy" in out


def test_the_exported_adapter_loads_with_peft_and_ranks_the_eval_pairs_as_trained(dpo):
    """The export, reloaded with peft in one process, gives the eval set's reward accuracy and
    margin the trainer reported (its reference: the same network with the adapter off)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftjob.trainer import data, pairs, preference

    workdir, _, doc = dpo
    reported = history(workdir, "eval")[-1]
    base = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, workdir / "model").eval()
    tok = AutoTokenizer.from_pretrained(workdir / "model")
    (folder,) = (workdir / "data").glob("*/eval")
    held_out = data.Sequences.open(folder)
    batch = data.collate(pairs.sides(held_out.rows(range(len(held_out)))).rows(), tok.pad_token_id)

    def logps():
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        return preference.response_logps(out.logits, batch.labels)

    with torch.no_grad():
        policy = logps()
        with model.disable_adapter():
            reference = logps()
    beta = doc["spec"]["training"]["dpo"]["beta"]
    got = preference.means(preference.dpo(policy, reference, beta=beta).sums())
    assert got["rewardAccuracy"] == pytest.approx(reported["evalRewardAccuracy"], abs=1e-6)
    assert got["rewardMargin"] == pytest.approx(reported["evalRewardMargin"], abs=1e-5)
    assert got["loss"] == pytest.approx(reported["evalLoss"], abs=1e-5)
