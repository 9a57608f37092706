"""A user's reward that raises in the middle of a GRPO run: every rank stops at that step
with the reward's error (no rank left waiting in a collective), and the checkpoints saved
before it stay for a rerun.

    python -m pytest tests/e2e/test_grpo_reward_fails.py -q
"""

from __future__ import annotations

from pathlib import Path

import yaml
from test_trainer_run import run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# Fails on rank 1's completions only (it sees the second half of a step's prompts) from the
# sixth call on: one rank's failure must stop both.
REWARD = """
import os

calls = 0


def flaky(prompts, completions, records, **_):
    global calls
    calls += 1
    if calls > 5 and os.environ.get("RANK") == "1":
        raise ValueError("the grader is broken")
    return [float(len(c) % 3) for c in completions]
"""


def test_a_reward_that_raises_stops_every_rank_and_keeps_the_checkpoints(tmp_path):
    for name in ("tiny-model", "data"):
        (tmp_path / name).symlink_to(EXAMPLES / name)
    (tmp_path / "flaky.py").write_text(REWARD)
    doc = yaml.safe_load((EXAMPLES / "tiny-grpo.yaml").read_text())
    doc["spec"]["training"]["grpo"]["rewards"] = [
        {"type": "function", "function": "flaky.py:flaky"}
    ]
    doc["spec"]["training"]["maxSteps"] = 10
    doc["spec"]["checkpoint"]["every"] = 4
    doc["spec"]["runPolicy"] = {"inPlaceRestarts": 0}
    workdir = tmp_path / "job"
    code, out = run(doc, workdir)
    assert code != 0
    # Both ranks stop with rank 1's reason: the user's file and the line that raised.
    line = REWARD.splitlines().index('        raise ValueError("the grader is broken")') + 1
    said = "a reward failed on rank 1: reward 'flaky' raised ValueError: the grader is broken"
    assert said in out
    assert f"flaky.py:{line}" in out
    assert (workdir / "checkpoints" / "step-00000004").is_dir()
    assert not (workdir / "model").exists()
