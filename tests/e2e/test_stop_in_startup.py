"""A SIGTERM before the first step ends a node within seconds, as a stop, not a failure.

    python -m pytest tests/e2e/test_stop_in_startup.py -q

A pod's container runs the node agent as PID 1 of its own PID namespace, where the kernel
drops a signal whose action is the default: so does this test (``unshare --pid``), and it
signals the agent from outside the namespace, as the kubelet's runtime does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import hangs
import pytest
import yaml
from test_startup import SLOW_LOAD
from test_trainer_run import job
from trainer_outputs import wait_for_phase

from ftjob.api import contract
from ftjob.api.jobspec import parse_resource
from ftjob.job import launch

pytestmark = pytest.mark.timeout(240)

# not a hang guard: the product's promised bound under test ("within seconds"; grace is 60)
PROMPT = 5.0

# The node's first import of torch, held (a cold node's page cache makes it seconds), after
# a mark that says it began.
SLOW_TORCH = """
import os, sys, time
class SlowTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            open(os.environ["SLOW_TORCH_MARK"], "w").close()
            time.sleep(float(os.environ["SLOW_TORCH_SECONDS"]))
        return None
sys.meta_path.insert(0, SlowTorch())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


needs_pid_namespace = pytest.mark.skipif(
    not _namespaces_work(), reason="unshare --user --pid is not allowed here"
)


def start_node(
    tmp_path: Path, nodes: int, env: dict | None = None, rank: int = 0, port: int | None = None
):
    """Node ``rank`` of a ``nodes``-node job (its rendezvous on node 0's ``port``), its agent
    PID 1 of a new PID namespace; returns the (unshare process, the agent's pid outside, the
    job folder, the termination record)."""
    doc = job("stop", resources={"nodes": nodes, "gpusPerNode": 0})
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    _, spec = parse_resource(doc)
    folder, record = tmp_path / "job", tmp_path / f"termination-log-{rank}"
    port = port or _free_port()
    node = launch.node_command(spec, "stop", rank, "127.0.0.1", "rdzv-stop", str(spec_file),
                               master_port=port, job_folder=str(folder))  # fmt: skip
    argv = [sys.executable, *node.argv[1:]]  # argv[0] is the image's python
    env = {**os.environ, **node.env, **(env or {}), "OMP_NUM_THREADS": "1",
           "FTJOB_PROGRESS_PORT": "0", "FTJOB_TERMINATION_LOG": str(record)}  # fmt: skip
    proc = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    return proc, _child(proc.pid), folder, record


def _child(pid: int) -> int:
    """unshare's one child: the agent, PID 1 inside."""
    deadline = time.monotonic() + hangs.FLOOR
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.02)
    raise AssertionError("unshare started no child")


def stopped_within(proc, agent: int) -> tuple[float, int, str]:
    """SIGTERM to the agent; (seconds until the node ended, exit code, output)."""
    sent = time.monotonic()
    os.kill(agent, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # still there: the SIGTERM was ignored
        os.kill(agent, signal.SIGKILL)  # SIGKILL reaches a namespace's PID 1 from outside
        out, _ = proc.communicate()
    took = time.monotonic() - sent
    print(f"the node ended {took:.2f} s after the SIGTERM (exit {proc.returncode})")
    return took, proc.returncode, out


def _site(tmp_path: Path, code: str, **env: str) -> dict:
    """The environment that runs ``code`` as the node's sitecustomize, with ``env``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **env}


@needs_pid_namespace
def test_a_sigterm_while_torch_is_imported_ends_the_node_at_once(tmp_path):
    """The node's first seconds: torch still importing, the agent not yet running."""
    mark = tmp_path / "importing-torch"
    env = _site(tmp_path, SLOW_TORCH, SLOW_TORCH_MARK=str(mark), SLOW_TORCH_SECONDS="120")
    proc, agent, _, record = start_node(tmp_path, nodes=1, env=env)
    hangs.poll(lambda: mark.exists() or proc.poll() is not None, hangs.FLOOR, "torch's import")
    assert proc.poll() is None, proc.communicate()[0]
    took, code, out = stopped_within(proc, agent)
    assert took < PROMPT, f"took {took:.1f} s\n{out}"
    assert code == contract.EXIT_PREEMPTED, out
    rec = json.loads(record.read_text())
    assert rec["outcome"] == "preempted" and "before the agent ran" in rec["message"], rec


@needs_pid_namespace
def test_a_sigterm_in_the_rendezvous_ends_the_node_at_once(tmp_path):
    # Node 1 never comes: node 0's agent waits in the rendezvous (its workers not started).
    proc, agent, _, record = start_node(tmp_path, nodes=2)
    time.sleep(8)  # imports done, waiting for the other node
    assert proc.poll() is None, proc.communicate()[0]
    took, code, out = stopped_within(proc, agent)
    assert took < PROMPT, f"took {took:.1f} s\n{out}"
    assert code == contract.EXIT_PREEMPTED, out
    rec = json.loads(record.read_text())
    assert rec["outcome"] == "preempted" and "outside the training loop" in rec["message"]


@needs_pid_namespace
def test_a_sigterm_while_loading_ends_the_node_at_once_saving_nothing(tmp_path):
    env = _site(tmp_path, SLOW_LOAD, SLOW_LOAD_SECONDS="120")
    proc, agent, folder, record = start_node(tmp_path, nodes=1, env=env)
    wait_for_phase(folder, ("loading",), proc)
    took, code, out = stopped_within(proc, agent)
    assert took < PROMPT, f"took {took:.1f} s\n{out}"
    assert code == contract.EXIT_PREEMPTED, out
    assert json.loads(record.read_text())["outcome"] == "preempted"
    assert not list(folder.glob("checkpoints/step-*"))  # nothing half-written


@needs_pid_namespace
def test_a_sigterm_while_the_rendezvous_host_is_gone_ends_the_node_at_once(tmp_path):
    """Node 0 hosts the rendezvous store. When its pod goes first (its IP gone, its packets
    unanswered: here, its agent stopped with SIGSTOP), node 1's agent is blocked in a store call
    that only the store's 60 s timeout ends, and a Python signal handler runs only between
    bytecodes: its SIGTERM must still end it within seconds."""
    port = _free_port()
    host, host_agent, _, _ = start_node(tmp_path, nodes=3, port=port)
    proc, agent, _, record = start_node(tmp_path, nodes=3, rank=1, port=port)
    try:
        time.sleep(8)  # both past their imports, waiting in the rendezvous for node 2
        assert proc.poll() is None and host.poll() is None, proc.communicate()[0]
        os.kill(host_agent, signal.SIGSTOP)
        time.sleep(3)  # node 1's next look at the rendezvous state waits on the stopped host
        took, code, out = stopped_within(proc, agent)
    finally:
        os.kill(host_agent, signal.SIGKILL)
        host.communicate()
    assert took < PROMPT, f"took {took:.1f} s\n{out}"
    assert code == contract.EXIT_PREEMPTED, out
    rec = json.loads(record.read_text())
    assert rec["outcome"] == "preempted" and "outside the training loop" in rec["message"]
