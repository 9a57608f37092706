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

import prebuilds
import pytest

FLOOR = "2.11."  # the GPU image's torch (docs/gpu.md)


@functools.cache
def _torch_floor() -> tuple[Path | None, str]:
    code, out, err = prebuilds.TORCH_FLOOR.result()  # started at collection where needed
    if code != 0:
        return None, f"scripts/torch-floor.sh failed (exit {code}):\n" + err[-3000:]
    return Path(out.strip().splitlines()[-1]), ""


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
