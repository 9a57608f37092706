"""The operator's Prometheus metrics (``--metrics-port``), through prometheus_client.

Names as docs/operator.md lists them: jobs by phase (gauge), gang restarts and failed
reconciles (counters), and two latency histograms: one reconcile, and one Kubernetes API
request by operation. One registry for the process, not prometheus_client's global one, so
that /metrics shows the operator's series only.
"""

from __future__ import annotations

import functools

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ftjob.status_types import PHASES

CONTENT_TYPE = CONTENT_TYPE_LATEST
REGISTRY = CollectorRegistry()

JOBS = Gauge("ftjob_jobs", "FineTuneJobs by phase.", ["phase"], registry=REGISTRY)
GANG_RESTARTS = Counter(
    "ftjob_gang_restarts", "Gangs replaced after a failure or stall.", registry=REGISTRY
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
