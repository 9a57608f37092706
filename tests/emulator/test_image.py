"""The cluster-wide trainer image: `ftjob operator --default-image` (the chart's
trainer.defaultImage) runs jobs that name none; spec.image wins; status.image says which."""

import pytest
from support import Operator, gang_running, job_status, tiny_job

pytestmark = pytest.mark.timeout(60)
DEFAULT = "registry.example.com/ml/ftjob-trainer:0.1.0"


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = Operator(cluster, log, "--default-image", DEFAULT).start()
    yield op
    op.stop()


def images(pods: list[dict]) -> set[str]:
    return {p["spec"]["containers"][0]["image"] for p in pods}


def test_a_job_without_an_image_gets_the_operators_default(cluster, operator):
    job = tiny_job("no-image")
    assert "image" not in job["spec"]
    cluster.create_job(job)
    assert images(gang_running(cluster, "no-image", 0)) == {DEFAULT}
    # The stored job keeps no image (the CRD has no default that would hide the operator's).
    assert "image" not in cluster.get("finetunejobs", "no-image")["spec"]
    assert job_status(cluster, "no-image")["image"] == DEFAULT


def test_spec_image_wins_and_is_recorded(cluster, operator):
    job = tiny_job("own-image")
    job["spec"]["image"] = "registry.example.com/team-a/trainer:exp-7"
    cluster.create_job(job)
    assert images(gang_running(cluster, "own-image", 0)) == {job["spec"]["image"]}
    assert job_status(cluster, "own-image")["image"] == job["spec"]["image"]
