"""``ftjob run job.yaml``: the job's nodes as local processes, one merged log.

    ftjob run examples/tiny.yaml                 # 2 CPU processes, about a minute
    ftjob run examples/tiny.yaml --workdir /tmp/tiny

Each node gets exactly the command and environment a pod would (:mod:`ftjob.launch`), with
node 0 at 127.0.0.1 on a free port. The job's volume is a local folder (``runs/<name>/`` by
default) and relative sources are read beside the job file. Any node failing stops the
others (a gang, as on a cluster); running it again resumes from the newest checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ftjob import launch, manifest
from ftjob.schema import SpecError, to_dict
from ftjob.spec import API_VERSION, KIND, parse_resource

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
    """One node's torchrun, in its own process group, its output copied line by line."""

    def __init__(self, rank: int, argv: list[str], env: dict[str, str], out, lock):
        self.rank, self.lines = rank, collections.deque(maxlen=400)
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() reaches every rank
            text=True,
            errors="replace",
        )
        self.reader = threading.Thread(target=self._copy, args=(out, lock), daemon=True)
        self.reader.start()

    def _copy(self, out, lock) -> None:
        agent_traceback = 0  # lines left to hide of torchrun's own (uninformative) traceback
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            # torchrun raises ChildFailedError with its own stack after a rank fails; the
            # rank's error and torchrun's summary are what matter, so the stack is hidden.
            if line == "Traceback (most recent call last):":
                agent_traceback = 60
            if agent_traceback:
                agent_traceback = (
                    0 if line.startswith("torch.distributed.elastic") else (agent_traceback - 1)
                )
                if agent_traceback or line.startswith("torch.distributed.elastic"):
                    continue
            with lock:
                out.write(f"[node-{self.rank}] {line}\n")
                out.flush()

    def stop(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(self.proc.pid, sig)

    def error(self) -> list[str]:
        """Why this node failed: the trainer's error (or the rank's traceback tail), then
        which rank failed with which exit code, from torchrun's summary."""
        lines = list(self.lines)
        found, own = False, []
        for line in lines:
            if line.startswith("error:"):
                found = True
            elif not line.startswith("  "):
                found = False
            if found:
                own.append(line)
        if not own:
            own = [line for line in lines if line.startswith("[rank")][-8:]
        summary = [
            line.strip()
            for line in lines
            if re.match(r"^\s+(rank|exitcode|traceback)\s+:", line) and "To enable" not in line
        ]
        return (own + summary[:3]) or lines[-12:]


def run(job_file: str, workdir: str | None = None, out=None) -> int:
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
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "tmp").mkdir(exist_ok=True)
    spec_file = job_dir / "spec.json"
    rendered = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}}
    spec_file.write_text(json.dumps({**rendered, "spec": to_dict(spec)}, indent=1) + "\n")

    r = spec.resources
    port, attempt = free_port(), int(time.time())
    print(
        f"ftjob run: {name}: {r.nodes} node(s) x {r.nproc_per_node} process(es) on this "
        f"machine, job folder {job_dir}",
        file=out,
        flush=True,
    )
    lock, nodes = threading.Lock(), []
    # `kill` or a CI timeout (SIGTERM) stops the gang the same way as Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for rank in range(r.nodes):
            cmd = launch.node_command(
                spec,
                name,
                rank,
                "127.0.0.1",
                f"{name}-{attempt}",
                str(spec_file),
                master_port=port,
                job_folder=str(job_dir),
                source_root=str(Path(job_file).resolve().parent),
            )
            env = {**os.environ, **cmd.env, **_local_env(spec, rank, job_dir)}
            # An earlier run's record is not this run's (a container's file starts empty).
            Path(env["FTJOB_TERMINATION_LOG"]).unlink(missing_ok=True)
            argv = [sys.executable, *cmd.argv[1:]]  # this Python, with ftjob installed
            nodes.append(Node(rank, argv, env, out, lock))
        failed = _wait(nodes)
    except KeyboardInterrupt:
        print("\nftjob run: interrupted; stopping every process", file=out, flush=True)
        return EXIT_INTERRUPTED
    finally:
        _stop(nodes)  # no-op for processes that have ended; never leaves orphans
        signal.signal(signal.SIGTERM, previous)
    if failed is not None:
        code = failed.proc.returncode
        print(f"ftjob run: node {failed.rank} failed (exit code {code}):", file=out)
        for line in failed.error():
            print(f"  {line}", file=out)
        print(f"ftjob run: once fixed, run it again: it resumes from the newest checkpoint in "
              f"{job_dir / 'checkpoints'}", file=out, flush=True)  # fmt: skip
        return EXIT_FAILED
    for node in nodes:
        node.reader.join(timeout=5)
    export = _export_path(job_dir)
    print(f"ftjob run: done; the exported model is in {export}", file=out, flush=True)
    return EXIT_OK


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _local_env(spec, rank: int, job_dir: Path) -> dict[str, str]:
    env = {
        "TMPDIR": str(job_dir / "tmp"),  # torchrun leaves torchelastic_* folders there
        # Each node's termination record (ftjob.contract), as a container's message file.
        "FTJOB_TERMINATION_LOG": str(job_dir / "logs" / f"node-{rank}.termination"),
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


def _wait(nodes: list[Node]) -> Node | None:
    """Wait until all nodes succeed (None) or one fails (that node)."""
    while True:
        codes = [n.proc.poll() for n in nodes]
        for node, code in zip(nodes, codes, strict=True):
            if code not in (None, 0):
                return node
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)


def _stop(nodes: list[Node]) -> None:
    for node in nodes:
        node.stop(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for node in nodes:
        try:
            node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.stop(signal.SIGKILL)
            node.proc.wait()
    for node in nodes:
        node.reader.join(timeout=5)


def _export_path(job_dir: Path) -> str:
    try:
        return json.loads((job_dir / "progress.json").read_text())["exportPath"]
    except (OSError, ValueError, KeyError):
        return str(job_dir)
