"""End to end: the operator's rendered pods run as real local processes (2 nodes x 1 CPU
process, the tiny model): a job deleted and created again under its name starts from step 0.
A job that trains to its export and one whose node is killed mid-way are the real nodes' to
show (tests/cluster/test_real_gang.py: the real kubelet's containers, the same trainer)."""

import json
import shutil
from pathlib import Path

import pytest
from cluster import Cluster
from hangs import FLOOR
from processes import ProcessKubelet
from support import Operator, tiny_job, wait_phase

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


def folder(shared: Path, created: dict) -> Path:
    """The job's folder on the shared volume: <name>-<uid8>."""
    meta = created["metadata"]
    return shared / f"{meta['name']}-{meta['uid'][:8]}"


def progress(job_folder: Path) -> dict:
    try:
        return json.loads((job_folder / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_job_created_again_under_its_old_name_starts_from_step_0(local):
    """A fix-and-reapply: the old job's checkpoints and model are not the new job's."""
    cluster, shared = local
    old = folder(shared, cluster.create_job(job("again", 20)))  # a checkpoint at step 10
    wait_phase(cluster, "again", "Succeeded", timeout=180)
    key = ("ftjob.dev", "v1alpha1", "finetunejobs", "default", "again")
    cluster.call(lambda: cluster.api.begin_delete(key))
    cluster.wait(lambda: cluster.get("finetunejobs", "again") is None, FLOOR, "the job to go")
    new = folder(shared, cluster.create_job(job("again", 30)))
    status = wait_phase(cluster, "again", "Succeeded", timeout=180)
    assert new != old and status["jobFolder"] == f"/ftjob/{new.name}"
    lines = (new / "progress.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert min(steps) < 10 and max(steps) == 30  # trained from the start, not from step 10
    assert progress(new)["resumedFrom"] is None
    assert (old / "model" / "model.safetensors").is_file()  # the old run is left as it was
