"""Recovery with real processes: `ftjob run` (2 nodes x 1 CPU process) restarting workers in
place, refusing to restart a permanent failure, naming a slow rank and a stopped one, one
winner of two simultaneous starts, and nothing left behind.

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
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist
from safetensors.torch import load_file
from test_trainer_run import (
    RUN_TIMEOUT,
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


def test_a_permanent_failure_is_not_restarted_in_place(tmp_path):
    # Parquet: read by the trainer itself (ftjob run reads JSON lines, JSON and CSV first)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["fine", None]}), bad)
    workdir = tmp_path / "permanent"
    code, out = run(recovery_job("permanent", dataset={"source": str(bad)}), workdir)
    assert code == 1
    assert "BadData" in out and f"{bad} record 2: field 'text' must be a str" in out
    logs = "".join(p.read_text() for p in (workdir / "logs").glob("node-*.log"))
    assert "retrying on these nodes cannot help, so no restart in place" in logs
    assert "restarting the workers" not in logs and "restart 1 of" not in logs


def test_two_runs_started_together_exactly_one_trains(tmp_path):
    workdir = tmp_path / "together"
    doc = recovery_job("together", training={"maxSteps": 4})
    first, second = start(doc, workdir), start(doc, workdir)
    outs = [p.communicate(timeout=RUN_TIMEOUT)[0] for p in (first, second)]
    codes = sorted(p.returncode for p in (first, second))
    assert codes == [0, 1], outs
    won = outs[[first.returncode, second.returncode].index(0)]
    lost = outs[[first.returncode, second.returncode].index(1)]
    assert "done; the exported model is in" in won
    assert f"ftjob run: job folder {workdir} is in use by run together-" in lost
    assert "Traceback" not in lost and "taken over" not in won + lost
    assert sorted(losses(workdir)) == [1, 2, 3, 4]  # one run's steps, once each
    assert not (workdir / "owner").exists()


# The slow tier (tests/deadline.py): the rule is test_recovery_rules.py's; this, a real run of it.
@pytest.mark.slow
def test_a_slow_rank_is_named_a_straggler(tmp_path, monkeypatch):
    workdir = tmp_path / "slow"
    injected(monkeypatch, "slow:1:0.3")  # rank 1's data takes 0.3 s longer every step
    code, out = run(recovery_job("slow"), workdir)
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("straggler: "))
    print(line)
    assert line.startswith("straggler: rank 1 (node ") and "x the median" in line, line
    named = json.loads((workdir / "progress.json").read_text())["stragglers"]
    assert [s["rank"] for s in named] == [1]
    assert named[0]["stepSeconds"] > 1.25 * named[0]["medianSeconds"]
    assert "rank 0 (node" not in out


def test_a_stopped_rank_is_named_and_no_process_of_the_run_survives(tmp_path):
    workdir = tmp_path / "stopped"
    doc = recovery_job(
        "stopped",
        training={"maxSteps": 500},
        network={"collectiveTimeoutSeconds": 30},  # the least the spec allows
        runPolicy={"inPlaceRestarts": 0},  # the ladder's last rung: the run fails
    )
    proc = start(doc, workdir)
    wait_for_step(proc, workdir, 3)
    everyone = run_processes(workdir)
    stopped = rank_pid(workdir, 1)
    assert stopped in everyone and len(everyone) == 4  # 2 agents, 2 workers
    # Three steps can take less than the second between beats: stop it once it has beaten
    # from training, or its last beat is the one from before step 1.
    beats = gang_store(workdir, stopped)
    hangs.poll(lambda: heartbeat.read(beats, 2).get(1, {}).get("step", 0) >= 1, hangs.RUN,
               "rank 1's heartbeat after a step")  # fmt: skip
    os.kill(stopped, signal.SIGSTOP)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 1, out
    headline = next(x for x in out.splitlines() if x.startswith("ftjob run: node"))
    print(headline)
    assert "CollectiveTimeout" in headline, headline
    assert "stopped answering: rank 1 (node " in headline and f"pid {stopped})" in headline
    # Its last heartbeat came from training (it beats after steps, at most once a second).
    assert int(re.search(r"last heartbeat \d+ s ago, at step (\d+)", headline)[1]) >= 1
    assert not [p for p in everyone if alive(p)]  # the stopped one included
    assert not run_processes(workdir)


@pytest.mark.slow  # tests/deadline.py: the restart in place and its exact resume are the raised
# worker's test; the hang named, the stopped rank's without restarts
def test_a_stopped_rank_is_restarted_in_place_with_the_gang_which_resumes_exactly(
    reference, tmp_path, monkeypatch
):
    """The rung before: with restarts left, the hang costs one collective timeout. The
    stopped worker's agent continues it (SIGCONT) before ending it, and every node resumes."""
    workdir = tmp_path / "hang"
    gate = tmp_path / "gate"
    hold_after(monkeypatch, 5, gate)
    proc = start(recovery_job("hang", network={"collectiveTimeoutSeconds": 30}), workdir)
    wait_for_step(proc, workdir, 5)
    stopped = rank_pid(workdir, 1)
    os.kill(stopped, signal.SIGSTOP)
    gate.touch()
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, out
    notice = next(x for x in out.splitlines() if x.startswith("ftjob agent: node 0: rank 0"))
    assert "CollectiveTimeout" in notice and "stopped answering: rank 1 (node " in notice
    assert "(restart 1 of 3)" in notice and "done (after 1 restart in place)" in out
    assert not alive(stopped)
    resumed, expected = losses(workdir), losses(reference)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - expected[s]) for s in resumed) == 0.0


def test_a_second_ctrl_c_still_says_what_happened_and_leaves_nothing(tmp_path):
    workdir = tmp_path / "twice"
    proc = start(recovery_job("twice", training={"maxSteps": 500}), workdir)
    wait_for_step(proc, workdir, 2)
    everyone = run_processes(workdir)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "ftjob run: interrupted; every process stopped" in out
    assert "Run the same command again to resume from" in out
    assert not [p for p in everyone if alive(p)] and not run_processes(workdir)


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
