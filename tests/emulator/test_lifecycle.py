"""Every lifecycle path of a FineTuneJob, with `ftjob operator` running as a real process
against the API emulator; the test plays kubelet (pod phases, exit codes), and the termination
messages it reports are the real trainer's (the ``trainer_runs`` fixture)."""

import json
from datetime import datetime, timedelta, timezone

import dashboard_queries
import pytest
from dashboard_queries import exported_series, unexported
from hangs import FLOOR
from support import (
    events_of,
    gang_running,
    job_pods,
    job_status,
    rank0_progress,
    tiny_job,
    wait_phase,
)

from ftjob.operator.status import format_eta
from ftjob.trainer.report import metrics as trainer_metrics

pytestmark = pytest.mark.timeout(60)
# The first test to ask for the real trainer's outputs waits for them to be produced.
REAL_RUNS = pytest.mark.timeout(600)


def env_of(pod: dict) -> dict:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_exit_zero_without_an_exported_model_is_not_success(cluster, operator):
    cluster.create_job(tiny_job("hollow"))
    gang_running(cluster, "hollow", 0)
    cluster.terminate("hollow-node-1", 0)
    cluster.terminate("hollow-node-0", 0)  # no termination message: no model was written
    status = wait_phase(cluster, "hollow", "Failed")
    assert "named no exported model" in status["failure"]["message"]
    assert status["restarts"] == 0


@REAL_RUNS
def test_a_full_disk_restarts_the_gang(cluster, operator, trainer_runs):
    full = trainer_runs.get("disk-full")
    cluster.create_job(tiny_job("full", runPolicy={"backoffLimit": 3}))
    gang_running(cluster, "full", 0)
    cluster.terminate("full-node-1", full.exit_code, message=full.message)
    gang_running(cluster, "full", 1)
    status = job_status(cluster, "full")
    assert status["failure"]["reason"] == "DiskFull" and status["restarts"] == 1


@pytest.mark.timeout(3 * FLOOR)  # two gangs' waits, each up to FLOOR
def test_no_first_step_within_the_startup_limit_restarts_the_gang(cluster, operator):
    policy = {"stallTimeoutSeconds": 60, "startupTimeoutSeconds": 60}
    cluster.create_job(tiny_job("stall", runPolicy=policy))
    gang_running(cluster, "stall", 0)
    wait_phase(cluster, "stall", "Running")
    # Let the clock run: the gang has been "running" without progress for two minutes. The
    # operator may write its own view of the condition over the first backdating (a status
    # write of its that crossed the test's), so the clock is moved again until it acts.
    past = (datetime.now(timezone.utc) - timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def restarted():
        status = job_status(cluster, "stall")
        conditions = status.get("conditions", [])
        running = next((c for c in conditions if c["type"] == "Running"), {"status": None})
        if status.get("restarts", 0) == 0 and running.get("lastTransitionTime") != past:
            running["lastTransitionTime"] = past
            cluster.call(
                lambda: cluster.api.write_status("finetunejobs", "default", "stall", status)
            )
        return status.get("restarts", 0) == 1

    cluster.wait(restarted, FLOOR, "the stalled gang to be restarted")
    gang_running(cluster, "stall", 1)
    status = job_status(cluster, "stall")
    # No report from rank 0 at all: the gang never got past starting.
    assert status["failure"]["reason"] == "StartupTimeout" and status["restarts"] == 1
    assert "startupTimeoutSeconds 60" in status["failure"]["message"]


def test_suspend_removes_the_pods_and_resume_brings_a_new_gang(cluster, operator):
    cluster.create_job(tiny_job("pause"))
    gang_running(cluster, "pause", 0)
    cluster.patch_job_spec("pause", {"runPolicy": {"suspend": True}})
    wait_phase(cluster, "pause", "Suspended")
    cluster.wait(lambda: not job_pods(cluster, "pause"), FLOOR, "the pods to go")
    assert cluster.get("configmaps", "pause-spec")  # the job keeps its spec and volume
    cluster.patch_job_spec("pause", {"runPolicy": {"suspend": False}})
    gang_running(cluster, "pause", 1)
    status = wait_phase(cluster, "pause", "Running")
    assert status["restarts"] == 0 and status["observedGeneration"] == 3
    # Events are posted after the status they go with: wait for them too.
    cluster.wait(
        lambda: {"Suspended", "Resumed"} <= set(events_of(cluster, "pause")), FLOOR, "the Events"
    )


def test_active_deadline_fails_the_job(cluster, operator):
    cluster.create_job(tiny_job("late", runPolicy={"activeDeadlineSeconds": 2}))
    gang_running(cluster, "late", 0)
    status = wait_phase(cluster, "late", "Failed", timeout=FLOOR)
    assert status["failure"]["reason"] == "DeadlineExceeded"
    cluster.wait(lambda: not job_pods(cluster, "late"), FLOOR, "the pods to go")


def test_ttl_after_finished_deletes_the_job_and_its_children(cluster, operator):
    cluster.create_job(tiny_job("ttl", runPolicy={"ttlSecondsAfterFinished": 1}))
    gang_running(cluster, "ttl", 0)
    cluster.terminate("ttl-node-0", 0, message='{"exportPath": "/ftjob/ttl/model"}')
    cluster.terminate("ttl-node-1", 0)
    cluster.wait(lambda: cluster.get("finetunejobs", "ttl") is None, FLOOR, "the job to go")
    cluster.wait(lambda: not job_pods(cluster, "ttl"), FLOOR, "the pods to go")
    # The garbage collector takes each child in its own time: wait for each, not the pods only.
    cluster.wait(
        lambda: (
            cluster.get("configmaps", "ttl-spec") is None and cluster.get("services", "ttl") is None
        ),
        FLOOR,
        "the ConfigMap and Service to go",
    )


def test_progress_from_rank_0_reaches_status(cluster, operator):
    doc = tiny_job("prog")
    report = rank0_progress(doc["spec"]["network"]["progressPort"], 60)
    report.begin(0)
    report.step(30, 1e-3, 0.5)
    report.logged(30, 2.25, tokens=4096, flops=0.0)
    report.update(lastCheckpoint="/ftjob/prog/ckpt/20", lastCheckpointStep=20)
    served = dict(report.snapshot)
    try:
        cluster.create_job(doc)
        gang_running(cluster, "prog", 0)
        status = cluster.wait(
            lambda: (s := job_status(cluster, "prog")).get("progress") and s, FLOOR, "progress"
        )
        assert status["progress"]["display"] == "30/60" and status["progress"]["loss"] == 2.25
        assert status["progress"]["eta"] == format_eta(served["etaSeconds"])
        assert status["lastCheckpoint"] == {
            "step": 20,
            "path": "/ftjob/prog/ckpt/20",
            "time": served["updatedAt"],
        }
    finally:
        report.close()


def test_metrics_count_jobs_by_phase_and_restarts(cluster, operator):
    text = operator.get_metrics()
    assert 'ftjob_jobs{phase="Running"}' in text
    assert operator.metric("ftjob_gang_restarts_total") >= 2  # disk full and stall above
    assert operator.metric("ftjob_reconcile_seconds_count") > 0
    # Latency histograms: every reconcile falls in some bucket, and API calls are timed.
    assert 'ftjob_reconcile_seconds_bucket{le="+Inf"}' in text
    assert 'ftjob_api_request_seconds_count{operation="patch_status"}' in text
    assert 'ftjob_api_request_seconds_count{operation="create"}' in text


@REAL_RUNS
def test_the_charts_dashboard_queries_only_what_the_operator_and_trainer_export(
    operator, trainer_runs
):
    """Every metric the chart's Grafana dashboard (charts/ftjob/dashboards/ftjob.json)
    queries is on a real /metrics page: this operator's, after the reconciles above, or a
    real trainer's rank 0, scraped while it trained. The one gauge a CPU run cannot show is
    MFU (no peak FLOP/s: its /progress says mfu null, and the gauge is left out, not 0); it
    counts as the trainer's through the trainer's own table of gauges."""
    run = trainer_runs.get("scraped")
    assert run.exit_code == 0, run.log[-3000:]
    exported = exported_series(operator.get_metrics()) | exported_series(run.served["/metrics"])
    progress = json.loads(run.served["/progress"])
    assert progress["device"] == "cpu" and progress["mfu"] is None
    assert ("ftjob_mfu_ratio", "mfu") in [(name, key) for name, key, _ in trainer_metrics.GAUGES]
    assert "ftjob_loss" in exported and "ftjob_reconcile_seconds_bucket" in exported
    assert unexported(dashboard_queries.load(), exported | {"ftjob_mfu_ratio"}) == {}


def test_a_job_the_crd_takes_but_whose_children_cannot_exist_fails_clearly(cluster, operator):
    """The CRD cannot bound a free-form affinity; the job's ConfigMap (the whole job document)
    could never be created. The operator fails the job naming why, and creates nothing."""
    affinity = {"nodeAffinity": {"note": "x" * (1024 * 1024)}}
    cluster.create_job(tiny_job("huge", scheduling={"affinity": affinity}))
    status = wait_phase(cluster, "huge", "Failed")
    assert status["failure"]["reason"] == "BadInput"
    assert "spec: Too long" in status["failure"]["message"]
    assert "ConfigMap huge-spec" in status["failure"]["message"]
    assert not job_pods(cluster, "huge")
