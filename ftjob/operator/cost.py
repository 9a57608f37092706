"""PURE: what a job has spent, from its pods' real running times, and what it will spend.

A pod's node time is the trainer container's running time (``startedAt`` to its end, or to
now): one pod a node, so the gang's node-hours, the unit whole-node instances are billed in and
the only spend a CPU job has. Its GPU time is that times the GPUs it asked for (the spec's
gpusPerNode, which the pod's limits carry and the scheduler reserved). Each gang attempt's
total is kept in ``status.cost.attempts`` while its pods exist and stays there once they are
gone (never lowered: a pod deleted before the last look loses at most the time since that look,
one resync), so the sum covers every attempt. The money is each attempt's GPU-hours at the
price its profile named then; the projection adds the rest of the run at the trainer's ETA, on
the gang's GPUs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ftjob.operator import status as st

MAX_ATTEMPTS = 64  # status.cost.attempts is bounded (the CRD's maxItems)
# Alone, a running gang's growing cost is written once per this many seconds of each node's
# running: a write at every look would be a write per running job per resync where nothing
# else changed (a thousand jobs: tens of writes a second at rest). The one exception is its
# first running seconds, written at the first look that counts any: a cost last written
# before the containers started would otherwise show nothing spent for ten minutes. With any
# other change of status (progress, phase) it is written as it is; the budget is judged on
# the cost counted now.
REFRESH_SECONDS = 600


def pod_seconds(pod: dict, now: datetime) -> float:
    """Seconds the trainer container of ``pod`` has run (0 before it started)."""
    state = st.trainer_state(pod).get("state") or {}
    running, ended = state.get("running") or {}, state.get("terminated") or {}
    started = st.parse_time(running.get("startedAt") or ended.get("startedAt"))
    if started is None:
        return 0.0
    end = st.parse_time(ended.get("finishedAt")) if ended else now
    return max(((end or now) - started).total_seconds(), 0.0)


def update(
    old: dict | None,
    pods: list[dict],
    gpus_per_pod: int,
    now: datetime,
    price: float | None = None,
    currency: str = "USD",
    eta_seconds: float | None = None,
    gang_gpus: int = 0,
) -> dict[str, Any]:
    """``status.cost`` after this look at the pods (a CPU job's: node time only)."""
    kept = {a["attempt"]: dict(a) for a in (old or {}).get("attempts") or []}
    seen: dict[int, float] = {}
    for pod in pods:
        attempt = st.attempt_of(pod)
        seen[attempt] = seen.get(attempt, 0.0) + pod_seconds(pod, now)
    for attempt, seconds in seen.items():
        entry = kept.setdefault(attempt, {"attempt": attempt, "gpuSeconds": 0.0})
        # Never lowered: a pod gone since the last look took its time with it.
        entry["nodeSeconds"] = round(max(entry.get("nodeSeconds", 0.0), seconds), 1)
        entry["gpuSeconds"] = round(max(entry["gpuSeconds"], seconds * gpus_per_pod), 1)
        if price is not None and gpus_per_pod > 0:
            entry["pricePerGpuHour"] = price
    attempts = [kept[a] for a in sorted(kept)][-MAX_ATTEMPTS:]
    out = _totals(attempts, currency, eta_seconds, gang_gpus, price)
    return out | {"display": display(out, gpus=gpus_per_pod > 0)}


def _totals(attempts, currency, eta_seconds, gang_gpus, price) -> dict[str, Any]:
    hours = sum(a["gpuSeconds"] for a in attempts) / 3600
    priced = [a for a in attempts if a.get("pricePerGpuHour") is not None]
    out: dict[str, Any] = {"attempts": attempts, "gpuHours": round(hours, 4)}
    out["nodeHours"] = round(node_seconds(out) / 3600, 4)
    rest = eta_seconds * gang_gpus / 3600 if eta_seconds is not None and gang_gpus else None
    if rest is not None:
        out["projectedGpuHours"] = round(hours + rest, 4)
    if priced:
        amount = sum(a["gpuSeconds"] / 3600 * a["pricePerGpuHour"] for a in priced)
        out |= {"amount": round(amount, 2), "currency": currency}
        if rest is not None and price is not None:
            out["projectedAmount"] = round(amount + rest * price, 2)
    return out


def node_seconds(cost: dict | None) -> float:
    """Every attempt's node-seconds in ``cost`` (0 for none); they grow with the GPU-seconds."""
    return sum(a.get("nodeSeconds", 0.0) for a in (cost or {}).get("attempts") or [])


def to_write(old_status: dict, new_status: dict, resources) -> dict:
    """The ``status.cost`` to write: ``new_status``'s (counted now), unless nothing else in
    status changed, no attempt began, and the running gang has run under REFRESH_SECONDS a
    node since the cost last written (which counted some running already); then that one,
    and the status need not be written at all."""
    fresh, old = new_status["cost"], old_status.get("cost")
    others = {k: v for k, v in new_status.items() if k != "cost"}
    if old is None or others != {k: v for k, v in old_status.items() if k != "cost"}:
        return fresh
    if [a["attempt"] for a in fresh["attempts"]] != [a["attempt"] for a in old["attempts"]]:
        return fresh
    before = node_seconds(old)
    grown = node_seconds(fresh) - before
    return fresh if grown >= (REFRESH_SECONDS * resources.nodes if before else 1.0) else old


def display(cost: dict[str, Any], gpus: bool = True) -> str:
    """The printer column: "1.25 GPU-h 4.00 USD (~10.00 USD)"; a CPU job's "0.02 node-h"."""
    if not gpus:
        return f"{cost['nodeHours']:.2f} node-h"
    text = f"{cost['gpuHours']:.2f} GPU-h"
    if "amount" in cost:
        text += f" {cost['amount']:.2f} {cost['currency']}"
        if "projectedAmount" in cost:
            text += f" (~{cost['projectedAmount']:.2f} {cost['currency']})"
    elif "projectedGpuHours" in cost:
        text += f" (~{cost['projectedGpuHours']:.2f})"
    return text
