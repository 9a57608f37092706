"""Environments beside the test venv that some tests need, built on first use and cached
outside the checkout, so that the README's test command (``python -m pytest``) is all CI runs.

- The GPU image's torch (2.11) on CPU: ``scripts/torch-floor.sh`` builds a venv once per machine
  and pins (~3 GB the first time, ~0.5 s after) and prints its path.

A build that fails is a test failure under CI (CI=true) and a skip elsewhere, with the reason.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOOR = "2.11."  # the GPU image's torch (docs/gpu.md)
# A cold build downloads ~3 GB and installs it: a hang, not slowness, past an hour.
BUILD_TIMEOUT = 3600


@functools.cache
def _torch_floor() -> tuple[Path | None, str]:
    done = subprocess.run(["bash", "scripts/torch-floor.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT)  # fmt: skip
    if done.returncode != 0:
        return None, "scripts/torch-floor.sh failed:\n" + done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1]), ""


def unavailable(why: str) -> NoReturn:
    """An environment a test needs cannot be had here: a failure under CI, which must never
    hide a missing component behind a skip, and a skip, with the reason, elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs it: {why}")
    pytest.skip(why)


def torch_floor_python() -> Path:
    """The torch 2.11 venv's python, built if this machine has none yet."""
    venv, why = _torch_floor()
    if venv is None:
        unavailable(f"the GPU image's torch cannot be set up: {why}")
    python = venv / "bin" / "python"
    version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert version.startswith(FLOOR), f"{venv} has torch {version}, not {FLOOR}x"
    return python
