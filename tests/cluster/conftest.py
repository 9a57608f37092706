"""The session's real control planes (scripts/k8s.sh): built once (cached outside the
repository), each brought up in a temporary folder when a test first asks, torn down at the end.

``plane``: the API server, controllers, scheduler, kwok's fake GPU nodes and Kueue (which acts
only on pods that name a queue, test_kueue.py's; every other module's pods pass its webhook).
``real_nodes``: a plane with two real nodes (kubelet + containerd) holding both images, shared
by every module that runs pods on real nodes (test_real_gang.py, then test_real_nodes.py, whose
last test takes it down and checks nothing is left): one plane up and one image import a run,
not one a module."""

from __future__ import annotations

import shutil

import envs
import pytest
from plane import Plane, build


@pytest.fixture(scope="session")
def plane(tmp_path_factory):
    build()
    p = Plane(tmp_path_factory.mktemp("k8s"), "--kueue").up()
    try:
        yield p
    finally:
        p.down()


@pytest.fixture(scope="session")
def installed(plane):
    """The chart installed on the session's plane, ready to admit jobs (Plane.install)."""
    return plane.install()


@pytest.fixture(scope="module", autouse=True)
def no_job_left_on_the_session_plane(request):
    """A module's jobs on the session's plane go with the module. A job left there is the
    next module's operator's to reconcile first: test_real_names' 1,024-node job, left
    applied, had test_real_operator's first gang wait 31 s for phase Running here (past its
    60 s once in CI) and its cleanup 66 s for the 1,024 pods to go; 1.5 s and 0.4 s without."""
    yield
    ours = [i for i in request.session.items if i.getparent(pytest.Module) is request.node]
    if any("installed" in item.fixturenames for item in ours):
        request.getfixturevalue("installed").delete_every_job()


@pytest.fixture(scope="session")
def real_nodes(images, tmp_path_factory):
    """A plane with two real nodes (no kwok nodes) whose containerds hold the trainer image (the
    operator's gangs) and the operator image (a shell and Python: enough for plain pods)."""
    build()
    for tool in ("containerd", "ctr"):
        if not shutil.which(tool):
            envs.unavailable(f"{tool} is not installed: bash scripts/podman-host.sh")
    p = Plane(tmp_path_factory.mktemp("real-nodes"), "--gpu-nodes", "0", "--nodes", "2",
              "--node-image", images.trainer, "--node-image", images.operator)  # fmt: skip
    p.up()
    try:
        yield p
    finally:
        p.down()
