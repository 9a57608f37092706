"""The real images, built once per session by scripts/images.sh (which keeps its stand-in
bases between runs, so only the Dockerfile's own steps run again): the ``images`` fixture,
for the image tests (tests/images) and the real nodes' cluster tests (tests/cluster), which
share one build. tests/conftest.py makes it every folder's fixture.

These tests need podman (root, as in CI: `bash scripts/podman-host.sh`, which the README's test
command runs). Without podman they fail, naming the fix: a missing install must not pass as a
skip. To leave them out on purpose, set FTJOB_SKIP_IMAGE_TESTS=1.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import prebuilds
import pytest

ROOT = Path(__file__).resolve().parents[1]

SKIP = prebuilds.SKIP_IMAGES
TAG = prebuilds.IMAGES.env["FTJOB_IMAGE_TAG"]


@dataclass(frozen=True)
class Images:
    operator: str
    trainer: str
    build_log: str


@pytest.fixture(scope="session")
def images() -> Images:
    if os.environ.get(SKIP) == "1":
        pytest.skip(f"{SKIP}=1: the image tests are left out on purpose")
    if not shutil.which("podman"):
        pytest.fail(
            "podman is not installed, so ftjob's images cannot be built and run. Fix: run "
            f"`bash scripts/podman-host.sh` (the README's test command does), or set {SKIP}=1 "
            "to leave the image tests out on purpose"
        )
    # Started at collection beside the control plane's build (tests/prebuilds.py).
    code, text, err = prebuilds.IMAGES.result()
    text += err
    assert code == 0, f"scripts/images.sh failed:\n{text[-4000:]}"
    # The build's summary (which bases stood in, sizes) belongs in the test report.
    print(f"scripts/images.sh: done {prebuilds.IMAGES.seconds():.0f} s after it started")
    print("\n".join(x for x in text.splitlines() if x.startswith("images:")))
    return Images(f"localhost/ftjob-operator:{TAG}", f"localhost/ftjob-trainer:{TAG}", text)
