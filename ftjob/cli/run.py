"""``ftjob run job.yaml``: the job's nodes as local processes; progress on screen, logs on disk.

    ftjob run examples/tiny.yaml                 # 2 CPU processes, about a minute
    ftjob run examples/tiny.yaml --workdir /tmp/tiny

Each node gets exactly the command and environment a pod would (:mod:`ftjob.job.launch`), with
node 0 at 127.0.0.1 on a free port. The job's volume is a local folder (``runs/<name>/`` by
default) and relative sources are read beside the job file. Any node failing stops the
others (a gang, as on a cluster); running it again resumes from the newest checkpoint.

The screen shows rank 0's own lines and, on a terminal, a live bar (:mod:`ftjob.cli.screen`);
each node's full output is kept in ``<job folder>/logs/node-<rank>.log``, and a failure is
summarised first (:mod:`ftjob.cli.failure`): which node and rank, what, the fix, where the log is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ftjob.api import contract, manifest
from ftjob.api.contract import TrainerError
from ftjob.api.schema import SpecError, check_rules
from ftjob.api.spec import KIND, parse_resource
from ftjob.cli import failure
from ftjob.cli.screen import Screen
from ftjob.job import folder as jobfolder
from ftjob.job import inputs, launch, lease, processes
from ftjob.job.folder import JobFolder

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
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


def run(job_file: str, workdir: str | None = None, out=None, restart: bool = False) -> int:
    """Run every node of the job in ``job_file`` locally; return an exit code."""
    out = out or sys.stdout
    doc = manifest.load_one(job_file, KIND)
    try:
        name, spec = parse_resource(doc)
    except SpecError as e:
        print(f"{job_file}: invalid {KIND}:", file=sys.stderr)
        for err in e.errors:
            print(f"  {err}", file=sys.stderr)
        return EXIT_FAILED
    job_dir = Path(workdir or Path.cwd() / "runs" / name).resolve()
    source_root = Path(job_file).resolve().parent
    if not _can_start(job_file, spec, source_root, None if restart else job_dir, out):
        return EXIT_FAILED
    if restart and job_dir.exists() and not _set_aside(job_dir, out):
        return EXIT_FAILED
    # The rendezvous id, unique per `ftjob run`: the trainer's rank 0 finds the folder held by
    # its own run and carries the lease on.
    run_id = f"{name}-{os.getpid()}-{int(time.time())}"
    held = lease.Lease(job_dir, run=run_id)
    try:
        held.take(wait_seconds=0)  # before anything is written there (spec.json); exclusive
    except TrainerError as e:
        print(f"ftjob run: {e}", file=sys.stderr)
        return EXIT_FAILED
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        return _run_held(job_file, name, spec, job_dir, source_root, run_id, out)
    finally:
        held.release()
        # Restored only now: a Ctrl-C that comes while the run is stopped and summarised
        # must not cut the summary short (ftjob.cli.run._stop leaves its handler in place).
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _can_start(job_file: str, spec, source_root: Path, job_dir: Path | None, out) -> bool:
    """This machine has what the job needs: its GPUs, its model and its data (``job_dir``:
    the folder whose downloads count, None for --restart)."""
    refusal = _missing_gpus(spec)
    if refusal:
        print(f"ftjob run: {job_file}: {refusal}", file=out, flush=True)
        return False
    # Named here in a moment, not by the trainer after torch's 10-20 s start-up (the trainer
    # keeps its own checks: pods on a cluster read the volume, not this machine).
    missing = inputs.missing(spec, source_root, job_dir)
    for problem in missing:
        print(f"ftjob run: {job_file}: {problem.path}: {problem.message}", file=out)
        print(f"  fix: {problem.fix}", file=out, flush=True)
    return not missing


def _set_aside(job_dir: Path, out) -> bool:
    """--restart: move the earlier run's folder aside (never one in use); False if in use."""
    busy = lease.in_use(job_dir)  # a folder in use is not moved from under its run
    if busy:
        print(f"ftjob run: {busy}", file=sys.stderr)
        return False
    aside = job_dir.with_name(f"{job_dir.name}.old-{time.strftime('%Y%m%dT%H%M%S')}")
    os.rename(job_dir, aside)
    print(f"ftjob run: --restart: the earlier run is kept in {aside}", file=out, flush=True)
    return True


def _run_held(job_file, name, spec, job_dir: Path, source_root: Path, run_id: str, out) -> int:
    """The rest of :func:`run`, with the job folder held by this run."""
    answered = _answered(name, spec, job_dir, out)
    if answered is not None:
        return answered
    logs, spec_file = _prepare_folder(job_dir, name, spec)
    r = spec.resources
    print(
        f"ftjob run: {name}: {r.nodes} node(s) x {r.nproc_per_node} process(es) on this "
        f"machine, job folder {job_dir}, logs in {logs}",
        file=out,
        flush=True,
    )
    # Orphans of the run (a worker whose agent died) are handed to this process, which ends
    # them with the rest (ftjob.job.processes).
    processes.become_subreaper()
    # `kill`, a closed terminal or a CI timeout stop the gang the same way as Ctrl-C.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    screen = Screen(out, JobFolder(job_dir).progress, since=time.time())
    port = free_port()
    nodes: list[Node] = []
    first, interrupted, hurried = None, False, False
    try:
        with screen:
            for rank in range(r.nodes):
                nodes.append(
                    _node(spec, name, rank, run_id, spec_file, port, job_dir, source_root, screen)
                )
            first = _wait(nodes, screen)
    except KeyboardInterrupt:
        interrupted = True
        print("\nftjob run: interrupted; stopping every process (Ctrl-C again: at once)",
              file=out, flush=True)  # fmt: skip
    finally:
        # Every exit path ends every process of the run (an exception included); a second
        # Ctrl-C only hurries this along.
        hurried = _stop(nodes)
    return _ended(job_dir, nodes, first, interrupted, hurried, out)


def _answered(name: str, spec, job_dir: Path, out) -> int | None:
    """The exit code when the folder's record answers without a run: it was trained with
    another spec (refused), or this one is trained already; None: run."""
    recorded = jobfolder.read(job_dir)
    diff = jobfolder.changes(recorded, spec) if recorded else []
    if diff:
        fix = (
            "Keep it and train elsewhere (--workdir DIR), or start over here (--restart: "
            "the earlier run is moved aside, not deleted)."
        )
        print(f"ftjob run: {jobfolder.refusal(job_dir, diff, fix)}", file=sys.stderr)
        return EXIT_FAILED
    export = inputs.already_trained(spec, job_dir, recorded)
    if export is not None:
        # Answered without starting torch; progress.json stays as the finished run left it.
        print(
            f"ftjob run: {name}: already trained ({recorded.get('trainedSteps', '?')} steps); the "
            f"exported model is in {export}. To train on, raise spec.training.maxSteps; to "
            "start over, --restart",
            file=out,
            flush=True,
        )
        return EXIT_OK
    return None


def _prepare_folder(job_dir: Path, name: str, spec) -> tuple[Path, Path]:
    """The folders the nodes write to, and the folder's record, also the spec file the nodes
    read (safe changes update it): (the logs folder, the spec file)."""
    folder = JobFolder(job_dir)
    folder.logs.mkdir(parents=True, exist_ok=True)
    folder.tmp.mkdir(exist_ok=True)
    jobfolder.write(job_dir, name, spec)
    return folder.logs, folder.record


def _node(spec, name, rank, run_id, spec_file, port, job_dir, source_root, screen) -> Node:
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
    env = {**os.environ, **cmd.env, **_local_env(spec, rank, job_dir)}
    env["FTJOB_TERMINATION_LOG"] = str(termination)
    argv = [sys.executable, *cmd.argv[1:]]  # this Python, with ftjob installed
    return Node(rank, argv, env, folder.node_log(rank), screen)


def _ended(job_dir: Path, nodes: list[Node], first, interrupted: bool, hurried: bool, out) -> int:
    """Say how the run ended (interrupted, failed, done) and return its exit code."""
    restarts = _restarts(job_dir)
    if interrupted:
        how = " (killed at once on the second Ctrl-C)" if hurried else ""
        print(
            f"ftjob run: interrupted; every process stopped{how}{restarts}. Run the same "
            f"command again to resume from {_newest_checkpoint(job_dir)}",
            file=out,
            flush=True,
        )
        return EXIT_INTERRUPTED
    if first is not None:
        # The first node to fail leads, so that a tie between unnamed causes goes to it.
        ordered = [first, *(n for n in nodes if n is not first)]
        for line in _describe(failure.summarize([n.outcome() for n in ordered])):
            print(line, file=out)
        if restarts:  # the last failure is the one shown; the log has the earlier ones
            print(f"ftjob run: failed{restarts}; the nodes' logs say why in their "
                  "'ftjob agent:' lines", file=out)  # fmt: skip
        print(f"ftjob run: once fixed, run it again: it resumes from "
              f"{_newest_checkpoint(job_dir)}", file=out, flush=True)  # fmt: skip
        return EXIT_FAILED
    export = _export_path(job_dir)
    print(f"ftjob run: done{restarts}; the exported model is in {export}", file=out, flush=True)
    return EXIT_OK


def _restarts(job_dir: Path) -> str:
    """ " (after N restarts in place)" as rank 0 last reported it; "" when none."""
    try:
        count = int(json.loads(JobFolder(job_dir).progress.read_text()).get("restartsInPlace") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        count = 0
    if not count:
        return ""
    return f" (after {count} restart{'s' if count > 1 else ''} in place)"


def _describe(summary: failure.Summary) -> list[str]:
    """The failure, most important first: the headline, its details, the fix, the log."""
    lines = [f"ftjob run: {summary.headline()}"]
    lines += [f"  {x}" for x in summary.details]
    if summary.fix:
        lines.append(f"  fix: {summary.fix}")
    lines.append(f"  full log: {summary.log}")
    return lines


def _missing_gpus(spec) -> str | None:
    """Why this machine cannot run a GPU job (None if it can), said before any process starts."""
    r = spec.resources
    if not r.gpus_per_node:
        return None
    import torch  # only GPU jobs pay for the import

    need, have = r.nodes * r.gpus_per_node, torch.cuda.device_count()
    if have >= need:
        return None
    # The CPU variant must pass the spec's rules too: name what else it has to change.
    cpu = dataclasses.replace(spec, resources=dataclasses.replace(r, gpus_per_node=0))
    also = sorted({e.path.removeprefix("spec.") for e in check_rules(cpu, "spec")})
    then = f" (then also change {', '.join(also)})" if also else ""
    return (
        f"needs {need} GPUs (resources.nodes {r.nodes} x resources.gpusPerNode "
        f"{r.gpus_per_node}) but this machine has {have}; run it on a cluster "
        f"(kubectl apply -f), or on CPU with resources.gpusPerNode: 0{then}"
    )


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _local_env(spec, rank: int, job_dir: Path) -> dict[str, str]:
    env = {
        "TMPDIR": str(JobFolder(job_dir).tmp),  # torchrun leaves torchelastic_* folders there
        # Each node's termination record (ftjob.api.contract), as a container's message file.
        "FTJOB_TERMINATION_LOG": str(JobFolder(job_dir).node_termination(rank)),
    }
    r = spec.resources
    if r.gpus_per_node:
        gpus = range(rank * r.gpus_per_node, (rank + 1) * r.gpus_per_node)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    elif "OMP_NUM_THREADS" not in os.environ:
        # All "nodes" share this machine: split its cores between every process.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // r.world_size))
    if "FTJOB_PROGRESS_PORT" not in os.environ:
        # The spec's port may be taken on a workstation; progress.json has the one chosen.
        env["FTJOB_PROGRESS_PORT"] = "0"
    return env


def _wait(nodes: list[Node], screen: Screen) -> Node | None:
    """Wait until all nodes succeed (None) or one fails (that node); move the bar meanwhile."""
    while True:
        codes = [n.proc.poll() for n in nodes]
        for node, code in zip(nodes, codes, strict=True):
            if code not in (None, 0):
                return node
        if all(code == 0 for code in codes):
            return None
        screen.poll()
        time.sleep(0.2)


def _stop(nodes: list[Node]) -> bool:
    """End every process of the run (ftjob.job.processes: stopped ones too, SIGKILL after
    STOP_GRACE_SECONDS); a Ctrl-C or SIGTERM meanwhile kills at once. True if one did.
    The handler stays until :func:`run` returns: later signals are noted, not raised."""
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


def _newest_checkpoint(job_dir: Path) -> str:
    """Where a rerun resumes, as rank 0 last reported it (the trainer decides on the rerun)."""
    root = JobFolder(job_dir).checkpoints
    try:
        snap = json.loads(JobFolder(job_dir).progress.read_text())
    except (OSError, ValueError):
        snap = {}
    last = snap.get("lastCheckpoint")
    if last and Path(last).is_dir():
        return f"the newest checkpoint in {root} (step {snap.get('lastCheckpointStep')})"
    return f"the newest checkpoint in {root}, if any (else from the start)"


def _export_path(job_dir: Path) -> str:
    try:
        return json.loads(JobFolder(job_dir).progress.read_text())["exportPath"]
    except (OSError, ValueError, KeyError):
        return str(job_dir)
