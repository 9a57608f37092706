"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest
from trainer_outputs import Runs


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory):
    """The real trainer's termination records and logs (tests/trainer_outputs.py)."""
    runs = Runs(tmp_path_factory.mktemp("trainer-runs"))
    yield runs
    runs.close()
