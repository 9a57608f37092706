"""operator/cost.py: GPU time from the pods' real running times, kept over every attempt, the
money at the profile's price, and the projection from the trainer's ETA."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from test_status import T0, run_to
from test_status import pod as pod_of

from ftjob.api import manifest
from ftjob.api.jobspec import parse_resource
from ftjob.api.profile import apply, parse_profile
from ftjob.api.schema import SpecError
from ftjob.operator import cost, lifecycle
from ftjob.operator.status import observed_pod

ROOT = Path(__file__).resolve().parents[2]

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
    assert spent["attempts"] == [
        {"attempt": 0, "nodeSeconds": 5400.0, "gpuSeconds": 8 * 5400.0, "pricePerGpuHour": 2.5}
    ]
    assert spent["nodeHours"] == pytest.approx(1.5)
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


def test_a_running_gangs_cost_alone_is_written_once_per_refresh_not_at_every_look():
    """At rest (nothing else in status moves) a status write per look per running job would
    be a write per job per resync; the cost alone is written every REFRESH_SECONDS of running
    (and once when its first running seconds are counted)."""
    from types import SimpleNamespace

    gang = SimpleNamespace(nodes=2)
    pods = [pod(0, 0, 60), pod(0, 1, 60)]
    written = {"phase": "Running", "cost": cost.update(None, pods, 4, NOW)}

    def look(seconds_later, **changed):
        later = NOW + timedelta(seconds=seconds_later)
        fresh = cost.update(written["cost"], pods, 4, later)
        return cost.to_write(written, written | changed | {"cost": fresh}, gang), fresh

    kept, fresh = look(30)  # 120 node-seconds written, 60 more since
    assert kept is written["cost"] and fresh["gpuHours"] > kept["gpuHours"]  # no write
    assert look(cost.REFRESH_SECONDS)[0]["gpuHours"] > written["cost"]["gpuHours"]
    # A gang written before its containers started shows its first seconds at the next look.
    unstarted = written | {"cost": cost.update(None, [pod(0, 0, None), pod(0, 1, None)], 4, NOW)}
    assert unstarted["cost"]["gpuHours"] == 0
    started = cost.update(unstarted["cost"], pods, 4, NOW)
    assert cost.to_write(unstarted, unstarted | {"cost": started}, gang) is started
    # With any other change of status the cost counted now goes with it.
    assert look(30, phase="Suspended")[0] == look(30)[1]
    # A new attempt is written at once.
    more = cost.update(written["cost"], [*pods, pod(1, 0, 1)], 4, NOW)
    assert cost.to_write(written, written | {"cost": more}, gang) is more


def test_a_cpu_job_spends_node_hours_only_and_a_pod_not_started_costs_nothing():
    cpu = cost.update(None, [pod(0, 0, 1800), pod(0, 1, 1800)], 0, NOW, price=2.0, eta_seconds=60)
    assert cpu["nodeHours"] == pytest.approx(1.0) and cpu["gpuHours"] == 0
    assert "amount" not in cpu and "projectedGpuHours" not in cpu  # no GPU, nothing priced
    assert cpu["display"] == "1.00 node-h"
    assert cost.update(None, [pod(0, 0, None)], 8, NOW)["gpuHours"] == 0


def budget_job(gpu_hours: float | None = None, node_hours: float | None = None):
    """The tiny job with a budget: on GPUs for one in GPU-hours, on CPU for one in node-hours."""
    doc = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
    doc["spec"]["network"] = {"collectiveTimeoutSeconds": 60}
    if gpu_hours is not None:
        doc["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 8}
    budget = {"gpuHours": gpu_hours, "nodeHours": node_hours}
    doc["spec"]["budget"] = {k: v for k, v in budget.items() if v is not None}
    return parse_resource(doc)


def test_a_budget_reached_stops_the_gang_as_a_suspension_and_raising_it_resumes():
    name, spec = budget_job(1.0)
    running = run_to([pod_of(0), pod_of(1)])
    status = running.status | {"cost": {"gpuHours": 1.2, "attempts": []}}
    status["progress"] = {"step": 40}
    stopped = lifecycle.decide(spec, name, 2, status, [pod_of(0), pod_of(1)], T0)
    assert stopped.phase == "Stopped" and sorted(stopped.delete) == ["tiny-node-0", "tiny-node-1"]
    said = [e for e in stopped.events if e[1] == "BudgetReached"]
    assert said and "budget of 1 GPU-hours (1.2 spent) reached at step 40" in said[0][2]
    conditions = {c["type"]: c for c in stopped.status["conditions"]}
    assert (
        conditions["Stopped"]["status"] == "True" and conditions["Suspended"]["status"] == "False"
    )
    assert conditions["Running"]["reason"] == "BudgetReached"  # the Reason column
    # Still over it: stays stopped, nothing made.
    held = lifecycle.decide(spec, name, 2, stopped.status, [], T0)
    assert held.phase == "Stopped" and held.create == []
    # A user's suspend says so over a spent budget, and is not taken for a stop.
    spec.run_policy.suspend = True
    assert lifecycle.decide(spec, name, 2, held.status, [], T0).phase == "Suspended"
    spec.run_policy.suspend = False
    # Raised: a new gang, which resumes from the checkpoint on the volume.
    name, raised = budget_job(2.0)
    resumed = lifecycle.decide(raised, name, 3, held.status, [], T0)
    assert resumed.create == [0, 1] and resumed.status["attempt"] == running.status["attempt"] + 1


def test_a_cpu_jobs_node_hour_budget_stops_it():
    name, spec = budget_job(node_hours=0.5)
    running = run_to([pod_of(0), pod_of(1)])
    spent = cost.update(None, [pod(0, 0, 900), pod(0, 1, 900)], 0, NOW)  # 2 x 15 min
    status = running.status | {"cost": spent, "progress": {"step": 7}}
    stopped = lifecycle.decide(spec, name, 2, status, [pod_of(0), pod_of(1)], T0)
    assert stopped.phase == "Stopped" and stopped.delete
    message = {c["type"]: c for c in stopped.status["conditions"]}["Stopped"]["message"]
    assert "budget of 0.5 node-hours (0.5 spent) reached at step 7" in message


def test_the_profile_caps_the_budget_and_gives_one_to_a_job_without():
    team = manifest.load(ROOT / "examples" / "profiles" / "team-a.yaml")[0]
    team["spec"]["limits"]["maxGpuHoursPerJob"] = 100
    p = parse_profile(team)
    doc = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
    # A CPU job spends no GPU-hours: the cap gives it no budget (one it could never reach).
    assert not apply(doc, p).doc["spec"].get("budget")
    doc["spec"]["budget"] = {"gpuHours": 5}
    with pytest.raises(SpecError, match="set budget.nodeHours instead"):
        parse_resource(doc)
    doc["spec"]["budget"] = {}
    doc["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 8}
    assert apply(doc, p).doc["spec"]["budget"] == {"gpuHours": 100}
    doc["spec"]["budget"] = {"gpuHours": 500}
    found = apply(doc, p).violations
    assert [str(e) for e in found] == [
        "spec.budget.gpuHours: 500 GPU-hours exceed limits.maxGpuHoursPerJob 100 of "
        "FineTuneProfile team-a; fix: set budget.gpuHours to at most 100"
    ]
