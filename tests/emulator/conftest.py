"""Fixtures: a test cluster (API emulator + kubelet) and `ftjob operator` as a real process.

The cluster and operator are shared by the tests of a module (each test uses its own job
names); tests that kill the operator or inject faults start their own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import Cluster
from support import Operator

KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    op = Operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log").start()
    yield op
    op.stop()


@pytest.fixture(scope="module")
def kubectl(cluster, tmp_path_factory):
    assert KUBECTL, "kubectl is not installed: pip install -e '.[test]'"
    cache = tmp_path_factory.mktemp("kubecache")
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), KUBECACHEDIR=str(cache))

    def run(*args: str, ok: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [KUBECTL, *args], capture_output=True, text=True, env=env, input=input
        )
        if ok:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    return run
