"""operator/cost.py: GPU time from the pods' real running times, kept over every attempt, the
money at the profile's price, and the projection from the trainer's ETA."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from ftjob.operator import cost
from ftjob.operator.status import observed_pod

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=timezone.utc)


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(attempt: int, rank: int, started_ago: float | None, ran: float | None = None) -> dict:
    """A pod as the API serves it; ``ran``: seconds until it ended (None: still running)."""
    state: dict = {"waiting": {"reason": "ContainerCreating"}}
    if started_ago is not None:
        started = NOW - timedelta(seconds=started_ago)
        state = {"running": {"startedAt": iso(started)}}
        if ran is not None:
            ended = {"startedAt": iso(started), "finishedAt": iso(started + timedelta(seconds=ran))}
            state = {"terminated": {"exitCode": 1, **ended}}
    labels = {"ftjob.dev/job-name": "j", "ftjob.dev/node-rank": str(rank)}
    labels["ftjob.dev/attempt"] = str(attempt)
    return observed_pod(
        {
            "metadata": {"name": f"j-node-{rank}", "labels": labels},
            "status": {
                "phase": "Running",
                "containerStatuses": [{"name": "trainer", "state": state}],
            },
        }
    )


def test_gpu_time_is_the_containers_running_time_times_their_gpus():
    pods = [pod(0, 0, 3600), pod(0, 1, 1800), pod(0, 2, None)]  # one not started yet
    spent = cost.update(
        None, pods, 8, NOW, price=2.5, currency="EUR", eta_seconds=1800, gang_gpus=24
    )
    assert spent["attempts"] == [{"attempt": 0, "gpuSeconds": 8 * 5400.0, "pricePerGpuHour": 2.5}]
    assert spent["gpuHours"] == pytest.approx(12.0)
    assert spent["amount"] == pytest.approx(30.0) and spent["currency"] == "EUR"
    assert spent["projectedGpuHours"] == pytest.approx(12.0 + 0.5 * 24)
    assert spent["projectedAmount"] == pytest.approx(30.0 + 0.5 * 24 * 2.5)
    assert spent["display"] == "12.00 GPU-h 30.00 EUR (~60.00 EUR)"


def test_an_attempt_whose_pods_are_gone_stays_counted_and_is_never_lowered():
    first = cost.update(None, [pod(0, 0, 600, ran=600)], 4, NOW)
    # The next gang runs; the first gang's pods are gone.
    later = cost.update(first, [pod(1, 0, 60)], 4, NOW + timedelta(seconds=60))
    assert [a["attempt"] for a in later["attempts"]] == [0, 1]
    assert later["gpuHours"] == pytest.approx((600 * 4 + 120 * 4) / 3600)
    # A pod of the running gang already deleted: its time is not taken back.
    again = cost.update(later, [], 4, NOW + timedelta(seconds=120))
    assert again["gpuHours"] == later["gpuHours"]
    assert "amount" not in again and again["display"] == f"{again['gpuHours']:.2f} GPU-h"


def test_a_cpu_job_has_no_cost_and_a_pod_not_started_costs_nothing():
    assert cost.update(None, [pod(0, 0, 60)], 0, NOW) is None
    assert cost.update(None, [pod(0, 0, None)], 8, NOW)["gpuHours"] == 0
