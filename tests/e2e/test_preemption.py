"""A signal is a checkpoint: SIGTERM to a node's main process (what the kubelet sends an
evicted, drained, reclaimed or preempted pod) stops the gang at one step boundary, saves there,
and `ftjob run` starts the gang again from that step, as the operator would.

    python -m pytest tests/e2e/test_preemption.py -q

Each case runs the 2-node CPU job of test_recovery.py and compares its export with an
uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import hangs
import pytest
from safetensors.torch import load_file
from test_recovery import recovery_job, wait_for_step
from test_trainer_run import (
    RUN_TIMEOUT,
    history,
    hold_after,
    injected,
    job_processes,
    losses,
    start,
)

from ftjob.api import contract
from ftjob.api.jobspec import parse_resource
from ftjob.operator import render, status

STEPS = 12  # test_recovery.SPEC: checkpoint.every 4, keep 3
EVERY = 4


@pytest.fixture
def reference(recovery_reference) -> Path:
    return recovery_reference  # tests/e2e/conftest.py: one uninterrupted run for both modules


def agent_pid(workdir: Path, node: int) -> int:
    """Node ``node``'s main process, the one a pod's container runs: its agent."""
    for pid, env, cmdline in job_processes(workdir):
        if (
            env.get("PET_NODE_RANK") == str(node)
            and "ftjob.trainer.node" in cmdline
            and "RANK" not in env
        ):
            return pid
    raise AssertionError(f"no agent of node {node} runs for {workdir}")


def same_export(workdir: Path, reference: Path) -> None:
    exported = load_file(workdir / "model" / "model.safetensors")
    uninterrupted = load_file(reference / "model" / "model.safetensors")
    assert exported.keys() == uninterrupted.keys()
    assert all(exported[k].equal(uninterrupted[k]) for k in exported)
    resumed, expected = losses(workdir), losses(reference)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - expected[s]) for s in resumed) == 0.0


def recomputed(workdir: Path) -> list[int]:
    """Steps trained more than once (each step's progress line is written once per training)."""
    return [s for s, n in Counter(r["step"] for r in history(workdir)).items() if n > 1]


def resumed_training(workdir: Path, saved: int) -> bool:
    """The next gang trains again: a step after ``saved`` in progress, resumed from it."""
    try:
        snap = json.loads((workdir / "progress.json").read_text())
    except (OSError, ValueError):
        return False
    resumed = str(snap.get("resumedFrom") or "")
    return resumed.endswith(f"step-{saved:08d}") and (snap.get("step") or 0) > saved


def saved_step(out: str) -> int:
    line = next(x for x in out.splitlines() if "stopped for a SIGTERM after step" in x)
    return int(line.split("after step ")[1].split(";")[0].split()[0])


# A background save at the signal: the slow tier's (tests/deadline.py); sync is the core's.
@pytest.mark.parametrize(
    "async_save", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"]
)
def test_sigterm_to_one_node_saves_the_step_reached_and_resumes_bit_for_bit(
    reference, tmp_path, monkeypatch, async_save
):
    """The main case: one node's pod evicted at a random step. Periodic checkpoints are off
    in effect (every 1000 steps), so all that keeps the work is the save on SIGTERM."""
    workdir = tmp_path / "evicted"
    doc = recovery_job("evicted", checkpoint={"every": 1000, "asyncSave": async_save})
    at = random.Random().randint(2, STEPS - 3)
    hold_after(monkeypatch, at, tmp_path / "gate")
    proc = start(doc, workdir)
    wait_for_step(proc, workdir, at)
    reached = max(losses(workdir))
    os.kill(agent_pid(workdir, 1), signal.SIGTERM)
    began = time.monotonic()
    record = hangs.poll(lambda: _preempted(workdir), hangs.RUN, "the save on SIGTERM")
    saved = record["step"]
    hangs.poll(lambda: resumed_training(workdir, saved), hangs.RUN, "training again")
    again = time.monotonic() - began
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    print(f"SIGTERM at step {reached}, saved step {saved}, training again after {again:.1f} s")
    assert proc.returncode == 0, out
    assert saved >= reached  # nothing trained before the signal is lost
    assert f"stopped for a SIGTERM after step {saved}; checkpoint" in out
    assert "starting the gang again, resuming from" in out and "done;" in out
    assert len(recomputed(workdir)) <= 1, recomputed(workdir)  # goal: <= 1 step per eviction
    same_export(workdir, reference)
    # Preemption is not a failure: no restart in place was spent on it.
    assert "restart 1 of" not in (workdir / "logs" / "node-0.log").read_text()
    assert "(after" not in out.splitlines()[-1]
    # The operator reads the same record from a pod: Preempted (no restart budget), and the
    # status says the step saved.
    failure = operator_sees(record)
    assert failure["reason"] == "Preempted"
    assert f"stopped for a SIGTERM after step {saved}; checkpoint" in failure["message"]


def _preempted(workdir: Path) -> dict | None:
    """Node 0's record once the gang stopped for the SIGTERM (written before it exits)."""
    try:
        rec = contract.parse((workdir / "logs" / "node-0.termination").read_text())
    except OSError:
        return None
    return rec if rec and rec.get("outcome") == "preempted" else None


def operator_sees(record: dict) -> dict:
    """status.failure for node 0's pod of a job, its container ended with ``record``."""
    name, spec = parse_resource(recovery_job("evicted"))
    pod = render.pod(name, "ns", spec, 0, 0, "uid")
    term = {"exitCode": contract.EXIT_PREEMPTED, "reason": "Error",
            "message": contract.dumps(record)}  # fmt: skip
    state = {"name": "trainer", "state": {"terminated": term}}
    pod["status"] = {"phase": "Failed", "containerStatuses": [state]}
    return status.diagnose(pod)


def test_sigterm_to_every_node_during_a_periodic_checkpoints_write(
    reference, tmp_path, monkeypatch
):
    """A node drained (every node signalled at once) while rank 1 is still writing step 4's
    checkpoint: that save is finished and committed, and the gang then stops at the next
    boundary and saves again, once, and resumes from there."""
    workdir = tmp_path / "writing"
    marker = tmp_path / "writing-save"
    injected(monkeypatch, f"slowsave:1:3:{marker}")
    proc = start(recovery_job("writing"), workdir)
    hangs.poll(marker.exists, hangs.RUN, "rank 1 inside its first save")
    reached = max(losses(workdir))
    for pid in (agent_pid(workdir, 0), agent_pid(workdir, 1)):
        os.kill(pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, out
    assert f"checkpoint saved: step {EVERY} in" in out
    assert saved_step(out) > EVERY and saved_step(out) >= reached
    assert len(recomputed(workdir)) <= 1, recomputed(workdir)
    same_export(workdir, reference)


@pytest.mark.slow  # tests/deadline.py: a signal's save cut short; a crash's is test_recovery's
def test_a_grace_period_too_short_for_the_save_keeps_the_previous_checkpoint(
    reference, tmp_path, monkeypatch
):
    """No time for a save: none is started, the periodic checkpoint stays the newest complete
    one, and the next gang resumes from it."""
    workdir = tmp_path / "short"
    monkeypatch.setenv(contract.GRACE_ENV, "0.1")
    # The SIGTERM reaches rank 1 before its step EVERY + 2, and the gang stops after the step
    # that carries its ballot (ftjob.trainer.gang.preempt.Vote): EVERY + 2, between two
    # periodic saves.
    hold_after(monkeypatch, EVERY + 1, tmp_path / "gate")
    proc = start(recovery_job("short"), workdir)
    wait_for_step(proc, workdir, EVERY + 1)
    os.kill(agent_pid(workdir, 1), signal.SIGTERM)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, out
    assert "without saving: the grace period left too little time" in out
    stopped = saved_step(out)
    assert stopped > EVERY
    previous = (stopped - 1) // EVERY * EVERY  # a stop at a periodic step is checked first
    resumed = [x for x in out.splitlines() if "resuming from checkpoint" in x]
    assert resumed and f"step-{previous:08d} (step {previous})" in resumed[0], resumed
    assert not list((workdir / "checkpoints").glob(f"*step-{stopped:08d}"))
    same_export(workdir, reference)
