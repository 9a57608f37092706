"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import deadline
import envs
import prebuilds
import pytest
from built_images import images  # noqa: F401  (the session's image build, a fixture)
from trainer_outputs import Runs

# Test files that torchrun runs as its workers' script import the suite's shared modules
# (hangs, trainer_outputs) from tests/ as pytest does: every process the tests start finds them.
TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))

# A machine that sets PYTHONDONTWRITEBYTECODE (this project's CI machines do) makes every
# process the tests start compile ftjob's 25,000 lines again: ~2 s of CPU for each trainer
# process here (10.2-11.7 s user to import the trainer and its agent, 8.5-9.5 s from cached
# bytecode), and a suite starts hundreds. The first process writes the cache (gitignored,
# left out of the images' build context); every later one reads it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# A runner that starts the suite with Ctrl-C ignored (a background job of a non-interactive
# shell, nohup) passes that on to every process the tests start: the tests that press Ctrl-C
# would meet an ftjob run that cannot hear it, as no user at a terminal does. A caught signal
# is reset at exec, so every process started from here gets Ctrl-C's default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory):
    """The real trainer's termination records and logs (tests/trainer_outputs.py)."""
    runs = Runs(tmp_path_factory.mktemp("trainer-runs"))
    yield runs
    runs.close()


def _needs(item) -> tuple[set[str], Path]:
    return set(getattr(item, "fixturenames", ())), Path(item.path)


def pytest_collection_modifyitems(items):
    """Tests that wait for no build run first (tests/prebuilds.py), the slow tier last
    (tests/deadline.py)."""
    order = prebuilds.builds_last([_needs(item) for item in items])
    items[:] = sorted(
        (items[k] for k in order), key=lambda item: bool(item.get_closest_marker("slow"))
    )


def pytest_collection_finish(session):
    """The slow builds the collected tests need start now, side by side (tests/prebuilds.py)."""
    prebuilds.start_needed([_needs(item) for item in session.items], prebuilds.left_out())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that needs a build still running waits for it here, outside pytest-timeout's
    limit (its wrapper is inside this one): a hang guard sized for the test is not a build's.
    Then that limit is kept short of the run's deadline (tests/deadline.py)."""
    prebuilds.wait_needed(*_needs(item))
    deadline.shorten(item)
    yield


def pytest_runtest_setup(item):
    deadline.refuse(item)


def pytest_sessionfinish(session):
    prebuilds.stop_all()


@pytest.fixture(scope="session")
def torch_floor() -> Path:
    """The python of a venv with the GPU image's torch (2.11), built if the machine has none."""
    return envs.torch_floor_python()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The session's S3-compatible server (scripts/s3.sh: SeaweedFS on loopback), built once
    (cached outside the repository), started in a temporary folder, stopped at the end."""
    from s3server import S3Server, build

    build()
    server = S3Server(tmp_path_factory.mktemp("s3")).up()
    try:
        yield server
    finally:
        server.down()
