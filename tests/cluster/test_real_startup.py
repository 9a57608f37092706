"""A start-up that cannot complete ends ``ftjob operator`` at once, non-zero, with one line
naming the cause and the fix (issue 55): kopf would otherwise retry the failing start-up
every 60 s and reconcile nothing, saying why only in its log. On the real control plane, with
the chart's ServiceAccount token (or a ServiceAccount the chart never bound)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import hangs
import pytest
from plane import Plane, token_kubeconfig

# An operator that fails its start-up and does not end retries it every 60 s for ever: the
# wait below ends that (a failure), and is otherwise a hang guard of a start that takes ~5 s.
PROMPTLY = hangs.after(30)
pytestmark = pytest.mark.timeout(PROMPTLY + 60)


def start_and_end(kubeconfig: Path, *flags: str) -> subprocess.CompletedProcess:
    """``ftjob operator -A`` run until it ends by itself (a timeout here fails the test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        health = s.getsockname()[1]
    argv = [sys.executable, "-m", "ftjob", "operator", "-A", "--standalone"]
    argv += ["--liveness", f"http://127.0.0.1:{health}/healthz", *flags]
    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    try:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=PROMPTLY)
    except subprocess.TimeoutExpired as e:
        log = (e.stderr or b"").decode()[-2000:]
        pytest.fail(f"the operator still runs after {PROMPTLY} s (kopf retrying?):\n{log}")


def last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


def test_a_taken_metrics_port_ends_the_operator_saying_so(installed: Plane, tmp_path):
    kubeconfig = token_kubeconfig(installed, "ftjob-system", "ftjob", tmp_path / "sa.kubeconfig")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = start_and_end(kubeconfig, "--metrics-port", str(port))
    assert done.returncode == 1, done.stderr[-2000:]
    line = last_line(done)
    assert line.startswith("ftjob operator: cannot start: "), line
    assert f"the metrics port {port} cannot be served" in line and "--metrics-port" in line


def test_a_missing_permission_ends_the_operator_naming_it(installed: Plane, tmp_path):
    """A ServiceAccount no role was bound to: the real authorizer refuses every rule."""
    installed.kubectl("create", "serviceaccount", "unbound", "-n", "ftjob-system")
    kubeconfig = token_kubeconfig(installed, "ftjob-system", "unbound", tmp_path / "kubeconfig")
    done = start_and_end(kubeconfig, "--metrics-port", "0")
    assert done.returncode == 1, done.stderr[-2000:]
    line = last_line(done)
    assert "may not list finetunejobs.ftjob.dev (cluster-wide)" in line, line
    assert "ClusterRole" in line, line


def test_an_unreachable_api_server_ends_the_operator_naming_it(installed: Plane, tmp_path):
    """The plane's own kubeconfig pointed at a port where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    config = json.loads(installed.kubectl("config", "view", "--raw", "-o", "json").stdout)
    server = config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{closed}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps(config))
    done = start_and_end(kubeconfig, "--metrics-port", "0")
    assert done.returncode == 1, done.stderr[-2000:]
    line = last_line(done)
    assert f"no API server answers at {server}" in line and "kubeconfig" in line, line
