"""Fixtures the trainer's end-to-end modules share."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_dpo_run import beside_the_examples, tiny_dpo
from test_qlora import job as qlora_job
from test_qlora import make_base
from test_qlora import run as run_to_the_end
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


# Session-wide, these: test_torch_floor (the slow tier, last) compares torch 2.11's runs of the
# same jobs with them, and test_qlora's and test_dpo_run's own checks read them first.
@pytest.fixture(scope="session")
def qlora_runs(tmp_path_factory) -> Path:
    """A folder holding test_qlora's base (a bf16 Llama whose weights split into whole NF4
    blocks over 2 ranks), beside which its QLoRA and LoRA runs train."""
    folder = tmp_path_factory.mktemp("qlora")
    make_base(folder / "base")
    return folder


@pytest.fixture(scope="session")
def qlora(qlora_runs) -> tuple[Path, str]:
    out = run_to_the_end(qlora_job("qlora", qlora_runs / "base", "qlora"), qlora_runs / "qlora")
    return qlora_runs / "qlora", out


@pytest.fixture(scope="session")
def lora(qlora_runs) -> Path:
    run_to_the_end(qlora_job("lora", qlora_runs / "base", "lora"), qlora_runs / "lora")
    return qlora_runs / "lora"


@pytest.fixture(scope="session")
def dpo(tmp_path_factory) -> tuple[Path, str, dict]:
    """test_dpo_run's `ftjob run` of examples/tiny-dpo.yaml (every step logged)."""
    doc = tiny_dpo()
    workdir = beside_the_examples(tmp_path_factory.mktemp("dpo")) / "tiny-dpo"
    code, out = run(doc, workdir)
    assert code == 0, out
    return workdir, out, doc
