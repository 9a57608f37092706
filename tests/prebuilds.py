"""Builds that start early: the session's slow builds (the control plane and Kueue from Go
modules, the real images, the torch 2.11 venv) begin in the background as soon as collection
shows a test that needs them, and a test that needs one waits for it before its own time limit
starts (tests/conftest.py).

On a fresh machine the control plane's build is minutes of compiling while the other two mostly
wait on downloads: started together they overlap instead of following one another, and no
test's hang guard (a few minutes) has to cover a build of a quarter of an hour. A session that
ends first stops them. Where nothing collected needs a build, it never starts, and a caller that
asks for one outside a collected session runs it then.
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

import deadline

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Prebuild:
    name: str
    argv: list[str]
    timeout: int  # seconds from its start: past it, a hang, not slowness
    fixture: str | None = None  # a test that uses this fixture needs the build,
    folder: str | None = None  # and so does every test under tests/<folder>
    env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen | None = None
    _started: float = 0.0
    _out: Path | None = None

    def needed_by(self, fixtures: set[str], path: Path) -> bool:
        if self.fixture in fixtures:
            return True
        return self.folder is not None and Path(path).is_relative_to(ROOT / "tests" / self.folder)

    def started(self) -> bool:
        return self._proc is not None

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
        left = self.timeout - self.seconds()
        # The run's deadline (tests/deadline.py) caps the wait: a build that cannot end before
        # it would otherwise hold the run past CI's hard limit, which prints no summary.
        end = deadline.at()
        by_deadline = end is not None and end - time.time() < left
        if by_deadline:
            left = end - time.time()
        note = ""
        try:
            code = self._proc.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            self.stop()
            code = -1
            note = f"\n{self.name}: stopped after {self.seconds():.0f} s, " + (
                f"unfinished at the run's deadline ({deadline.VARIABLE}): a machine with its "
                "cache warm skips this build; run the tests again to finish it"
                if by_deadline
                else f"past its limit of {self.timeout} s (a hang, not slowness)"
            )
        folder = self._out.parent
        return code, self._out.read_text(), (folder / "stderr").read_text() + note

    def seconds(self) -> float:
        return time.monotonic() - self._started

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait()


# kubectl's kustomize renders Kueue's manifests from its module: the test venv's kubectl.
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
PLANE = Prebuild(
    "plane",
    # --nodes: the kubelet and the pause image (podman builds it) for the real nodes.
    ["bash", str(ROOT / "scripts" / "k8s.sh"), "build", "--kueue"]
    + (["--nodes"] if shutil.which("podman") else []),
    # A fresh 2-core machine compiles the plane and Kueue in 15-35 minutes (busy).
    timeout=5400,
    folder="cluster",
    env={"KUBECTL": KUBECTL} if KUBECTL else {},
)
IMAGES = Prebuild(
    "images",
    ["bash", str(ROOT / "scripts" / "images.sh")],
    # A fresh machine makes the stand-in bases first (several minutes); later runs reuse them.
    timeout=3600,
    fixture="images",
    env={"PYTHON": sys.executable, "FTJOB_IMAGE_TAG": "test"},
)
TORCH_FLOOR = Prebuild(
    "torch-floor",
    ["bash", str(ROOT / "scripts" / "torch-floor.sh")],
    # A cold build downloads ~3 GB and installs it: a hang, not slowness, past an hour.
    timeout=3600,
    fixture="torch_floor",
)
S3 = Prebuild(
    "s3",
    ["bash", str(ROOT / "scripts" / "s3.sh"), "build"],
    # SeaweedFS's weed from its module: 368 s here from empty module and build caches.
    timeout=3600,
    fixture="s3_server",
)
ALL = (PLANE, IMAGES, TORCH_FLOOR, S3)
SKIP_IMAGES = "FTJOB_SKIP_IMAGE_TESTS"  # =1: the image tests are left out on purpose


def start_needed(items: list[tuple[set[str], Path]], skipped: set[str], builds=ALL) -> list[str]:
    """Start each build a collected test needs (``items``: each test's fixtures and file),
    unless it is left out (``skipped``: its name); the names started."""
    started = []
    for build in builds:
        if build.name in skipped:
            continue
        if any(build.needed_by(fixtures, path) for fixtures, path in items):
            build.start()
            started.append(build.name)
    return started


def builds_last(items: list[tuple[set[str], Path]], builds=ALL) -> list[int]:
    """The order to run ``items`` (each test's fixtures and file) in: those that need no build
    first, then those that do, each group in its own order. On a fresh machine the suite then
    runs beside the builds instead of waiting for them at its first test (tests/cluster sorts
    first by name); on a warm one the order changes nothing else."""
    needs = [any(b.needed_by(fixtures, path) for b in builds) for fixtures, path in items]
    return sorted(range(len(items)), key=lambda k: needs[k])  # sorted() is stable


def wait_needed(fixtures: set[str], path: Path, builds=ALL) -> None:
    """Before a test's own time limit starts: wait for the started builds it needs (their
    outcome is the fixtures' to report)."""
    for build in builds:
        if build.started() and build.needed_by(fixtures, path):
            build.result()


def left_out() -> set[str]:
    """Builds this machine or the caller leaves out: their fixtures say why when asked."""
    out = set()
    if os.environ.get(SKIP_IMAGES) == "1" or not shutil.which("podman"):
        out.add(IMAGES.name)
    if not shutil.which("go"):
        out |= {PLANE.name, S3.name}
    return out


def stop_all() -> None:
    for build in ALL:
        build.stop()
