"""Two pytest-xdist workers (pyproject's ``-n 2``): which test runs where.

A test that needs a build (tests/prebuilds.py: the control plane, the images, SeaweedFS, the
torch 2.11 venv) belongs to one group, "builds", which one worker runs from the start, test
after test, as a session without workers did: one plane, one node network, each build made
once, started by that worker at its first test. Any other test belongs to its module's group,
so that a module's shared runs (its module-scoped fixtures) are made once; the other worker
takes those groups one by one, then whichever worker is free takes the rest.

Only the workers see a test's fixtures, and only the controller schedules: each worker writes
the group of each test it collected to a file the controller named (``workerinput``), and
the controller's scheduler reads it. (xdist's own ``xdist_group`` mark renames the test's
id, which pytest 9 no longer lets it do.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

KEY = "ftjob_groups"  # the workerinput entry: the folder where the workers write the groups
BUILDS = "builds"


def group(needs_a_build: bool, nodeid: str) -> str:
    return BUILDS if needs_a_build else nodeid.split("::")[0]


def folder(config) -> Path:
    """The controller's folder for this session's groups, made on first use."""
    if not hasattr(config, "_ftjob_groups"):
        config._ftjob_groups = Path(tempfile.mkdtemp(prefix="ftjob-groups-"))
    return config._ftjob_groups


def remove(config) -> None:
    if hasattr(config, "_ftjob_groups"):
        shutil.rmtree(config._ftjob_groups, ignore_errors=True)


def worker_id(config) -> str | None:
    """This worker's id (gw0, gw1, ...); None in the controller or a session without xdist."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput is not None else None


def write(config, groups: dict[str, str]) -> None:
    """A worker's collection, each test's id to its group, for the controller's scheduler."""
    target = Path(config.workerinput[KEY]) / f"{worker_id(config)}.json"
    part = target.with_suffix(".part")
    part.write_text(json.dumps(groups))
    os.replace(part, target)  # whole or absent: the scheduler may look at any moment after


class Scheduling(LoadScopeScheduling):
    """xdist's scope scheduling with the scopes the workers wrote: the "builds" group and
    one module each, in the order collected (``--no-loadscope-reorder``)."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self._folder = folder(config)
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            # Called once every worker has sent its collection, so each wrote its file.
            written = sorted(self._folder.glob("*.json"))
            self._groups = json.loads(written[0].read_text()) if written else {}
        return self._groups.get(nodeid) or group(False, nodeid)
