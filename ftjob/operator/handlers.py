"""Thin kopf handlers: read -> decide (pure) -> write status -> change children.

No task per job: as controller-runtime does, events put a job's key in one work queue
(operator/workqueue.py: a key queued twice is reconciled once) and a fixed pool of
``FTJOB_RECONCILE_CONCURRENCY`` workers reconciles. A job is queued when it appears, when its
spec changes, when one of its pods changes (a kopf index holds the pods), when rank 0's
progress changed (one timer polls every running job's rank 0 every
``FTJOB_PROGRESS_SECONDS``), when a deadline the decision asked for comes due, and at least
every ``FTJOB_RESYNC_SECONDS`` (one timer heap for every job's next look). Status is written
*before* pods are created or deleted, so a crash between the two repeats the same step
instead of counting a restart twice. While kopf's peering pauses this replica the workers
take nothing, and what it knew is dropped: it acts again only on what kopf's re-listing
brings (operator/pause.py).

A key names a job; its :class:`Watch` serves one object, the UID last seen under that name:
every status write is a JSON patch that tests that UID, children carry it as owner, and once
the object is deleted, or replaced by a new one of the same name, its watch is dropped. A
child of the same name owned by another UID (left by a deleted job) is removed, never adopted.
A status write also carries the resourceVersion its decision read, and the API server refuses
it (409) if the job moved on since: the job is read again and decided again, never
overwritten, so a replica that peering is pausing loses no other replica's write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

import aiohttp
import kopf
from aiohttp import web

from ftjob.api.jobspec import GROUP, PLURAL, VERSION, FineTuneJobSpec
from ftjob.api.jobspec.tracking import TrackingSpec
from ftjob.api.profile import PLURAL as PROFILES
from ftjob.api.schema import SpecError
from ftjob.operator import (
    admit,
    cost,
    essence,
    lifecycle,
    metrics,
    pause,
    profiles,
    queueing,
    render,
    startup,
    status,
    watches,
    workqueue,
)
from ftjob.operator.kube import (
    ApiException,
    Conflict,
    Gone,
    Kube,
    Refused,
    Unreachable,
    error_text,
)
from ftjob.operator.watched import JobState, Seen, Watch, pack

POD_SELECTOR = {"app.kubernetes.io/managed-by": render.MANAGER}
# The operator's own log: one line per decision, naming the job (kopf's per-event lines are
# below the default level: ftjob.operator.__main__).
LOG = logging.getLogger("ftjob.operator")


@dataclass(frozen=True)
class Settings:
    """The operator's knobs, read from the environment once, at startup."""

    resync: float = 30.0  # FTJOB_RESYNC_SECONDS: reconcile at least this often
    progress_every: float = 15.0  # FTJOB_PROGRESS_SECONDS: poll rank 0's /progress
    # FTJOB_RECONCILE_CONCURRENCY: the work queue's workers. A reconcile in flight holds a
    # copy of its job, the parsed spec and the rendered children while its API calls queue
    # for a thread of asyncio's default pool (min(32, CPUs + 4) threads); a fixed pool bounds
    # those copies (the allocator keeps a burst's high-water mark for the operator's life),
    # and a job waiting for a worker is one key in the queue.
    concurrency: int = 8
    # FTJOB_API_THREADS: the synchronous API client's calls run in this many threads (and
    # as many pooled connections); asyncio's default, min(32, CPUs + 4), was 6 on 2 cores
    # and made a burst's creates wait for each other (bench/RESULTS.md, fleet).
    api_threads: int = 16
    metrics_port: int = 0  # FTJOB_METRICS_PORT: 0 serves no /metrics
    # FTJOB_API_RETRY_SECONDS: how long a failing API request of kopf's (its watches) is
    # retried before the operator ends (operator/watches.py): the API trouble it rides out.
    api_retry: float = 300.0
    # FTJOB_PEERING_LIFETIME, set from ftjob operator --peering-lifetime (which holds it to
    # at least 10 s): kopf's peering keep-alive, how long a standby waits for a replica that
    # vanished without saying goodbye.
    peering_lifetime: int = 60
    # FTJOB_POD_GROUPS (ftjob operator --pod-groups): "off" makes no PodGroups where the API
    # is served (a cluster whose gangs another scheduler places); "auto" asks discovery.
    pod_groups: bool = True
    # FTJOB_DEFAULT_IMAGE (ftjob operator --default-image): the trainer image of jobs that
    # name none in spec.image.
    default_image: str | None = None
    # FTJOB_DEFAULT_TRACKING (the chart's trainer.tracking): spec.tracking of jobs that name
    # no tracker.
    default_tracking: TrackingSpec | None = None

    @classmethod
    def from_env(cls, env=os.environ) -> Settings:
        return cls(
            resync=float(env.get("FTJOB_RESYNC_SECONDS", cls.resync)),
            progress_every=float(env.get("FTJOB_PROGRESS_SECONDS", cls.progress_every)),
            concurrency=int(env.get("FTJOB_RECONCILE_CONCURRENCY", cls.concurrency)),
            api_threads=int(env.get("FTJOB_API_THREADS", cls.api_threads)),
            metrics_port=int(env.get("FTJOB_METRICS_PORT") or 0),
            api_retry=float(env.get("FTJOB_API_RETRY_SECONDS", cls.api_retry)),
            peering_lifetime=int(env.get("FTJOB_PEERING_LIFETIME", cls.peering_lifetime)),
            pod_groups=env.get(render.POD_GROUPS_ENV, "auto") != "off",
            default_image=env.get(render.DEFAULT_IMAGE_ENV) or None,
            default_tracking=render.default_tracking(env.get(render.DEFAULT_TRACKING_ENV)),
        )


JOBS: dict[tuple[str, str], Watch] = {}  # by (namespace, name): the newest object's
SETTINGS = Settings()
QUEUE: workqueue.WorkQueue | None = None  # keys of JOBS, made in the operator's event loop
_kube: Kube | None = None
_pool: list = []  # (the indexes, kopf's pause) once started; then a second entry, the workers
_loops: set[asyncio.Task] = set()  # the operator's own loops (asyncio holds tasks weakly)
# Rank 0 fetches in flight at once (each waits at most 2 s for a pod that does not answer).
PROGRESS_FETCHES = 32


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube(connections=SETTINGS.api_threads)
    return _kube


@kopf.on.startup()
async def configure(
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    job_pods: kopf.Index,
    job_profiles: kopf.Index,
    namespace_labels: kopf.Index,
    **_,
) -> None:
    global QUEUE, SETTINGS
    SETTINGS = Settings.from_env()
    QUEUE = workqueue.WorkQueue()
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(SETTINGS.api_threads, thread_name_prefix="ftjob-api")
    )
    # kopf's own bookkeeping goes to annotations; .status belongs to the FineTuneJob API.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = essence.Unused()  # no handler reads a diff
    if readers := essence.readers(kopf.get_default_registry()):
        raise startup.StartupError(f"handlers that need kopf's diff base: {readers}")
    # Only warnings from kopf itself become Events; lifecycle Events are posted explicitly.
    settings.posting.level = logging.WARNING
    # No handler needs a finalizer now (children go with their owner, by the garbage
    # collector); kopf removes this one, which the per-job daemons of older versions set,
    # from every job it sees.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.watching.server_timeout = 300  # re-list now and then: watches can drop silently
    settings.networking.error_backoffs = watches.backoffs(SETTINGS.api_retry)
    # kopf's peering starts after the start-up handlers: its first keep-alive carries this.
    settings.peering.lifetime = SETTINGS.peering_lifetime
    await _check_access(memo.get("namespaces") or [])
    if SETTINGS.metrics_port:
        await _serve_metrics_on(SETTINGS.metrics_port)
    paused = pause.find()
    if paused is None:
        raise startup.StartupError(
            "kopf's pause toggle was not found, so peering could not stop the work queue: this "
            f"kopf is not {pause.KOPF_VERSION}, the one pinned in constraints.txt"
        )
    _pool.append((Indexes(job_pods, job_profiles, namespace_labels), paused))
    _loops.add(asyncio.create_task(_poll_progress(job_pods)))
    _loops.add(asyncio.create_task(_forget_when_paused(paused)))


def _start_workers() -> None:
    """The pool, started by the first watch event: its tasks inherit the event handler's
    context, where kopf keeps the queue that :func:`kopf.event` posts to (kopf sets it for
    its own per-object tasks only; a task made at start-up could post no Event)."""
    if len(_pool) == 1:
        views, paused = _pool[0]
        _pool.append(None)
        for _ in range(SETTINGS.concurrency):
            _loops.add(asyncio.create_task(_work(QUEUE, views, paused)))


async def _check_access(namespaces: list[str]) -> None:
    """The API server answers and lets us do what a job needs, or the operator ends saying
    which (:mod:`ftjob.operator.startup`): never a start-up that kopf retries every minute."""
    try:
        refused = await asyncio.to_thread(startup.missing, kube().may, namespaces)
    except Unreachable as e:
        raise startup.unreachable_error(e) from None
    except ApiException as e:  # 401: a token the server does not take
        raise startup.StartupError(
            f"the API server refused the operator's access review: {error_text(e)}"
        ) from None
    if refused:
        raise startup.permissions_error(refused, "the operator's credentials")


async def _serve_metrics_on(port: int) -> None:
    app = web.Application()
    app.router.add_get("/metrics", _serve_metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "0.0.0.0", port).start()
    except OSError as e:  # taken by another process (EADDRINUSE), or a privileged port
        await runner.cleanup()
        raise startup.port_error(port, e) from None


@kopf.index("pods", labels=POD_SELECTOR)
def job_pods(namespace, labels, body, **_):
    """Pods by (namespace, job), kept current by kopf's watch. The index holds every managed
    pod for as long as it exists, so it keeps only what the decisions read, as compact JSON
    that :func:`_own_pods` parses when a decision reads a job's pods: a fraction of the
    parsed view (a dict and a str per field) and of the whole pod (the fleet suite's figures,
    measured with tracemalloc: bench/RESULTS.md)."""
    view = status.observed_pod(body)
    return {(namespace, labels.get(render.LABEL_JOB)): json.dumps(view, separators=(",", ":"))}


@kopf.index(GROUP, VERSION, PROFILES)
def job_profiles(name, body, **_):
    """Every FineTuneProfile (cluster-scoped), kept current by kopf's watch: each reconcile
    reads the profiles from here, not from the API (a list per job per look, at a thousand
    jobs, was thousands of requests a resync). kopf fills every index before it calls any
    other handler (the job watch that queues the jobs), so no job is judged against profiles
    not yet seen."""
    return {name: json.loads(json.dumps(body, default=dict))}


@kopf.index("namespaces")
def namespace_labels(name, labels, **_):
    """Each namespace's labels (one may name its jobs' default profile), from kopf's watch."""
    return {name: dict(labels)}


@dataclass(frozen=True)
class Indexes:
    """kopf's watch-fed views that a decision reads: no API read per job per look."""

    pods: kopf.Index
    profiles: kopf.Index
    namespaces: kopf.Index

    def profile_list(self) -> list[dict]:
        return [doc for key in self.profiles for doc in self.profiles[key]]

    def labels_of(self, namespace: str) -> dict[str, str]:
        return next(iter(self.namespaces.get(namespace, [])), {})


# The event handlers are coroutines: kopf runs a plain function in a thread, and the queue
# (like any asyncio object) belongs to the event loop's thread.
@kopf.on.event("pods", labels=POD_SELECTOR)
async def pod_changed(namespace, labels, body, **_) -> None:
    _start_workers()
    watch = JOBS.get((namespace, labels.get(render.LABEL_JOB)))
    if watch is not None:
        pod = status.observed_pod(body)
        if status.record(pod) is not None:
            watch.state.ended[pod["metadata"]["name"]] = pod
        QUEUE.add(watch.key)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_changed(type, body, job_pods, **_) -> None:  # noqa: A002 - kopf's argument name
    """The job as the watch brings it. A new object, a spec change (suspend, resume) and
    deletion act now, not at the next resync; our own status writes come back here too, and
    only refresh what the next reconcile reads."""
    _start_workers()
    meta = body.get("metadata", {})
    key, uid = (meta.get("namespace"), meta.get("name")), meta.get("uid")
    watch = JOBS.get(key)
    if type == "DELETED" or meta.get("deletionTimestamp"):
        if watch is not None and watch.uid == uid:
            await _drop(watch, job_pods)
        return
    packed, generation = pack(body), meta.get("generation")
    if watch is None or watch.uid != uid:  # new, or a new object of a deleted one's name
        if watch is not None:  # its deletion was not seen (the watch was re-opened since)
            await _drop(watch, job_pods)
        JOBS[key] = Watch(uid, key[0], key[1], packed, generation)
        QUEUE.add(key)
        return
    watch.packed = packed
    if generation != watch.generation:
        watch.generation = generation
        QUEUE.add(key)


async def _drop(watch: Watch, job_pods) -> None:
    """The job is gone (or going): no more reconciles, and its pods are deleted now, each
    with its grace period (a SIGTERM is a checkpoint), so that its nodes are free in seconds.
    Kubernetes' garbage collector deletes them too, by owner reference, but after a delay of
    its own (on the test plane the pods were gone 10-70 s after the delete; 1.4 s with this);
    it still deletes the other children, and the pods of a job deleted while no operator
    runs."""
    namespace, name = watch.key
    del JOBS[watch.key]
    QUEUE.forget(watch.key)
    metrics.forget(namespace, name)
    metrics.job_phase(watch.uid, None)
    pods = [p["metadata"] for p in _own_pods(job_pods, namespace, name, watch.uid)]
    pods = [m for m in pods if not m.get("deletionTimestamp")]
    LOG.info(f"stopping: {namespace}/{name} (object {watch.uid}) was deleted; deleting its "
             f"{len(pods)} pods")  # fmt: skip
    delete = kube().delete
    deletes = [asyncio.to_thread(delete, "Pod", namespace, m["name"], m["uid"]) for m in pods]
    for m, e in zip(pods, await asyncio.gather(*deletes, return_exceptions=True), strict=True):
        if isinstance(e, Exception):
            LOG.warning(f"{namespace}/{m['name']}: not deleted ({error_text(e)}); the garbage "
                        "collector will delete it")  # fmt: skip


async def _work(queue: workqueue.WorkQueue, views: Indexes, paused) -> None:
    """One of the pool's workers: takes a key, reconciles its job, schedules its next look."""
    while True:
        key = await queue.get()
        try:
            # Held while paused, never dropped: the re-listing after the pause queues it
            # again, and that waits for this worker.
            await pause.resumed(paused)
            watch = JOBS.get(key)
            if watch is not None:
                delay = await _reconcile_logged(watch, views)
                if JOBS.get(key) is watch and delay is not None:
                    queue.add_after(key, delay)
        finally:
            queue.done(key)


async def _reconcile_logged(watch: Watch, views: Indexes) -> float | None:
    """One reconcile; returns when to look again: when the decision asked, or at the next
    resync, whichever comes first (None: never, the object is gone)."""
    resync = SETTINGS.resync
    try:
        return max(min(await _reconcile(watch, views) or resync, resync), 0.05)
    except Gone as e:
        # e names the job; the watch event that shows what became of it acts on it
        LOG.info(f"not acting: {e}")
        return None
    except Conflict as e:
        # Nothing more was written from the stale copy (no Event, no pod); what we wrote last
        # may be what the other writer replaced.
        LOG.info(f"not acting: {e}; deciding again from the job as the API server has it")
        watch.state.written, watch.state.reread = None, True
        return CONFLICT_RETRY_SECONDS
    except Exception as e:  # noqa: BLE001 - a failed reconcile is retried, not fatal
        metrics.RECONCILE_ERRORS.inc()
        LOG.warning(f"{watch.namespace}/{watch.name}: reconcile failed, retrying: {error_text(e)}")
        kopf.warn(watch.ref, reason="ReconcileFailed", message=error_text(e))
        return 1.0


async def _forget_when_paused(paused) -> None:
    """A paused replica drops what it knew: when it resumes, the watch re-lists every job and
    it acts on that, never on a copy from before another replica acted."""
    while True:
        await paused.wait_for(True)
        LOG.info(f"paused by peering: {len(JOBS)} jobs left to the acting replica")
        JOBS.clear()
        QUEUE.clear()
        await paused.wait_for(False)
        LOG.info("resumed: acting on the jobs the watch lists")


# A job whose status write met a newer one (kube.Conflict) is looked at again this soon.
CONFLICT_RETRY_SECONDS = 0.5


async def _reconcile(watch: Watch, views: Indexes) -> float | None:
    started = time.monotonic()
    name, namespace, ref, state = watch.name, watch.namespace, watch.ref, watch.state
    if state.reread:
        await _read_again(watch)
    seen = _observe(watch, views.pods)
    _take_profile(namespace, seen, views)
    queue = ((seen.doc.get("spec") or {}).get("scheduling") or {}).get("queue")
    wanted = queueing.workload_to_read(queue, name, seen.old_status, seen.pods)
    if wanted:
        seen.workload = (wanted, await asyncio.to_thread(kube().workload, namespace, wanted))
    spec, decision = _decide(name, seen, state)
    if _makes_a_gang(seen, decision) and await _pods_from_the_api(namespace, name, seen):
        spec, decision = _decide(name, seen, state)  # the index was behind: decide again
    requeue = await _apply(name, namespace, ref, seen, spec, decision, state)
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    return requeue


async def _read_again(watch: Watch) -> None:
    """The job as the API server has it now, as the watch's copy: after a Conflict the watch
    may not have brought the write that won yet, and a decision from the copy that lost would
    only conflict again (or, writing nothing, act on children from it). A watch event that
    comes later replaces it, as any does; an older one at worst costs one more Conflict."""
    fresh = await asyncio.to_thread(kube().job, watch.namespace, watch.name)
    if fresh is None or fresh["metadata"].get("uid") != watch.uid:
        raise Gone(f"{watch.namespace}/{watch.name} is no longer object {watch.uid}")
    watch.packed = pack(fresh)
    watch.state.reread = False


def _as_set(pods: list[dict]) -> set[str]:
    return {json.dumps(p, sort_keys=True) for p in pods}


def _makes_a_gang(seen: Seen, decision: lifecycle.Decision) -> bool:
    """Whether the decision creates pods or starts a new attempt: what must never come from
    a stale view of the pods (a second gang, an attempt counted for pods that exist)."""
    attempt = decision.status.get("attempt")
    return bool(decision.create) or attempt != seen.old_status.get("attempt", attempt)


async def _pods_from_the_api(namespace: str, name: str, seen: Seen) -> bool:
    """The job's pods read from the API server into ``seen``; True when the index's differed.
    kopf's pod index can be behind the API: a replica that resumes after a peering pause (a
    hand-over) decides before its pod watch has listed again, and would see a running gang
    as gone (issue 55: 9 of 50 gangs replaced, a restart spent on each)."""
    listed = await asyncio.to_thread(kube().pods, namespace, name)
    pods = _owned([status.observed_pod(p) for p in listed], seen.meta["uid"])
    if _as_set(pods) == _as_set(seen.pods):
        return False
    seen.pods = pods
    return True


def _observe(watch: Watch, job_pods) -> Seen:
    """The job as it is now, and the status to decide from."""
    doc = watch.doc()  # decisions change their copy, not the watch's
    meta, state = doc["metadata"], watch.state
    old_status = doc.get("status") or {}
    written = state.written
    if written and meta.get("resourceVersion") in written[0]:
        # The watch's copy is one our writes went over: it has not brought our last write
        # back yet, so what we wrote is the truth (deciding again from the older status could
        # count one failure twice, and its write would be refused as stale).
        old_status = written[1]
    elif written:
        state.written = None  # the watch brought a newer job: that copy is never read again
    pods = _own_pods(job_pods, watch.namespace, watch.name, watch.uid)
    return Seen(doc, old_status, pods, datetime.now(timezone.utc))


def _take_profile(namespace: str, seen: Seen, views: Indexes) -> None:
    """The job's FineTuneProfile applied to ``seen.doc`` (operator/profiles.py decides), from
    the watched profiles and labels as they are now: an edit reaches the next gang."""
    labels, found = views.labels_of(namespace), views.profile_list()
    seen.taken = profiles.take(seen.doc, labels, found, seen.old_status, SETTINGS.default_image)
    seen.doc = seen.taken.doc


def _decide(name, seen: Seen, state: JobState) -> tuple[FineTuneJobSpec | None, lifecycle.Decision]:
    """What should be (lifecycle.decide, pure), for a valid job; Failed for an invalid one."""
    meta, old_status, taken = seen.meta, seen.old_status, seen.taken
    if taken and taken.refused:  # over a limit of its profile, or no such profile
        gen = meta.get("generation")
        return None, lifecycle.invalid(taken.refused, gen, old_status, seen.now, taken.reason)
    admitted = admit.digest(seen.doc)
    try:
        # The job and every child it would create; the children once per content of the job.
        _, spec = admit.parse_job(seen.doc, children=admitted != state.admitted)
        spec = render.with_tracking(spec, SETTINGS.default_tracking)
        state.admitted = admitted
    except SpecError as e:
        decision = lifecycle.invalid(
            [str(x) for x in e.errors], meta.get("generation"), old_status, seen.now
        )
        return None, decision
    state.port = spec.network.progress_port
    snapshot = lifecycle.gang_snapshot(state.snapshot, old_status)
    spent = state.cost = _count_cost(spec, seen, snapshot, state.cost)
    decision = lifecycle.decide(
        spec,
        name,
        meta.get("generation"),
        old_status | ({"cost": spent} if spent else {}),  # the budget is judged on it
        seen.pods,
        seen.now,
        snapshot,
        seen.workload,
        # What the pods _create_gang makes are made of: an edit is compared with the gang's.
        render.template(spec, SETTINGS.default_image),
        _ended(state, old_status.get("attempt", 0)),
    )
    if _new_gang(decision, old_status) and taken and taken.over:
        # A limit lowered (or the namespace relabelled) since the last gang: the running gang
        # was left alone; the next one is not made.
        gen = meta.get("generation")
        return None, lifecycle.invalid(taken.over, gen, old_status, seen.now, taken.reason)
    decision.status["jobFolder"] = render.job_dir(name, spec, meta["uid"])
    if spent:
        decision.status["cost"] = cost.to_write(old_status, decision.status, spec.resources)
    if decision.create:
        # Recorded with the pods it is about to create (status is written first): the
        # image they run, wherever it came from (spec.image or the operator's default).
        decision.status["image"] = render.trainer_image(spec, SETTINGS.default_image)
        if taken and taken.record:  # ... and the profile generation they were made with
            decision.status["profile"] = taken.record | {"attempt": decision.status["attempt"]}
    return spec, decision


def _new_gang(decision: lifecycle.Decision, old_status: dict) -> bool:
    """Whether ``decision`` makes a new gang (not a pod of the one status.profile records)."""
    made = (old_status.get("profile") or {}).get("attempt")
    return bool(decision.create) and decision.status.get("attempt") != made


def _ended(state: JobState, attempt: int) -> list[dict]:
    """The current gang's ended pods remembered (JobState.ended); older gangs' are dropped."""
    state.ended = {k: p for k, p in state.ended.items() if status.attempt_of(p) >= attempt}
    return list(state.ended.values())


def _count_cost(spec, seen: Seen, snapshot: dict | None, counted: dict | None) -> dict | None:
    """status.cost now, from the pods' running times (operator/cost.py) at the profile's price,
    over what was written or, if more, what this daemon counted last (not always written)."""
    taken = seen.taken or profiles.Taken(seen.doc)
    r = spec.resources
    written = seen.old_status.get("cost")
    return cost.update(
        counted if cost.node_seconds(counted) > cost.node_seconds(written) else written,
        seen.pods,
        r.gpus_per_node,
        seen.now,
        taken.price,
        taken.currency,
        (snapshot or {}).get("etaSeconds"),
        r.nodes * r.gpus_per_node,
    )


async def _apply(name, namespace, ref, seen: Seen, spec, decision, state: JobState):
    """Make it so: the status first, then events and metrics, the pods to create and those
    to delete. Returns when to look again (None: at the next resync)."""
    old_status, uid = seen.old_status, seen.meta["uid"]
    new = decision.status
    if new != old_status:  # a Conflict here ends the pass: nothing acts on a stale decision
        await _write_status(namespace, name, seen, state, new)
    state.attempt = new.get("attempt")
    for kind, reason, message in decision.events:
        _say(ref, namespace, name, kind, reason, message)
    metrics.observed(namespace, name, old_status, new)
    metrics.job_phase(uid, decision.phase)

    requeue = decision.requeue_after
    if decision.create and spec is not None:
        requeue = await _create_gang(name, namespace, ref, seen, spec, decision, state) or requeue
    for pod_name in decision.delete:
        await asyncio.to_thread(kube().delete, "Pod", namespace, pod_name)
    if decision.delete_job:
        LOG.info(f"{namespace}/{name}: ttlSecondsAfterFinished passed: deleting the job")
        await asyncio.to_thread(kube().delete_job, namespace, name, uid)
    return requeue


async def _create_gang(name, namespace, ref, seen: Seen, spec, decision, state: JobState):
    """The attempt's ConfigMap, Service and pods. Returns when to look again: soon when a dead
    job's child was in the way, later when the API server refused a child (recorded)."""
    uid, new = seen.meta["uid"], decision.status
    if await asyncio.to_thread(kube().job_uid, namespace, name) != uid:
        raise Gone(f"{namespace}/{name} is no longer object {uid}: nothing is created")
    attempt = new["attempt"]
    image, avoid = SETTINGS.default_image, lifecycle.bad_nodes(new)
    grouped = await _gangs_served()
    # Two rounds of creates at once, not one create after another: a burst of 16-node gangs
    # would otherwise wait for a round trip per pod. The ConfigMap, Service and PodGroup go
    # first (the pods mount the one, resolve the other, and name the third).
    first = [make(name, namespace, spec, uid) for make in (render.config_map, render.service)]
    first += [render.pod_group(name, namespace, spec, attempt, uid)] if grouped else []
    rounds = [
        first,
        render.pods(name, namespace, spec, attempt, uid, image, decision.create, avoid, grouped),
    ]
    requeue = None
    try:
        for children in rounds:
            if not all(await asyncio.gather(*(_create(c, uid) for c in children))):
                requeue = 0.5  # a dead job's child was in the way: create again once gone
        if grouped and attempt:  # the gang before's group (its pods gone or going): one a job
            old = render.gang_name(name, attempt - 1)
            await asyncio.to_thread(kube().delete, "PodGroup", namespace, old)
    except Refused as e:
        await _record_refusal(ref, namespace, name, seen, state, str(e))
        requeue = REFUSED_RETRY_SECONDS
    return requeue


# A refused child is tried again this often: the namespace's label or quota may change.
REFUSED_RETRY_SECONDS = 10.0
# Whether the API server serves Kubernetes 1.37's PodGroup API is asked again at most this
# often (discovery): a cluster that turns it on, or off, is followed within a minute.
GANG_API_SECONDS = 60.0
_gang_api: list[tuple[float, bool]] = []  # (when asked, served)


async def _gangs_served() -> bool:
    """Whether gangs are PodGroups, which the scheduler binds whole (KEP-4671): where the API
    is served and --pod-groups is not off. Elsewhere the pods are created on their own, as
    before 1.37 (lifecycle gives back a gang partly placed)."""
    now = time.monotonic()
    if not _gang_api or now - _gang_api[0][0] > GANG_API_SECONDS:
        served = SETTINGS.pod_groups and await asyncio.to_thread(kube().serves_pod_groups)
        if not _gang_api or _gang_api[0][1] != served:
            how = "placed whole by the scheduler" if served else "pods on their own"
            why = "" if SETTINGS.pod_groups else " (--pod-groups off)"
            LOG.info(f"the PodGroup API is {'' if served else 'not '}used{why}: gangs are {how}")
        _gang_api[:] = [(now, served)]
    return _gang_api[0][1]


async def _record_refusal(ref, namespace, name, seen: Seen, state: JobState, message) -> None:
    """The API server's refusal (PodSecurity, quota, RBAC) into the job's Created condition
    (status.conditions keeps it until the pods exist) and a Warning Event."""
    meta = seen.meta
    old = state.written[1] if state.written else seen.old_status
    new = dict(old)
    new["conditions"] = status.set_condition(
        old.get("conditions") or [],
        "Created",
        False,
        status.REFUSED,
        message,
        seen.now,
        meta.get("generation"),
    )
    if new != old:
        await _write_status(namespace, name, seen, state, new)
    _say(ref, namespace, name, "Warning", status.REFUSED, message)


async def _write_status(namespace, name, seen: Seen, state: JobState, new: dict) -> None:
    """``new`` as the job's status, if the job is still the copy the decision read: the watch's
    (``seen``), or the one our last write made while the watch has not brought it back
    (JobState.written; :func:`_observe` keeps it only while the watch's copy is older than
    that write). Raises :class:`Conflict` when the job moved on."""
    written = state.written
    older = written[0] if written else frozenset()
    over = written[2] if written else seen.meta.get("resourceVersion")
    uid = seen.meta["uid"]
    done = await asyncio.to_thread(kube().patch_status, namespace, name, uid, over, new)
    state.written = (older | {over}, new, done["metadata"].get("resourceVersion"))


def _say(ref, namespace: str, name: str, kind: str, reason: str, message: str) -> None:
    """A decision, said twice: as an Event on the job (one line, bounded: kubectl describe
    shows one per line) and as one line of the operator's log naming the job."""
    line = status.event_message(message)
    kopf.event(ref, type=kind, reason=reason, message=line)
    LOG.log(logging.WARNING if kind == "Warning" else logging.INFO,
            f"{namespace}/{name}: {reason}: {line}")  # fmt: skip


async def _create(child: dict, uid: str) -> bool:
    """Create a child of job ``uid``; True once one of its own exists. A child of the same
    name owned by another UID (a deleted job's, not yet collected) is removed, not adopted."""
    if await asyncio.to_thread(kube().create, child):
        return True
    kind, meta = child["kind"], child["metadata"]
    owners = await asyncio.to_thread(kube().owners, kind, meta["namespace"], meta["name"])
    if owners is None or uid in owners:
        return owners is not None
    LOG.warning(
        f"{kind} {meta['namespace']}/{meta['name']} belongs to {sorted(owners)}, not to job "
        f"{uid}: deleting it"
    )
    await asyncio.to_thread(kube().delete, kind, meta["namespace"], meta["name"])
    return False


def _own_pods(job_pods, namespace: str, name: str, uid: str) -> list[dict]:
    """The views of the pods of job object ``uid`` (a new copy each call: a decision may
    change its own)."""
    return _owned([json.loads(text) for text in job_pods.get((namespace, name), [])], uid)


def _owned(pods: list[dict], uid: str) -> list[dict]:
    return [p for p in pods if any(r.get("uid") == uid for r in p["metadata"]["ownerReferences"])]


async def _poll_progress(job_pods) -> None:
    """One timer for every job: each running gang's rank 0 snapshot every ``progress_every``
    seconds; a new one wakes that job's reconcile (progress is not a Kubernetes event, so no
    watch would). A snapshot is held with the attempt of the pod that served it: a fetch that
    ends after a new gang started holds the old gang's, which :func:`lifecycle.gang_snapshot`
    then keeps from the decision."""
    fetches = asyncio.Semaphore(PROGRESS_FETCHES)
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            await asyncio.sleep(SETTINGS.progress_every)
            due = [(w, *at) for w in list(JOBS.values()) if (at := _rank0(job_pods, w))]
            await asyncio.gather(*(_fetch(session, fetches, *d) for d in due))


def _rank0(job_pods, watch: Watch) -> tuple[int | None, str] | None:
    """(attempt, URL) of the current gang's rank 0 while it runs; None otherwise. The current
    gang's only: a pod of the gang being replaced reports another gang's restarts in place."""
    state = watch.state
    for pod in _own_pods(job_pods, watch.namespace, watch.name, watch.uid):
        if (
            status.rank_of(pod) == 0
            and status.attempt_of(pod) == state.attempt
            and not pod["metadata"].get("deletionTimestamp")
            and pod.get("status", {}).get("phase") == "Running"
            and pod["status"].get("podIP")
            and state.port
        ):
            return status.attempt_of(pod), f"http://{pod['status']['podIP']}:{state.port}/progress"
    return None


async def _fetch(session, fetches: asyncio.Semaphore, watch: Watch, attempt, url: str) -> None:
    # Not serving yet (still loading) or gone: keep the last snapshot.
    with contextlib.suppress(OSError, ValueError, asyncio.TimeoutError, aiohttp.ClientError):
        async with fetches, session.get(url) as response:
            snapshot = await response.json(content_type=None)
        held = (attempt, snapshot)
        if held != watch.state.snapshot:
            watch.state.snapshot = held
            if JOBS.get(watch.key) is watch:
                QUEUE.add(watch.key)


async def _serve_metrics(request: web.Request) -> web.Response:
    return web.Response(body=metrics.text(), headers={"Content-Type": metrics.CONTENT_TYPE})
