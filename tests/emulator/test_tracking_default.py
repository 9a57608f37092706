"""The cluster-wide experiment trackers: the operator's FTJOB_DEFAULT_TRACKING (the chart's
trainer.tracking) reaches the pods and the spec of a job that names none; a job's own wins."""

import json

import pytest
from support import Operator, gang_running, tiny_job

pytestmark = pytest.mark.timeout(60)
DEFAULT = {
    "mlflow": {
        "trackingUri": "http://mlflow.mlflow:5000",
        "experiment": "cluster",
        "token": {"name": "mlflow", "key": "token"},
    }
}


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    env = {"FTJOB_DEFAULT_TRACKING": json.dumps(DEFAULT)}
    op = Operator(cluster, log, env=env).start()
    yield op
    op.stop()


def tracking_of(cluster, name: str, pod: dict) -> tuple[dict, dict]:
    """(the spec.tracking the trainer reads, the pod's tracker variables)."""
    config = cluster.get("configmaps", f"{name}-spec")
    (data,) = config["data"].values()
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    return json.loads(data)["spec"].get("tracking", {}), {
        k: v for k, v in env.items() if k.startswith(("MLFLOW_", "WANDB_"))
    }


def test_a_job_that_names_no_tracker_gets_the_operators_default(cluster, operator):
    cluster.create_job(tiny_job("tracked-by-default"))
    pod = gang_running(cluster, "tracked-by-default", 0)[0]
    tracking, env = tracking_of(cluster, "tracked-by-default", pod)
    assert tracking["mlflow"]["experiment"] == "cluster"
    assert env == {
        "MLFLOW_TRACKING_TOKEN": {
            "name": "MLFLOW_TRACKING_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}},
        }
    }
    # The stored job is the user's: the default is applied, not written into it.
    assert cluster.get("finetunejobs", "tracked-by-default")["spec"].get("tracking", {}) == {}


def test_a_jobs_own_tracker_wins(cluster, operator):
    cluster.create_job(tiny_job("own-tracker", tracking={"tensorboard": {"enabled": True}}))
    pod = gang_running(cluster, "own-tracker", 0)[0]
    tracking, env = tracking_of(cluster, "own-tracker", pod)
    assert tracking == {"tensorboard": {"enabled": True}} and env == {}
