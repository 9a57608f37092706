"""Builds that start early: the session's download-bound builds (the real images, the torch 2.11
venv) begin in the background as soon as collection shows a test that needs them.

Tests run in folder order, so tests/cluster comes first, and with it the control plane's build
from Go modules: minutes of compiling on a fresh machine, while these two mostly wait on
downloads. Started at collection, they overlap it instead of following it. A test that needs one
waits for it (``result``); a session that ends first stops them. Where nothing collected needs a
build, it never starts, and a test that asks for one outside a collected session runs it then.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Prebuild:
    name: str
    argv: list[str]
    fixture: str  # a test that uses this fixture needs the build
    timeout: int  # seconds from its start: past it, a hang, not slowness
    env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen | None = None
    _started: float = 0.0
    _out: Path | None = None

    def start(self) -> None:
        if self._proc is not None:
            return
        folder = Path(tempfile.mkdtemp(prefix=f"ftjob-{self.name}-"))
        self._out = folder / "stdout"
        self._started = time.monotonic()
        with open(self._out, "w") as out, open(folder / "stderr", "w") as err:
            # Its own process group, so that a session ending first stops all of it.
            self._proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=out, stderr=err,
                                          env={**os.environ, **self.env},
                                          start_new_session=True)  # fmt: skip

    def result(self) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once it has ended; started now if it was not."""
        self.start()
        left = self.timeout - (time.monotonic() - self._started)
        try:
            code = self._proc.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            self.stop()
            code = -1
        folder = self._out.parent
        return code, self._out.read_text(), (folder / "stderr").read_text()

    def seconds(self) -> float:
        return time.monotonic() - self._started

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait()


IMAGES = Prebuild(
    "images",
    ["bash", str(ROOT / "scripts" / "images.sh")],
    fixture="images",
    # A fresh machine makes the stand-in bases first (several minutes); later runs reuse them.
    timeout=1800,
    env={"PYTHON": sys.executable, "FTJOB_IMAGE_TAG": "test"},
)
TORCH_FLOOR = Prebuild(
    "torch-floor",
    ["bash", str(ROOT / "scripts" / "torch-floor.sh")],
    fixture="torch_floor",
    # A cold build downloads ~3 GB and installs it: a hang, not slowness, past an hour.
    timeout=3600,
)
ALL = (IMAGES, TORCH_FLOOR)
SKIP_IMAGES = "FTJOB_SKIP_IMAGE_TESTS"  # =1: the image tests are left out on purpose


def start_needed(fixtures_of_items: list[set[str]], skipped: set[str], builds=ALL) -> list[str]:
    """Start each build a collected test needs (by its fixtures), unless it is left out
    (``skipped``: its name); the names started."""
    started = []
    for build in builds:
        if build.name in skipped:
            continue
        if any(build.fixture in names for names in fixtures_of_items):
            build.start()
            started.append(build.name)
    return started


def left_out() -> set[str]:
    """Builds this machine or the caller leaves out: their fixtures say why when asked."""
    out = set()
    if os.environ.get(SKIP_IMAGES) == "1" or not shutil.which("podman"):
        out.add(IMAGES.name)
    return out


def stop_all() -> None:
    for build in ALL:
        build.stop()
