"""The real images, built once per session by scripts/images.sh (which keeps its stand-in
bases between runs, so only the Dockerfile's own steps run again): the ``images`` fixture,
for the image tests (tests/images) and the podman nodes' cluster test (tests/cluster), which
share one build. tests/conftest.py makes it every folder's fixture.

These tests need podman (root, as in CI: `bash scripts/podman-host.sh`, which the README's test
command runs). Without podman they fail, naming the fix: a missing install must not pass as a
skip. To leave them out on purpose, set FTJOB_SKIP_IMAGE_TESTS=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SKIP = "FTJOB_SKIP_IMAGE_TESTS"
TAG = "test"
# A fresh machine makes the stand-in bases first (several minutes); later runs reuse them.
BUILD_TIMEOUT = 1800


@dataclass(frozen=True)
class Images:
    operator: str
    trainer: str
    build_log: str


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> Images:
    if os.environ.get(SKIP) == "1":
        pytest.skip(f"{SKIP}=1: the image tests are left out on purpose")
    if not shutil.which("podman"):
        pytest.fail(
            "podman is not installed, so ftjob's images cannot be built and run. Fix: run "
            f"`bash scripts/podman-host.sh` (the README's test command does), or set {SKIP}=1 "
            "to leave the image tests out on purpose"
        )
    log = tmp_path_factory.mktemp("images") / "build.log"
    env = dict(os.environ, PYTHON=sys.executable, FTJOB_IMAGE_TAG=TAG)
    start = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(
            ["bash", str(ROOT / "scripts" / "images.sh")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=BUILD_TIMEOUT,
        ).returncode
    text = log.read_text()
    assert code == 0, f"scripts/images.sh failed:\n{text[-4000:]}"
    # The build's summary (which bases stood in, sizes) belongs in the test report.
    print(f"scripts/images.sh took {time.monotonic() - start:.0f} s")
    print("\n".join(x for x in text.splitlines() if x.startswith("images:")))
    return Images(f"localhost/ftjob-operator:{TAG}", f"localhost/ftjob-trainer:{TAG}", text)
