"""kopf's peering pause stops the operator's work queue (operator/pause.py, handlers._work):
the pause toggle is found in a real kopf operator's tasks, a paused pool reconciles nothing,
a paused replica forgets what it knew, and a resumed one reconciles again. The kopf it reads is
the one installed, pinned and installed in the images, and the operator starts on no other."""

from __future__ import annotations

import asyncio
import logging
import re
from importlib import metadata

import hangs
import kopf
import pytest
import tomllib
from dependencies import ROOT, pins
from kopf._cogs.aiokits.aiotoggles import ToggleSet

from ftjob.operator import handlers, pause, workqueue


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, hangs.FLOOR))


def test_kopfs_pause_toggle_is_found_in_a_running_kopf_operator():
    async def go():
        # kopf's tasks start; with no cluster to log in to they fail, which is beside the point.
        logging.getLogger("kopf").setLevel(logging.CRITICAL)
        tasks = await kopf.spawn_tasks(clusterwide=True, standalone=True)
        try:
            await asyncio.sleep(0)
            found = pause.find()
            running = found.is_on()
            toggle = await found.make_toggle(True, name="a peer of higher priority")
            paused = found.is_on()
            await toggle.turn_to(False)
            return running, paused, found.is_on()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    assert run(go()) == (False, True, False)

    async def alone():
        return pause.find()

    assert run(alone()) is None  # no kopf operator in this (new) event loop


def test_a_paused_pool_reconciles_nothing_forgets_its_jobs_and_acts_again_once_resumed(
    monkeypatch,
):
    reconciled = []

    async def reconcile(watch, views):
        reconciled.append(watch.name)
        return 30.0

    monkeypatch.setattr(handlers, "_reconcile", reconcile)

    async def go():
        paused = ToggleSet(any)
        peer = await paused.make_toggle(False, name="a peer of higher priority")
        queue = workqueue.WorkQueue()
        monkeypatch.setattr(handlers, "QUEUE", queue)
        monkeypatch.setattr(handlers, "JOBS", {})
        meta = {"uid": "u1", "namespace": "ns", "name": "a", "generation": 1}
        tasks = [asyncio.create_task(handlers._forget_when_paused(paused))]
        tasks += [asyncio.create_task(handlers._work(queue, None, paused)) for _ in range(2)]
        try:
            await handlers.job_changed(type=None, body={"metadata": meta}, job_pods={})
            await asyncio.sleep(0.1)
            first = list(reconciled)
            await peer.turn_to(True)  # a replica of higher priority appeared
            await asyncio.sleep(0.1)
            forgotten = not handlers.JOBS and not len(queue)
            await handlers.job_changed(
                type=None, body={"metadata": {**meta, "name": "b"}}, job_pods={}
            )
            await asyncio.sleep(0.2)
            while_paused = list(reconciled)
            await peer.turn_to(False)
            await asyncio.sleep(0.1)
            return first, forgotten, while_paused, list(reconciled)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    first, forgotten, while_paused, after = run(go())
    assert first == ["a"]
    assert forgotten
    assert while_paused == ["a"]  # "b" is queued (the watch re-lists) but not acted on
    assert after == ["a", "b"]


def test_kopf_is_pinned_to_the_version_whose_internals_pause_reads():
    """pause.find() reads kopf's private tasks: the kopf installed, the operator extra's pin
    and constraints.txt's (what the images install: tests/unit/test_dockerfile.py) are all
    pause.KOPF_VERSION. A kopf upgrade changes the four together, after this module's first
    test passes on it."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [kopf_req] = [r for r in extra["optional-dependencies"]["operator"] if r.startswith("kopf")]
    assert kopf_req == f"kopf=={pause.KOPF_VERSION}"
    assert pins()["kopf"] == pause.KOPF_VERSION
    assert metadata.version("kopf") == pause.KOPF_VERSION
    assert pause.version_error() is None


@pytest.mark.parametrize("other", ["1.45.1", "1.46.0", "2.0.0"])
def test_the_operator_refuses_to_start_on_another_kopf(monkeypatch, other):
    from ftjob.operator.__main__ import main

    monkeypatch.setenv("FTJOB_METRICS_PORT", "0")  # run() sets it where unset
    monkeypatch.setattr(metadata, "version", lambda name: other)
    with pytest.raises(SystemExit) as ended:
        main(["-A", "--standalone"])
    said = str(ended.value.code)
    assert said.startswith("ftjob operator: cannot start: kopf " + other + " is installed")
    assert re.search(rf"kopf=={re.escape(pause.KOPF_VERSION)}\b", said), said
