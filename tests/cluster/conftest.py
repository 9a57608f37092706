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
