"""The session's real control plane (scripts/k8s.sh): built once (cached outside the
repository), brought up in a temporary folder, torn down at the end."""

from __future__ import annotations

import pytest
from plane import Plane, build


@pytest.fixture(scope="session")
def plane(tmp_path_factory):
    build()
    p = Plane(tmp_path_factory.mktemp("k8s")).up()
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
