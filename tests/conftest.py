"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

import envs
import prebuilds
import pytest
from built_images import images  # noqa: F401  (the session's image build, a fixture)
from trainer_outputs import Runs

# Test files that torchrun runs as its workers' script import the suite's shared modules
# (hangs, trainer_outputs) from tests/ as pytest does: every process the tests start finds them.
TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory):
    """The real trainer's termination records and logs (tests/trainer_outputs.py)."""
    runs = Runs(tmp_path_factory.mktemp("trainer-runs"))
    yield runs
    runs.close()


def pytest_collection_finish(session):
    """The download-bound builds the collected tests need start now, beside the control
    plane's build (tests/prebuilds.py)."""
    fixtures = [set(getattr(item, "fixturenames", ())) for item in session.items]
    prebuilds.start_needed(fixtures, prebuilds.left_out())


def pytest_sessionfinish(session):
    prebuilds.stop_all()


@pytest.fixture(scope="session")
def torch_floor() -> Path:
    """The python of a venv with the GPU image's torch (2.11), built if the machine has none."""
    return envs.torch_floor_python()
