"""The session's real control plane (scripts/k8s.sh): built once (cached outside the
repository), brought up in a temporary folder, torn down at the end."""

from __future__ import annotations

import pytest
from plane import ROOT, Plane, build

INSTALL = ROOT / "manifests" / "install.yaml"
CRD = "finetunejobs.ftjob.dev"
CRDS = (CRD, "finetuneprofiles.ftjob.dev")


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
    """manifests/install.yaml (the chart as the real Helm engine renders it, kept equal by
    scripts/manifests.py --check) applied server-side; the CRDs Established (both: a group's
    discovery changes again when its second kind is served)."""
    plane.kubectl("apply", "--server-side", "-f", str(INSTALL))
    crds = [f"crd/{name}" for name in CRDS]
    plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
    return plane
