"""The operator's Prometheus metrics (``--metrics-port``), through prometheus_client.

Names as docs/operator.md lists them: jobs by phase (gauge), gang restarts, restarts in
place, bad nodes and failed reconciles (counters), stragglers and the preflight's bus
bandwidth by job (gauges), and two latency histograms: one reconcile, and one Kubernetes API
request by operation. One registry for the process, not prometheus_client's global one, so
that /metrics shows the operator's series only.

No name is also one of the trainer's (ftjob.trainer.report.metrics): a dashboard reads both from
one Prometheus. The by-job gauges' labels are ``ftjob_namespace`` and ``ftjob_job``, not
``namespace`` and ``job``: Prometheus gives every scraped series those two of its own (the
operator's namespace, its Service), and would rename the operator's to ``exported_*``.
"""

from __future__ import annotations

import contextlib
import functools

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ftjob.api.status import PHASES

CONTENT_TYPE = CONTENT_TYPE_LATEST
REGISTRY = CollectorRegistry()

JOBS = Gauge("ftjob_jobs", "FineTuneJobs by phase.", ["phase"], registry=REGISTRY)
GANG_RESTARTS = Counter(
    "ftjob_gang_restarts", "Gangs replaced after a failure or stall.", registry=REGISTRY
)
RESTARTS_IN_PLACE = Counter(
    "ftjob_restarts_in_place",
    "Worker restarts in place (torchrun's agent, pods kept) that rank 0 reported.",
    registry=REGISTRY,
)
BAD_NODES = Counter(
    "ftjob_bad_nodes",
    "Failures blamed on a node (the node is then kept away from the job's next gangs), by reason.",
    ["reason"],
    registry=REGISTRY,
)
JOB_LABELS = ["ftjob_namespace", "ftjob_job"]
STRAGGLERS = Gauge(
    "ftjob_job_stragglers",
    "Ranks rank 0 names as persistently slower than the median, by job.",
    JOB_LABELS,
    registry=REGISTRY,
)
BUS_BANDWIDTH = Gauge(
    "ftjob_preflight_bus_bandwidth_gbps",
    "Bus bandwidth (GB/s, nccl-tests' busbw) of the preflight's all-reduce of the job's "
    "newest gang.",
    JOB_LABELS,
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "ftjob_reconcile_errors", "Reconciles that failed and were retried.", registry=REGISTRY
)
RECONCILE_SECONDS = Histogram(
    "ftjob_reconcile_seconds",
    "Time one reconcile of one job takes (read, decide, write status, change children).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
API_SECONDS = Histogram(
    "ftjob_api_request_seconds",
    "Time of one Kubernetes API request the operator makes, by operation.",
    ["operation"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)

_phases: dict[str, str] = {}  # job uid -> phase of each live job


def job_phase(key: str, phase: str | None) -> None:
    """Record a job's phase; None when the job is gone (its daemon stopped)."""
    if phase is None:
        _phases.pop(key, None)
    else:
        _phases[key] = phase
    for p in PHASES:
        JOBS.labels(p).set(sum(1 for v in _phases.values() if v == p))


def observed(namespace: str, name: str, old: dict, new: dict) -> None:
    """What one reconcile changed in a job's status, counted."""
    if new.get("restarts", 0) > old.get("restarts", 0):
        GANG_RESTARTS.inc()
    grown = new.get("restartsInPlace", 0) - old.get("restartsInPlace", 0)
    if grown > 0:
        RESTARTS_IN_PLACE.inc(grown)
    before = {b.get("node"): b.get("count", 0) for b in old.get("badNodes") or []}
    for b in new.get("badNodes") or []:
        if b.get("count", 0) > before.get(b.get("node"), 0):
            BAD_NODES.labels(b.get("reason", "")).inc()
    if "stragglers" in new:
        STRAGGLERS.labels(namespace, name).set(len(new["stragglers"]))
    if (new.get("preflight") or {}).get("busBandwidthGBps") is not None:
        BUS_BANDWIDTH.labels(namespace, name).set(new["preflight"]["busBandwidthGBps"])


def forget(namespace: str, name: str) -> None:
    """A job is gone: its series go too."""
    for gauge in (STRAGGLERS, BUS_BANDWIDTH):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)


def timed(operation: str):
    """Decorator: observe a Kubernetes API call's latency (errors included)."""

    def wrap(call):
        @functools.wraps(call)
        def timed_call(*args, **kwargs):
            with API_SECONDS.labels(operation).time():
                return call(*args, **kwargs)

        return timed_call

    return wrap


def text() -> bytes:
    return generate_latest(REGISTRY)
