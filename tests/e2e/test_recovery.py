"""Recovery with real processes: `ftjob run` (2 nodes x 1 CPU process) restarting workers in
place, naming a slow rank and a stopped one, one winner of two simultaneous starts, and
nothing left behind. (A permanent failure, not restarted in place: test_run_display.py's
failure summary.)

    python -m pytest tests/e2e/test_recovery.py -q

Faults come from outside the product code: signals, bad data, and tests/e2e/inject (a
sitecustomize that patches one rank's trainer as it is imported).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import hangs
import pytest
import torch.distributed as dist
from safetensors.torch import load_file
from test_trainer_run import (
    RUN_TIMEOUT,
    history,
    hold_after,
    injected,
    job,
    job_processes,
    losses,
    rank_pid,
    run,
    start,
)

from ftjob.job.processes import alive
from ftjob.trainer.gang import heartbeat

STEPS = 12
SPEC = {"training": {"maxSteps": STEPS}, "checkpoint": {"every": 4, "keep": 3}}


def recovery_job(name: str, **changes) -> dict:
    doc = job(name, **SPEC)
    for section, values in changes.items():
        doc["spec"].setdefault(section, {}).update(values)
    return doc


def run_processes(workdir: Path) -> set[int]:
    """Pids of this run's agents and workers now (their environment names the job folder)."""
    return {pid for pid, _, _ in job_processes(workdir)}


def gang_store(workdir: Path, pid: int) -> dist.TCPStore:
    """A client of the store the worker ``pid`` keeps its heartbeat in (node 0's agent's)."""
    env = next(env for p, env, _ in job_processes(workdir) if p == pid)
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=hangs.FLOOR))  # fmt: skip


def wait_for_step(proc, workdir: Path, step: int) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not any(s >= step for s in losses(workdir)):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.fixture
def reference(recovery_reference) -> Path:
    return recovery_reference  # tests/e2e/conftest.py: one uninterrupted run for both modules


def test_a_worker_that_raises_restarts_every_node_in_place_and_resumes_exactly(
    reference, tmp_path, monkeypatch
):
    workdir = tmp_path / "raises"
    injected(monkeypatch, f"raise:1:6:{tmp_path / 'raised'}")  # rank 1's 6th step, once
    code, out = run(recovery_job("raises"), workdir)
    assert code == 0, out
    assert (tmp_path / "raised").exists()
    logs = workdir / "logs"
    node1 = (logs / "node-1.log").read_text()
    assert "rank 1 failed: Internal: RuntimeError: injected failure" in node1
    assert "restarting the workers of every node in place" in node1
    assert "(restart 1 of 3)" in node1
    # The node processes were started once: the agents restarted the workers, not `ftjob run`.
    for rank in (0, 1):
        assert (logs / f"node-{rank}.log").read_text().count("--- ftjob run, node") == 1
    assert "another node restarts its workers; restarting these" in out  # node 0, on screen
    assert f"resuming from checkpoint {workdir / 'checkpoints'}/step-00000004 (step 4)" in out
    assert "done (after 1 restart in place)" in out
    assert json.loads((workdir / "progress.json").read_text())["restartsInPlace"] == 1
    # The failure restarted from is not left as the node's record of the run.
    assert (logs / "node-1.termination").read_text() == ""
    resumed, expected = losses(workdir), losses(reference)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - expected[s]) for s in resumed) == 0.0
    exported = load_file(workdir / "model" / "model.safetensors")
    uninterrupted = load_file(reference / "model" / "model.safetensors")
    assert exported.keys() == uninterrupted.keys()
    assert all(exported[k].equal(uninterrupted[k]) for k in exported)


def stop_rank_1(workdir: Path, step: int) -> int:
    """SIGSTOP rank 1 once its heartbeat says it trained step ``step``, and return its pid.
    Steps can come faster than beats (at most one a second): stopped before, its last beat
    would be an older step's."""
    stopped = rank_pid(workdir, 1)
    beats = gang_store(workdir, stopped)
    hangs.poll(lambda: heartbeat.read(beats, 2).get(1, {}).get("step", 0) >= step, hangs.RUN,
               f"rank 1's heartbeat after step {step}")  # fmt: skip
    os.kill(stopped, signal.SIGSTOP)
    return stopped


def test_a_stopped_rank_is_restarted_in_place_then_named_and_no_process_survives(
    reference, tmp_path, monkeypatch
):
    """A hang costs one collective timeout per rung of the ladder, both on one run. With a
    restart in place left, the stopped worker's agent continues it (SIGCONT) before ending it,
    and every node resumes exactly; stopped again with none left (the last rung), the run
    fails naming the stopped rank, and no process of the run survives, the stopped one
    included."""
    workdir = tmp_path / "hang"
    # The gate is never made: each gang's rank 1 waits before its 6th step (step 6; step 10
    # after the resume from step 4), so each stop comes while the gang cannot finish.
    hold_after(monkeypatch, 5, tmp_path / "gate")
    doc = recovery_job("hang", network={"collectiveTimeoutSeconds": 30},  # the least allowed
                       runPolicy={"inPlaceRestarts": 1})  # fmt: skip
    proc = start(doc, workdir)
    wait_for_step(proc, workdir, 5)
    first = stop_rank_1(workdir, 5)
    wait_for_step(proc, workdir, 9)  # the gang restarted in place trains again
    everyone = run_processes(workdir)
    assert first not in everyone and len(everyone) == 4  # 2 agents, 2 new workers
    second = stop_rank_1(workdir, 9)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 1, out
    notice = next(x for x in out.splitlines() if x.startswith("ftjob agent: node 0: rank 0"))
    assert "CollectiveTimeout" in notice and "stopped answering: rank 1 (node " in notice
    assert "(restart 1 of 1)" in notice
    headline = next(x for x in out.splitlines() if x.startswith("ftjob run: node"))
    print(headline)
    assert "CollectiveTimeout" in headline, headline
    assert "stopped answering: rank 1 (node " in headline and f"pid {second})" in headline
    # Its last heartbeat came from training after the resume.
    assert int(re.search(r"last heartbeat \d+ s ago, at step (\d+)", headline)[1]) >= 9
    assert not [p for p in everyone | {first} if alive(p)] and not run_processes(workdir)
    resumed, expected = losses(workdir), losses(reference)
    assert sorted(resumed) == list(range(1, 10))
    assert max(abs(resumed[s] - expected[s]) for s in resumed) == 0.0


@pytest.fixture(scope="module")
def slowed_then_interrupted(tmp_path_factory) -> dict:
    """One run watched by three tests. Two `ftjob run`s of one job start together in one
    folder; the one that wins it trains with rank 1's data 0.3 s slower every step, and once
    rank 0 has named rank 1 a straggler, gets two Ctrl-Cs 0.1 s apart. Returns the job folder,
    each run's output and exit code, and the winner's processes before the Ctrl-Cs."""
    workdir = tmp_path_factory.mktemp("recovery") / "slow"
    with pytest.MonkeyPatch.context() as patch:
        injected(patch, "slow:1:0.3")
        doc = recovery_job("slow", training={"maxSteps": 500})
        procs = [start(doc, workdir), start(doc, workdir)]
    lost = hangs.poll(lambda: next((p for p in procs if p.poll() is not None), None),
                      hangs.RUN, "one of two starts ended")  # fmt: skip
    won = procs[1 - procs.index(lost)]

    def named() -> bool:
        assert won.poll() is None, won.communicate()[0]
        try:
            return bool(json.loads((workdir / "progress.json").read_text()).get("stragglers"))
        except (OSError, ValueError):  # not written yet, or being written
            return False

    hangs.poll(named, hangs.RUN, "a straggler named")
    everyone = run_processes(workdir)
    won.send_signal(signal.SIGINT)
    time.sleep(0.1)  # not a hang guard: the second Ctrl-C comes while the first is handled
    won.send_signal(signal.SIGINT)
    out, _ = won.communicate(timeout=hangs.FLOOR)
    return {"workdir": workdir, "out": out, "code": won.returncode, "everyone": everyone,
            "lost": lost.communicate()[0], "lost code": lost.returncode}  # fmt: skip


def test_two_runs_started_together_exactly_one_trains(slowed_then_interrupted):
    workdir, lost = slowed_then_interrupted["workdir"], slowed_then_interrupted["lost"]
    assert slowed_then_interrupted["lost code"] == 1, lost
    assert slowed_then_interrupted["code"] == 130, slowed_then_interrupted["out"]
    assert f"ftjob run: job folder {workdir} is in use by run slow-" in lost
    assert "Traceback" not in lost and "taken over" not in slowed_then_interrupted["out"] + lost
    steps = [r["step"] for r in history(workdir)]
    assert steps == list(range(1, len(steps) + 1)), steps  # one run's steps, once each
    assert not (workdir / "owner").exists()


# The rule is test_recovery_rules.py's; this, a real run of it.
def test_a_slow_rank_is_named_a_straggler(slowed_then_interrupted):
    workdir, out = slowed_then_interrupted["workdir"], slowed_then_interrupted["out"]
    line = next(x for x in out.splitlines() if x.startswith("straggler: "))
    print(line)
    assert line.startswith("straggler: rank 1 (node ") and "x the median" in line, line
    named = json.loads((workdir / "progress.json").read_text())["stragglers"]
    assert [s["rank"] for s in named] == [1]
    assert named[0]["stepSeconds"] > 1.25 * named[0]["medianSeconds"]
    assert "rank 0 (node" not in out


def test_a_second_ctrl_c_still_says_what_happened_and_leaves_nothing(slowed_then_interrupted):
    workdir, out = slowed_then_interrupted["workdir"], slowed_then_interrupted["out"]
    assert slowed_then_interrupted["code"] == 130, out
    assert "ftjob run: interrupted; every process stopped" in out
    assert "Run the same command again to resume from" in out
    assert not [p for p in slowed_then_interrupted["everyone"] if alive(p)]
    assert not run_processes(workdir)


def test_processes_ends_a_stopped_process_and_an_orphan(tmp_path):
    """ftjob.job.processes on its own: a stopped child and an orphaned grandchild both end."""
    script = (
        "import ftjob.job.processes as p, os, signal, subprocess, sys, time\n"
        "p.become_subreaper()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "os.kill(child.pid, signal.SIGSTOP)\n"
        # a grandchild whose parent exits at once: an orphan, handed to us
        "subprocess.run(['sh', '-c', 'sleep 60 & echo $! > %s'])\n"
        "time.sleep(0.2)\n"
        "print(child.pid, flush=True)\n"
        "p.end_all(2.0)\n"
        "child.wait(); p.reap()\n"
        "print(p.descendants(), flush=True)\n"
    ) % (tmp_path / "orphan")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    child, left = done.stdout.splitlines()
    orphan = int((tmp_path / "orphan").read_text())
    assert left == "[]" and not alive(int(child)) and not alive(orphan)
