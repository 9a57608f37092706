"""Fixtures: a test cluster (API emulator + kubelet) and `ftjob operator` as a real process.

The cluster and operator are shared by the tests of a module (each test uses its own job
names); tests that kill the operator or inject faults start their own.
"""

from __future__ import annotations

import pytest
from cluster import Cluster
from support import Operator


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    op = Operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log").start()
    yield op
    op.stop()
