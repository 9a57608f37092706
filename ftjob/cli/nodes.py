"""``ftjob run``'s nodes: each node's command (what a pod would run, :mod:`ftjob.job.launch`)
as a local process in its own process group, with its log, and the gang's end: the first node
to fail, and every process stopped on any exit.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ftjob.api import contract
from ftjob.cli import failure
from ftjob.cli.screen import Screen
from ftjob.job import launch, processes
from ftjob.job.folder import JobFolder

STOP_GRACE_SECONDS = 10


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+), so that the connections other
    programs open cannot take it between this check and torchrun binding it."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767 for the rendezvous")


class Node:
    """One node's torchrun, in its own process group. Its whole output (stdout and stderr)
    goes to its log file; node 0's stdout (rank 0's log lines) also goes to the screen."""

    def __init__(self, rank: int, argv: list[str], env: dict[str, str], log: Path, screen):
        self.rank, self.log_path, self.screen = rank, log, screen if rank == 0 else None
        self.quiet = threading.Event()  # set while stopping: nothing more reaches the screen
        self._log = open(log, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._log.write(f"--- ftjob run, node {rank}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            # A session of its own: a Ctrl-C at the terminal reaches `ftjob run` only, which
            # then ends every process of the run itself (_stop, ftjob.job.processes.end_all).
            start_new_session=True,
            text=True,
            errors="replace",
        )
        self.readers = [
            threading.Thread(target=self._copy, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._copy, args=(self.proc.stderr, False), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _copy(self, stream, shown: bool) -> None:
        for line in stream:
            with self._lock:
                if not self._log.closed:  # a straggler after close() is dropped, not raised
                    self._log.write(line)
            if shown and self.screen is not None and not self.quiet.is_set():
                self.screen.line(line.rstrip("\n"))

    def stop(self, sig: int) -> None:
        self.quiet.set()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        for reader in self.readers:
            reader.join(timeout=5)
        with self._lock:
            self._log.close()

    def outcome(self) -> failure.NodeOutcome:
        termination = self.log_path.with_suffix(".termination")
        try:
            record = contract.parse(termination.read_text())
        except OSError:
            record = None  # killed, or crashed below Python: the log says what it can
        lines = self.log_path.read_text(errors="replace").splitlines()
        start = max((i for i, x in enumerate(lines) if x.startswith("--- ftjob run,")), default=0)
        return failure.NodeOutcome(
            self.rank, self.proc.returncode, record, lines[start:], str(self.log_path)
        )


def start_node(spec, name, rank, run_id, spec_file, port, job_dir, source_root, screen) -> Node:
    """Start node ``rank``: the pod's command (ftjob.job.launch) as a local process."""
    cmd = launch.node_command(
        spec,
        name,
        rank,
        "127.0.0.1",
        run_id,
        str(spec_file),
        node_addr="127.0.0.1",
        master_port=port,
        job_folder=str(job_dir),
        source_root=str(source_root),
    )
    folder = JobFolder(job_dir)
    termination = folder.node_termination(rank)
    termination.unlink(missing_ok=True)  # a previous run's record says nothing now
    env = {**os.environ, **cmd.env, **local_env(spec, rank, job_dir)}
    env["FTJOB_TERMINATION_LOG"] = str(termination)
    argv = [sys.executable, *cmd.argv[1:]]  # this Python, with ftjob installed
    return Node(rank, argv, env, folder.node_log(rank), screen)


def interrupt(signum, frame):
    raise KeyboardInterrupt


def local_env(spec, rank: int, job_dir: Path) -> dict[str, str]:
    env = {
        "TMPDIR": str(JobFolder(job_dir).tmp),  # torchrun leaves torchelastic_* folders there
        # Each node's termination record (ftjob.api.contract), as a container's message file.
        "FTJOB_TERMINATION_LOG": str(JobFolder(job_dir).node_termination(rank)),
    }
    r = spec.resources
    if r.on_gpu:
        gpus = range(rank * r.gpus_per_node, (rank + 1) * r.gpus_per_node)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    elif "OMP_NUM_THREADS" not in os.environ:
        # All "nodes" share this machine: split its cores between every process.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // r.world_size))
    if contract.GRACE_ENV not in os.environ:
        # A SIGTERM's save must fit before `ftjob run` kills what is left (stop_all).
        env[contract.GRACE_ENV] = str(STOP_GRACE_SECONDS)
    if "FTJOB_PROGRESS_PORT" not in os.environ:
        # The spec's port may be taken on a workstation; progress.json has the one chosen.
        env["FTJOB_PROGRESS_PORT"] = "0"
    return env


# How a node ends without failing: done, or stopped for a SIGTERM at a step boundary (its
# gang saved there; ftjob.trainer.gang.preempt).
ENDED = (0, contract.EXIT_PREEMPTED)


def wait_first(nodes: list[Node], screen: Screen) -> Node | None:
    """Wait until all nodes end without failing (None) or one fails (that node); move the
    bar meanwhile."""
    while True:
        codes = [n.proc.poll() for n in nodes]
        for node, code in zip(nodes, codes, strict=True):
            if code not in (None, *ENDED):
                return node
        if all(code in ENDED for code in codes):
            return None
        screen.poll()
        time.sleep(0.2)


def stop_all(nodes: list[Node]) -> bool:
    """End every process of the run (ftjob.job.processes: stopped ones too, SIGKILL after
    STOP_GRACE_SECONDS); a Ctrl-C or SIGTERM meanwhile kills at once. True if one did.
    The handler stays until :func:`ftjob.cli.run.run` returns: later signals are noted, not
    raised."""
    hurry = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: hurry.set())
    for node in nodes:
        node.quiet.set()
    processes.end_all(STOP_GRACE_SECONDS, hurry.is_set)
    for node in nodes:
        node.proc.wait()
    processes.reap()  # orphans this process adopted, once the nodes' codes are read
    for node in nodes:
        node.close()
    return hurry.is_set()
