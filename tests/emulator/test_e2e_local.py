"""End to end: the operator's rendered pods run as real local processes (2 nodes x 1 CPU
process, the tiny model): the job succeeds with checkpoints and an exported model, and
survives a node killed mid-training by a gang restart that resumes from the checkpoint."""

import json
import shutil
import signal
from pathlib import Path

import pytest
from cluster import Cluster
from processes import ProcessKubelet
from support import Operator, job_pods, tiny_job, wait_phase

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def local(tmp_path):
    shared = tmp_path / "shared"  # the ReadWriteMany volume: model and data are on it
    shutil.copytree(ROOT / "examples" / "tiny-model", shared / "tiny-model")
    shutil.copytree(ROOT / "examples" / "data", shared / "data")
    kubelet = lambda api: ProcessKubelet(api, tmp_path / "pods", shared)  # noqa: E731
    with Cluster(tmp_path, kubelet=kubelet) as cluster:
        op = Operator(cluster, tmp_path / "operator.log").start()
        yield cluster, shared
        op.stop()


def job(name: str, steps: int) -> dict:
    return tiny_job(name, training={"maxSteps": steps}, checkpoint={"every": 10, "keep": 2})


def progress(shared: Path, name: str) -> dict:
    try:
        return json.loads((shared / name / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def test_the_job_trains_checkpoints_and_exports(local):
    cluster, shared = local
    cluster.create_job(job("e2e", 20))
    status = wait_phase(cluster, "e2e", "Succeeded", timeout=180)
    # No restart, unless something outside killed a process (a SIGKILL from outside was seen
    # once on a shared test machine): then a gang restart is right and the job still succeeds.
    assert status["restarts"] == 0 or status["failure"]["exitCode"] == 137
    assert status["modelPath"].endswith("/e2e/model")
    assert (shared / "e2e" / "model" / "model.safetensors").is_file()
    assert (shared / "e2e" / "checkpoints" / "step-00000010").is_dir()
    assert progress(shared, "e2e")["step"] == 20


def test_a_killed_node_restarts_the_gang_which_resumes(local):
    cluster, shared = local
    cluster.create_job(job("kill", 60))
    cluster.wait(
        lambda: (progress(shared, "kill").get("lastCheckpointStep") or 0) >= 10,
        180,
        "the first checkpoint",
    )
    (victim,) = [p for p in job_pods(cluster, "kill") if p["metadata"]["name"] == "kill-node-1"]
    cluster.kubelet.nodes[victim["metadata"]["uid"]].stop(signal.SIGKILL)
    status = wait_phase(cluster, "kill", "Succeeded", timeout=180)
    assert status["restarts"] == 1 and status["attempt"] == 1
    assert status["failure"]["pod"] in ("kill-node-0", "kill-node-1")  # the kill, diagnosed
    final = progress(shared, "kill")
    assert final["step"] == 60 and final["resumedFrom"]  # attempt 1 resumed, not restarted
    assert (shared / "kill" / "model" / "model.safetensors").is_file()
