"""The pure parts of recovery: who went silent, who straggles, what the agent decides and
says, the trainer's metrics for them, and the exclusive take of a job folder by processes."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import hangs
import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ftjob.api import contract
from ftjob.job import lease, processes
from ftjob.job.folder import JobFolder
from ftjob.trainer import agent
from ftjob.trainer.gang import heartbeat
from ftjob.trainer.gang.stragglers import CONSECUTIVE, Stragglers
from ftjob.trainer.report.progress import Progress


def beats(now: float, **ranks) -> dict[int, dict]:
    """rank -> heartbeat, from r<rank>=(seconds ago, step)."""
    return {
        int(k[1:]): {"at": now - ago, "step": step, "node": f"n{k[1:]}", "pid": 100 + int(k[1:])}
        for k, (ago, step) in ranks.items()
    }


def test_a_rank_whose_heartbeat_stopped_is_named_with_its_node_and_step():
    now, interval = 1000.0, 5.0
    seen = beats(now, r0=(1, 8), r1=(40, 7), r2=(2, 8))
    assert heartbeat.silent(seen, 3, now, interval) == [1]
    said = heartbeat.describe_silent(seen, 3, now, interval)
    assert (
        said == "stopped answering: rank 1 (node n1, pid 101): last heartbeat 40 s ago, at step 7"
    )
    # A rank that never beat while the others did is silent too.
    assert heartbeat.silent(beats(now, r0=(1, 3)), 2, now, interval) == [1]


def test_when_every_rank_beats_the_ranks_furthest_behind_are_named():
    now = 1000.0
    seen = beats(now, r0=(1, 9), r1=(1, 9), r2=(2, 8))
    assert heartbeat.silent(seen, 3, now, 5.0) == []
    assert heartbeat.describe_silent(seen, 3, now, 5.0).startswith(
        "waiting for the ranks furthest behind: rank 2 (node n2"
    )
    level = beats(now, r0=(1, 9), r1=(1, 9))
    assert heartbeat.describe_silent(level, 2, now, 5.0) == ""  # the heartbeats cannot tell
    assert heartbeat.describe_silent({}, 2, now, 5.0) == ""


def test_heartbeats_go_stale_well_before_the_collective_times_out():
    for timeout in (30, 600, 1800):
        interval = heartbeat.interval_for(timeout)
        assert heartbeat.STALE_BEATS * interval <= timeout / 2


def test_a_straggler_is_named_after_consecutive_slow_log_steps_and_cleared_when_back():
    slow = Stragglers(margin=0.25, nodes=["a", "a", "b", "b"])
    times = [0.10, 0.11, 0.10, 0.20]
    changes = [slow.observe(times) for _ in range(CONSECUTIVE)]
    assert changes == [False] * (CONSECUTIVE - 1) + [True]
    assert slow.named == [{"rank": 3, "node": "b", "stepSeconds": 0.2, "medianSeconds": 0.105}]
    assert slow.describe().startswith("straggler: rank 3 (node b) takes 0.200 s per step, 1.90x")
    assert slow.observe(times) is False  # still named: nothing new to say
    assert slow.observe([0.10, 0.11, 0.10, 0.12]) is True and slow.named == []
    # Within the margin, or slow only now and then: never named.
    steady = Stragglers(margin=0.25, nodes=["a"] * 4)
    for t in ([0.1, 0.1, 0.1, 0.124], [0.1, 0.1, 0.1, 0.3], [0.1, 0.1, 0.1, 0.1]) * 3:
        steady.observe(list(t))
    assert steady.named == []


def test_the_trainer_exports_restarts_and_stragglers_as_metrics(tmp_path, monkeypatch):
    # Rank 0 of a gang the node agent restarted twice in place (the count it is given), whose
    # rank 3 is slower than the margin on CONSECUTIVE log steps: its own /metrics page.
    monkeypatch.setenv("FTJOB_RESTARTS_IN_PLACE", "2")
    report = Progress(tmp_path, True, 60, 4, writes_files=False)
    slow = Stragglers(margin=0.5, nodes=["a", "a", "b", "b"])
    for _ in range(CONSECUTIVE):
        slow.observe([0.1, 0.1, 0.1, 0.2])
    report.stragglers(slow.named, slow.describe())
    text = report.metrics.text().decode()
    report.close()
    assert "ftjob_gang_restarts_in_place 2.0" in text
    assert 'ftjob_straggler_step_seconds{node="b",rank="3"} 0.2' in text
    assert "ftjob_stragglers 1.0" in text


def failed(rank: int, code: int) -> RunResult:
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=code, error_file="")
    return RunResult(state=WorkerState.FAILED, failures={rank: failure})


def test_the_agent_reads_the_nodes_failure_record_and_says_what_failed(tmp_path):
    path = tmp_path / "node-1.termination"
    assert agent.read_failure(path) is None  # none written: killed from outside
    assert agent.describe(None, failed(1, -9)) == "rank 1 failed (exit signal SIGKILL)"
    record = contract.Failure(contract.BAD_DATA, "data.jsonl line 3: not valid JSON\nmore", rank=1)
    path.write_text(contract.dumps(record.record()))
    seen = agent.read_failure(path)
    assert seen["reason"] == contract.BAD_DATA
    said = agent.describe(seen, failed(1, 1))
    assert said == "rank 1 failed: BadData: data.jsonl line 3: not valid JSON"
    path.write_text(contract.dumps(contract.success_record("/x/model")))
    assert agent.read_failure(path) is None


class FakeAgent(agent.Agent):
    """Agent._decide without starting torch's agent (its state is the budget left)."""

    def __init__(self, termination, remaining):
        self.node_rank, self.termination, self._remaining_restarts = 0, termination, remaining


def test_the_agent_stops_restarting_where_retrying_here_cannot_help(tmp_path, capsys):
    path = tmp_path / "node-0.termination"
    for reason, left in [(contract.BAD_SPEC, 0), (contract.BAD_MODEL, 0), (contract.INTERNAL, 2),
                         (contract.NODE_UNHEALTHY, 0), (contract.FABRIC_MISCONFIGURED, 0),
                         (contract.COLLECTIVE_TIMEOUT, 2), (contract.CUDA_OOM, 2)]:  # fmt: skip
        path.write_text(contract.dumps(contract.Failure(reason, "x", rank=0).record()))
        node = FakeAgent(path, remaining=2)
        node._decide(failed(0, 1), budget=3)
        assert node._remaining_restarts == left, reason
    spent = FakeAgent(path, remaining=0)
    spent._decide(failed(0, 1), budget=3)  # torch's loop then fails the node
    out = capsys.readouterr().out
    assert "rank 0 failed: CudaOOM: x; no in-place restart left (3 used)" in out
    assert (
        "ftjob agent: node 0: rank 0 failed: BadSpec: x; retrying on these nodes cannot help" in out
    )
    assert "rank 0 failed: CudaOOM: x; restarting the workers of every node in place" in out
    assert "(restart 2 of 3)" in out
    # A worker stuck in the kernel: torch's agent gives its budget up itself (no record).
    path.write_text("")
    stuck = FakeAgent(path, remaining=0)
    stuck._decide(RunResult(state=WorkerState.UNHEALTHY), budget=3)
    out = capsys.readouterr().out
    assert "node 0: a worker is stuck in uninterruptible sleep (D-state)" in out
    assert "torch's agent restarts no workers beside it, so no restart in place" in out
    assert "used" not in out


def _take(folder: str, run: str, go, done, results) -> None:
    go.wait()
    path = Path(folder)
    try:
        lease.Lease(path, run=run).take(0)
        results.put((run, "owner", json.loads(JobFolder(path).owner.read_text())["run"]))
    except contract.TrainerError as e:
        results.put((run, e.reason, None))
    done.wait(hangs.FLOOR)  # the owner stays alive (a live pid) until every contender has answered


def test_of_many_processes_taking_a_folder_at_once_exactly_one_owns_it(tmp_path):
    """Separate processes, as two `ftjob run` are, released at the same instant."""
    ctx = multiprocessing.get_context("fork")
    for attempt in range(5):
        folder = tmp_path / f"f{attempt}"
        go, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_take, args=(str(folder), f"run-{i}", go, done, results))
                 for i in range(6)]  # fmt: skip
        for p in procs:
            p.start()
        go.set()
        outcomes = [results.get(timeout=hangs.FLOOR) for _ in procs]
        done.set()
        for p in procs:
            p.join(hangs.FLOOR)
        owners = [o for o in outcomes if o[1] == "owner"]
        assert len(owners) == 1, outcomes
        assert owners[0][0] == owners[0][2]  # the file names the one owner
        assert sorted(o[1] for o in outcomes) == [contract.OWNED_ELSEWHERE] * 5 + ["owner"]
        assert [p.name for p in folder.iterdir()] == [
            JobFolder(folder).owner.name
        ]  # no temporary file left


def test_an_unreadable_owner_file_holds_nothing(tmp_path):
    JobFolder(tmp_path).owner.write_text("{not json")
    held = lease.Lease(tmp_path, run="job-1")
    held.take(0)
    assert json.loads(JobFolder(tmp_path).owner.read_text())["run"] == "job-1"
    held.release()
    assert list(tmp_path.iterdir()) == []


class _Counted:
    """A real store, counting the calls (each one a round trip to the store's server)."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return getattr(self.store, name)(*args)

        return call


def test_a_rank_reads_every_heartbeat_in_two_round_trips_of_the_store():
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=hangs.FLOOR))  # fmt: skip
    now = 1000.0
    for rank, beat in beats(now, r0=(1, 7), r1=(2, 7), r2=(40, 3), r3=(1, 7)).items():
        server.set(f"{heartbeat.PREFIX}{rank}", json.dumps(beat))
    store = _Counted(server)
    assert heartbeat.read(store, 4) == beats(now, r0=(1, 7), r1=(2, 7), r2=(40, 3), r3=(1, 7))
    assert store.calls == ["check", "multi_get"]  # not a check and a get per rank
    # A rank that never beat: the others' still, without waiting out the store's timeout
    # (a multi_get of a key never set waits for it).
    server.delete_key(f"{heartbeat.PREFIX}2")
    store.calls.clear()
    assert sorted(heartbeat.read(store, 4)) == [0, 1, 3]
    assert store.calls.count("multi_get") == 1


def test_a_failed_trainer_gives_the_folder_up_itself_only_when_no_ftjob_agent_runs_it(
    tmp_path, monkeypatch
):
    """Under ftjob's agent (it sets FTJOB_RESTARTS_IN_PLACE) the folder stays the gang's: the
    agent decides on restarts in place and releases it when the gang is over. Under plain
    torchrun nobody else would."""
    from ftjob.trainer import __main__ as entry
    from ftjob.trainer import train
    from ftjob.trainer.gang import owner

    def fails(spec, name):
        raise contract.TrainerError("bad line", reason=contract.BAD_DATA)

    monkeypatch.setattr(train, "run", fails)
    monkeypatch.delenv("FTJOB_TERMINATION_LOG", raising=False)
    tiny = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
    for agent_runs_it in (True, False):
        if agent_runs_it:
            monkeypatch.setenv(contract.RESTARTS_IN_PLACE_ENV, "0")
        else:
            monkeypatch.delenv(contract.RESTARTS_IN_PLACE_ENV)
        held = lease.Lease(tmp_path, run="job-1")
        held.take(0)
        monkeypatch.setattr(owner, "_held", held)
        assert entry.main(["--spec", tiny]) == entry.EXIT_FAILED
        assert JobFolder(tmp_path).owner.exists() == agent_runs_it
        held.release()


def named_process(name: str) -> subprocess.Popen:
    """A sleeping process whose command name (``/proc/<pid>/stat``'s second field) is
    ``name``: a program may name itself anything, spaces and parentheses included."""
    code = (
        "import ctypes, sys, time\n"
        "ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME\n"
        "print('named', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "named\n"
    return proc


def test_a_live_owner_is_seen_whatever_its_command_name(tmp_path):
    proc = named_process("x) Z (y")
    try:
        assert f"({'x) Z (y'})" in Path(f"/proc/{proc.pid}/stat").read_text()
        assert processes.alive(proc.pid)
        # An `ftjob run` on this machine, which carries its lease on itself.
        start = processes.started(proc.pid)
        held = replace(lease.Owner.me("job-1"), pid=proc.pid, carrier=proc.pid,
                       pid_started=start, carrier_started=start)  # fmt: skip
        JobFolder(tmp_path).owner.write_text(json.dumps(asdict(held)))
        with pytest.raises(contract.TrainerError) as refused:
            lease.Lease(tmp_path, run="job-2").take(0)
        assert refused.value.reason == contract.OWNED_ELSEWHERE
    finally:
        proc.kill()
        proc.wait()
    assert not processes.alive(proc.pid)
    lease.Lease(tmp_path, run="job-2").take(0)  # its process is gone: the folder is free


def test_an_owner_whose_pid_a_later_process_holds_frees_the_folder(tmp_path):
    """The pod that replaces a SIGKILLed one on a real kubelet has the same hostname, often the
    same PID namespace inode, and its agent is PID 1 again: the dead owner's pid is alive, but
    a later process holds it. Seen on a real node: the new gang was refused (JobFolderBusy)
    until the job failed. A process is its pid and its start time."""
    proc = named_process("later")
    try:
        start = processes.started(proc.pid)
        live = replace(lease.Owner.me("job-1"), pid=proc.pid, carrier=proc.pid,
                       pid_started=start, carrier_started=start)  # fmt: skip
        JobFolder(tmp_path).owner.write_text(json.dumps(asdict(live)))
        with pytest.raises(contract.TrainerError):
            lease.Lease(tmp_path, run="job-2").take(0)
        earlier = live.pid_started - 1  # the dead owner's process started before this one
        dead = replace(live, pid_started=earlier, carrier_started=earlier)
        JobFolder(tmp_path).owner.write_text(json.dumps(asdict(dead)))
        lease.Lease(tmp_path, run="job-2").take(0)
        assert lease.Lease(tmp_path, run="job-3").read().run == "job-2"
    finally:
        proc.kill()
        proc.wait()


GANG = """
import os, subprocess, sys, time
from pathlib import Path
from ftjob.job import lease
role, folder = sys.argv[1], Path(sys.argv[2])
if role == "run":  # `ftjob run`: takes the folder, starts node 0's agent, refreshes often
    lease.HEARTBEAT_SECONDS = 0.05
    lease.Lease(folder, run="job-1").take(0)
    subprocess.Popen([sys.executable, __file__, "agent", str(folder)]).wait()
elif role == "agent":  # its workers get the rendezvous id, as torchrun's do
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job-1"}
    subprocess.Popen([sys.executable, __file__, "worker", str(folder)], env=env).wait()
else:  # rank 0 carries the lease of its own run on
    lease.Lease(folder).take(0)
    print(os.getppid(), os.getpid(), flush=True)
    time.sleep(60)
"""


def test_a_gang_whose_ftjob_run_was_killed_still_holds_the_folder(tmp_path):
    """`ftjob run` killed outright leaves its nodes' agents (sessions of their own) running,
    and their rank 0 writing: the folder is not free until they are gone too."""
    script, folder = tmp_path / "gang.py", tmp_path / "job"
    script.write_text(GANG)
    run = subprocess.Popen([sys.executable, script, "run", folder], stdout=subprocess.PIPE)
    agent, worker = map(int, run.stdout.readline().split())
    try:
        time.sleep(0.5)  # `ftjob run` refreshes the file several times meanwhile
        run.kill()
        run.wait()
        with pytest.raises(contract.TrainerError) as refused:
            lease.Lease(folder, run="job-2").take(0)
        assert refused.value.reason == contract.OWNED_ELSEWHERE
        assert f"pid {run.pid}) since" in str(refused.value)
        assert f"carried on by pid {agent}" in str(refused.value)
    finally:
        for pid in (worker, agent):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + hangs.FLOOR
    while processes.alive(agent) and time.monotonic() < deadline:
        time.sleep(0.05)
    lease.Lease(folder, run="job-2").take(0)  # every process of job-1 is gone
    assert json.loads(JobFolder(folder).owner.read_text())["run"] == "job-2"


def test_a_released_folder_is_not_written_back_by_a_last_refresh(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "HEARTBEAT_SECONDS", 0.01)
    refreshing, finish = threading.Event(), threading.Event()
    write = lease.Lease._write

    def slow_write(self):  # a refresh caught between reading the file and writing it
        if threading.current_thread().name == "ftjob-owner":
            refreshing.set()
            finish.wait(hangs.FLOOR)
        write(self)

    monkeypatch.setattr(lease.Lease, "_write", slow_write)
    held = lease.Lease(tmp_path, run="job-1")
    held.take(0)
    assert refreshing.wait(hangs.FLOOR)
    releasing = threading.Thread(target=held.release)
    releasing.start()
    releasing.join(0.2)  # not a hang guard: it must still be blocked after 0.2 s
    assert releasing.is_alive()  # it waits for the refresh under way
    finish.set()
    releasing.join(hangs.FLOOR)
    assert not JobFolder(tmp_path).owner.exists()


@pytest.mark.parametrize(
    ("written", "code", "kept"),
    [(None, contract.EXIT_PREEMPTED, "preempted"), ("failed", 1, "failed"),
     ("succeeded", 0, "succeeded")],
)  # fmt: skip
def test_a_sigterm_outside_the_loop_stops_a_node_but_never_hides_how_its_workers_ended(
    tmp_path, monkeypatch, written, code, kept
):
    """The agent's SIGTERM outside the training loop (ftjob run stops every node once one
    fails; a pod deleted while its gang starts): a node whose worker failed first ends failed
    (exit 1, the failure's record kept), one that finished ends 0, any other stopped (75)."""
    record = tmp_path / "node-0.termination"
    monkeypatch.setenv("FTJOB_TERMINATION_LOG", str(record))
    if written is not None:
        record.write_text(json.dumps({"outcome": written, "reason": "BadSpec", "rank": 1}))
    assert agent._stopped_outside_loop(record, 0) == code
    assert json.loads(record.read_text())["outcome"] == kept
