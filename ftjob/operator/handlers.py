"""Thin kopf handlers: read -> decide (pure) -> write status -> change children.

One daemon per FineTuneJob reconciles it whenever one of its pods changes (a kopf index
holds the pods; a pod event wakes the job's daemon), when a deadline the decision asked for
comes due, and at least every ``FTJOB_RESYNC_SECONDS``. Status is written *before* pods are
created or deleted, so a crash between the two repeats the same step instead of counting a
restart twice. Rank 0's progress is polled at most every ``FTJOB_PROGRESS_SECONDS``.
At most ``FTJOB_RECONCILE_CONCURRENCY`` reconciles run at once; the other daemons wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import urllib.request
from datetime import datetime, timezone

import kopf
from aiohttp import web

from ftjob import validation
from ftjob.operator import lifecycle, metrics, render, status
from ftjob.operator.kube import Kube, error_text
from ftjob.schema import SpecError
from ftjob.spec import GROUP, PLURAL, VERSION

RESYNC = float(os.environ.get("FTJOB_RESYNC_SECONDS", "30"))
PROGRESS_EVERY = float(os.environ.get("FTJOB_PROGRESS_SECONDS", "15"))
POD_SELECTOR = {"app.kubernetes.io/managed-by": render.MANAGER}
# A reconcile in flight holds a copy of its job, the parsed spec and the rendered children
# while its API calls queue for a thread of asyncio's default pool (min(32, CPUs + 4)
# threads). Unbounded, a burst of N new jobs holds N such sets at once, and the allocator
# keeps that high-water mark for the operator's life; bounded, a daemon waiting for a slot
# holds only itself. More slots than the pool has threads would only queue for them.
RECONCILE_CONCURRENCY = int(os.environ.get("FTJOB_RECONCILE_CONCURRENCY", "8"))

WAKE: dict[tuple[str, str], asyncio.Event] = {}
_kube: Kube | None = None
_slots: asyncio.Semaphore | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_) -> None:
    global _slots
    _slots = asyncio.Semaphore(RECONCILE_CONCURRENCY)  # in the operator's own event loop
    # kopf's own bookkeeping goes to annotations; .status belongs to the FineTuneJob API.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Only warnings from kopf itself become Events; lifecycle Events are posted explicitly.
    settings.posting.level = logging.WARNING
    # The daemons' finalizer (it lets kopf stop a job's daemon before the job is gone).
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.watching.server_timeout = 300  # re-list now and then: watches can drop silently
    port = int(os.environ.get("FTJOB_METRICS_PORT", "0") or 0)
    if port:
        app = web.Application()
        app.router.add_get("/metrics", _serve_metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", port).start()


@kopf.index("pods", labels=POD_SELECTOR)
def job_pods(namespace, labels, body, **_):
    """Pods by (namespace, job), kept current by kopf's watch. The index holds every managed
    pod for as long as it exists, so it keeps only what the decisions read (a few small
    dicts), not whole pods (10-20 KiB each as Python objects, more with managedFields)."""
    return {(namespace, labels.get(render.LABEL_JOB)): status.observed_pod(body)}


@kopf.on.event("pods", labels=POD_SELECTOR)
def pod_changed(namespace, labels, **_) -> None:
    event = WAKE.get((namespace, labels.get(render.LABEL_JOB)))
    if event is not None:
        event.set()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def job_daemon(name, namespace, body, stopped, job_pods: kopf.Index, logger, **_) -> None:
    key = (namespace, name)
    wake = WAKE.setdefault(key, asyncio.Event())
    state = {"written": None, "progress_at": 0.0, "snapshot": None}
    try:
        while not stopped:
            wake.clear()
            try:
                async with _slots:
                    delay = await _reconcile(name, namespace, body, job_pods, state, logger)
            except Exception as e:  # noqa: BLE001 - a failed reconcile is retried, not fatal
                metrics.RECONCILE_ERRORS.inc()
                logger.warning(f"reconcile failed, retrying: {error_text(e)}")
                delay = 1.0
            await _sleep(wake, max(min(delay or RESYNC, RESYNC), 0.05))
    finally:
        WAKE.pop(key, None)
        metrics.job_phase(key, None)


async def _sleep(wake: asyncio.Event, seconds: float) -> None:
    """Until a pod event or ``seconds`` pass. A timer that sets the same event, rather than
    ``asyncio.wait_for``: that would keep a task (and its coroutine) per sleeping job."""
    timer = asyncio.get_running_loop().call_later(seconds, wake.set)
    try:
        await wake.wait()
    finally:
        timer.cancel()


async def _reconcile(name, namespace, body, job_pods, state, logger) -> float | None:
    started = time.monotonic()
    doc = json.loads(json.dumps(body, default=dict))
    meta = doc["metadata"]
    old_status = doc.get("status") or {}
    written = state["written"]
    if written and written[0] == meta.get("resourceVersion"):
        # The job has not changed since before our last write: the watch has not brought that
        # write back yet, so what we wrote is the truth (deciding again from the older status
        # could count one failure twice).
        old_status = written[1]
    elif written:
        state["written"] = None  # the watch brought a newer job: that copy is never read again
    pods = [p for p in job_pods.get((namespace, name), []) if _owned_by(p, meta["uid"])]
    now = datetime.now(timezone.utc)
    try:
        _, spec = validation.parse_job(doc)  # the job and every child it would create
    except SpecError as e:
        decision = lifecycle.invalid(
            [str(x) for x in e.errors], meta.get("generation"), old_status, now
        )
        spec = None
    else:
        snapshot = await _progress(spec, pods, old_status, state)
        decision = lifecycle.decide(
            spec, name, meta.get("generation"), old_status, pods, now, snapshot
        )
        decision.status["jobFolder"] = render.job_dir(name, spec, meta["uid"])

    new = decision.status
    if new != old_status:
        changes = status.merge_patch(old_status, new)
        await asyncio.to_thread(kube().patch_status, namespace, name, changes)
        state["written"] = (meta.get("resourceVersion"), new)
    for kind, reason, message in decision.events:
        kopf.event(body, type=kind, reason=reason, message=message)
    if new.get("restarts", 0) > old_status.get("restarts", 0):
        metrics.GANG_RESTARTS.inc()
    metrics.job_phase((namespace, name), decision.phase)

    if decision.create and spec is not None:
        uid, attempt = meta["uid"], new["attempt"]
        children = [
            render.config_map(name, namespace, spec, uid),
            render.service(name, namespace, spec, uid),
        ]
        children += [render.pod(name, namespace, spec, r, attempt, uid) for r in decision.create]
        for child in children:
            await asyncio.to_thread(kube().create, child)
    for pod_name in decision.delete:
        await asyncio.to_thread(kube().delete_pod, namespace, pod_name)
    if decision.delete_job:
        logger.info("ttlSecondsAfterFinished passed: deleting the job")
        await asyncio.to_thread(kube().delete_job, namespace, name)
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    return decision.requeue_after


def _owned_by(pod: dict, uid: str) -> bool:
    refs = pod["metadata"].get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


async def _progress(spec, pods, old_status, state) -> dict | None:
    """Rank 0's latest snapshot, fetched at a bounded rate while the gang runs."""
    if time.monotonic() - state["progress_at"] < PROGRESS_EVERY:
        return state["snapshot"]
    rank0 = next((p for p in pods if p["metadata"]["labels"].get(render.LABEL_RANK) == "0"), None)
    ip = (rank0 or {}).get("status", {}).get("podIP")
    if not ip or rank0["status"].get("phase") != "Running":
        return state["snapshot"]
    state["progress_at"] = time.monotonic()
    url = f"http://{ip}:{spec.network.progress_port}/progress"
    # Not serving yet (still loading) or gone: keep the last snapshot.
    with contextlib.suppress(OSError, ValueError):
        state["snapshot"] = await asyncio.to_thread(_get_json, url)
    return state["snapshot"]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


async def _serve_metrics(request: web.Request) -> web.Response:
    return web.Response(body=metrics.text(), headers={"Content-Type": metrics.CONTENT_TYPE})
