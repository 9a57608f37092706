"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

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
