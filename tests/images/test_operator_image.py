"""The operator image, built from the Dockerfile, reconciles FineTuneJobs against the API
emulator (tests/emulator) as the chart's Deployment runs it.

    python -m pytest tests/images/test_operator_image.py -q     # needs podman (see conftest)

The container is the Deployment's pod template from manifests/install.yaml (the chart with
its default values) run by tests/images/podrun.py: its args, env and security context (uid
10001, read-only root, every capability dropped, /tmp an emptyDir). What a cluster would
add is given the same way the `ftjob operator` process tests give it: a kubeconfig for the
emulator (instead of the service-account token) and short resync periods. The container
shares the machine's network to reach the emulator, so the health and metrics ports move
to free ones.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from cluster import Cluster
from contents import assert_extra_installed
from podrun import layer_writes, logs, podman, remove, run_argv, state
from support import free_port, gang_running, job_status, tiny_job, wait_phase

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1800)  # the first test also waits for the build
UID = 10001


def deployment_pod(image: str, health: int, metrics: int) -> dict:
    """The chart's operator pod (manifests/install.yaml), on this image and these ports."""
    docs = yaml.safe_load_all((ROOT / "manifests" / "install.yaml").read_text())
    deployment = next(d for d in docs if d and d["kind"] == "Deployment")
    template = copy.deepcopy(deployment["spec"]["template"])
    container = template["spec"]["containers"][0]
    container["image"] = image
    moved = {"--liveness=http://0.0.0.0:8080/healthz": f"--liveness=http://0.0.0.0:{health}/healthz",
             "--metrics-port=9090": f"--metrics-port={metrics}"}  # fmt: skip
    assert set(moved) <= set(container["args"]), container["args"]
    container["args"] = [moved.get(a, a) for a in container["args"]]
    meta = {"name": "ftjob-operator-test", "namespace": "ftjob-system", **template["metadata"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def healthy(port: int) -> bool:
    try:
        # not a hang guard: one try of a poll
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def operator(images, cluster, tmp_path_factory):
    health, metrics = free_port(), free_port()
    pod = deployment_pod(images.operator, health, metrics)
    kube = tmp_path_factory.mktemp("kube")
    (kube / "config").write_text(cluster.kubeconfig.read_text())
    kube.chmod(0o755)  # readable by the container's user, as a mounted Secret would be
    (kube / "config").chmod(0o644)
    name = f"ftjob-operator-test-{health}"
    argv, _ = run_argv(
        pod, name, tmp_path_factory.mktemp("operator") / "pod", network="host",
        extra_env={"KUBECONFIG": "/etc/ftjob-kube/config", "FTJOB_RESYNC_SECONDS": "1",
                   "FTJOB_PROGRESS_SECONDS": "0.2"},
    )  # fmt: skip
    # The kubeconfig stands in for the service-account token a cluster would mount.
    image = argv.index(images.operator)
    argv[image:image] = ["-v", f"{kube}:/etc/ftjob-kube:ro"]
    podman(*argv)
    try:
        deadline = time.monotonic() + 60
        while not healthy(health):
            assert state(name)[0] == "running", logs(name)[-3000:]
            assert time.monotonic() < deadline, logs(name)[-3000:]
            time.sleep(0.2)
        yield name
    finally:
        remove(name)


def test_the_image_imports_the_operator_and_every_dependency_of_its_extra_at_the_pin(images):
    assert_extra_installed(images.operator, "operator")


def test_the_operator_runs_as_uid_10001_on_a_read_only_root(images, operator):
    assert podman("image", "inspect", "--format", "{{.Config.User}}", images.operator).strip() == (
        f"{UID}:{UID}"
    )
    status = podman("exec", operator, "cat", "/proc/1/status")
    ids = {line.split(":")[0]: line.split()[1:] for line in status.splitlines() if ":" in line}
    assert ids["Uid"] == [str(UID)] * 4 and ids["Gid"] == [str(UID)] * 4
    assert ids["CapEff"] == ["0000000000000000"]
    inspect = json.loads(podman("inspect", operator))[0]
    assert inspect["HostConfig"]["ReadonlyRootfs"] is True
    assert layer_writes(operator) == []


def test_the_operator_image_turns_a_finetunejob_into_pods_and_status(operator, cluster,
                                                                     trainer_runs):  # fmt: skip
    cluster.create_job(tiny_job("from-image"))
    pods = gang_running(cluster, "from-image", 0)
    assert sorted(p["metadata"]["name"] for p in pods) == ["from-image-node-0", "from-image-node-1"]
    for p in pods:
        assert p["spec"]["securityContext"]["runAsUser"] == 1000
        assert p["metadata"]["ownerReferences"][0]["kind"] == "FineTuneJob"
    assert cluster.get("configmaps", "from-image-spec")
    assert cluster.get("services", "from-image")
    wait_phase(cluster, "from-image", "Running")
    # The real trainer's success record ends the gang: the job succeeds with its model path.
    done = trainer_runs.get("succeeded")
    cluster.terminate("from-image-node-1", 0)
    cluster.terminate("from-image-node-0", 0, message=done.message)
    status = wait_phase(cluster, "from-image", "Succeeded")
    assert status["modelPath"] == json.loads(done.record)["exportPath"]
    assert job_status(cluster, "from-image").get("restarts", 0) == 0
    log = logs(operator)
    assert "Traceback" not in log and "forbidden" not in log.lower(), log[-3000:]
