"""Fixtures the trainer's end-to-end modules share."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recovery import recovery_job
from test_trainer_run import run


@pytest.fixture(scope="session")
def recovery_reference(tmp_path_factory) -> Path:
    """An uninterrupted run of test_recovery.py's 2-node job: what every interrupted run of
    that job (test_recovery's restarts, test_preemption's signals) must end with, loss for
    loss and weight for weight. One run for the session: the slow tier, last, reuses it."""
    workdir = tmp_path_factory.mktemp("recovery") / "reference"
    code, out = run(recovery_job("reference"), workdir)
    assert code == 0, out
    return workdir
