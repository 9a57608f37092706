"""The trainer image, built from the Dockerfile, runs examples/tiny.yaml's rendered Pods.

    python -m pytest tests/images/test_trainer_image.py -q     # needs podman (see conftest)

The Pods are ftjob's own render (ftjob.operator.render.children, what the operator applies),
run by tests/images/podrun.py as a kubelet would: the pods' command, env and security
context (uid 1000, read-only root, every capability dropped), the spec ConfigMap at
/etc/ftjob, a host folder as the shared volume, tmpfs at /tmp and /dev/shm. The gang's
containers share one network namespace with nothing but loopback; the headless Service's
DNS names point at 127.0.0.1 there.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from pathlib import Path

import pytest
from contents import assert_extra_installed
from podrun import fs_group, hosts_of, layer_writes, logs, podman, remove, run_argv, state

from ftjob.api import contract, manifest
from ftjob.api.jobspec import parse_resource
from ftjob.operator import render

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1800)  # the first test also waits for the build
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
NAMESPACE = "default"
GANG_TIMEOUT = 300
# A node would give each pod its own cores; here both "nodes" share this machine's.
NODE_ENV = {"OMP_NUM_THREADS": "1"}


def test_the_image_imports_the_trainer_and_every_dependency_of_its_extra_at_the_pin(images):
    assert_extra_installed(images.trainer, "trainer")


def test_the_image_runs_as_uid_1000_and_a_pod_with_home_tmp_on_a_read_only_root(images):
    assert podman("image", "inspect", "--format", "{{.Config.User}}", images.trainer).strip() == (
        "1000:1000"
    )
    # As `docker run` would: the image's own user.
    assert podman("run", "--rm", "--network", "none", images.trainer, "id", "-u").strip() == "1000"
    # As a rendered pod runs it: its env (HOME=/tmp), user, read-only root, /tmp a tmpfs.
    pod = next(c for c in tiny_pods(images.trainer, "checks") if c["kind"] == "Pod")
    container = pod["spec"]["containers"][0]
    env = [a for e in container["env"] if "value" in e  # the downward API's are not needed
           for a in ("--env", f"{e['name']}={e['value']}")]  # fmt: skip
    probe = (
        "import os, pathlib; print(os.getuid(), os.getgid(), os.environ['HOME']);"
        "pathlib.Path(os.environ['HOME'], 'ok').write_text('x');"
        "\ntry: pathlib.Path('/home/ftjob/x').write_text('x')\nexcept OSError as e: print(e.errno)"
    )
    out = podman("run", "--rm", "--network", "none", "--read-only", "--read-only-tmpfs=false",
                 "--tmpfs", "/tmp", "--user", "1000:1000", "--cap-drop", "ALL", *env,
                 images.trainer, "python", "-c", probe)  # fmt: skip
    assert out.split() == ["1000", "1000", "/tmp", "30"]  # 30: EROFS, read-only file system


# ------------------------------------------------------------------------ the gang


def tiny_pods(image: str, uid: str, attempt: int = 0) -> list[dict]:
    """examples/tiny.yaml rendered for the cluster: [ConfigMap, Service, PodGroup, Pod, Pod]."""
    doc = copy.deepcopy(TINY)
    doc["spec"]["image"] = image
    name, spec = parse_resource(doc)
    return render.children(name, NAMESPACE, spec, attempt, uid)


class Gang:
    """One attempt's pods running as containers; the shared volume is ``shared``."""

    def __init__(self, image: str, uid: str, attempt: int, shared: Path, workdir: Path):
        children = tiny_pods(image, uid, attempt)
        self.configmaps = {c["metadata"]["name"]: c for c in children if c["kind"] == "ConfigMap"}
        self.pods = [c for c in children if c["kind"] == "Pod"]
        self.names = [f"{p['metadata']['name']}-{uid[:8]}-a{attempt}" for p in self.pods]
        self.folder = workdir / f"{uid[:8]}-a{attempt}"
        self.shared, self.terminations = shared, []
        self.job_dir = shared / Path(render.job_dir("tiny", parse_resource(TINY)[1], uid)).name

    def start(self) -> Gang:
        remove(*self.names)  # what a run cut short left under these names (its pods, as it were)
        hosts = hosts_of(self.pods)
        for i, (pod, name) in enumerate(zip(self.pods, self.names, strict=True)):
            # Node 0 makes the network namespace (loopback only), the others join it.
            network = "none" if i == 0 else f"container:{self.names[0]}"
            argv, termination = run_argv(
                pod, name, self.folder / name, configmaps=self.configmaps,
                claims={"ftjob-shared": self.shared}, hosts=hosts, network=network,
                extra_env=NODE_ENV,
            )  # fmt: skip
            podman(*argv)
            self.terminations.append(termination)
        return self

    def wait(self, timeout: float = GANG_TIMEOUT) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [state(n) for n in self.names]
            if all(s == "exited" for s, _ in states):
                return [code for _, code in states]
            time.sleep(0.5)
        raise AssertionError(f"the gang did not end in {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n" + logs(n)[-3000:] for n in self.names)

    def record(self, rank: int) -> dict | None:
        return contract.parse(self.terminations[rank].read_text())

    def losses(self) -> dict[int, float]:
        rows = [json.loads(x) for x in (self.job_dir / "progress.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["event"] == "step"}


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> Path:
    """The shared volume: the example's model and data (relative sources are read there),
    group-owned by the pods' fsGroup as the kubelet leaves it."""
    shared = tmp_path_factory.mktemp("shared-volume")
    shutil.copytree(ROOT / "examples" / "tiny-model", shared / "tiny-model")
    shutil.copytree(ROOT / "examples" / "data", shared / "data")
    fs_group(shared, render.RUN_AS)
    return shared


@pytest.fixture(scope="module")
def gangs():
    started: list[Gang] = []
    yield started
    remove(*(n for g in started for n in g.names))


@pytest.fixture(scope="module")
def reference(images, volume, gangs, tmp_path_factory) -> Gang:
    """An uninterrupted run of tiny.yaml's pods."""
    gang = Gang(images.trainer, "0a0a0a0a-ref", 0, volume, tmp_path_factory.mktemp("ref"))
    gangs.append(gang.start())
    codes = gang.wait()
    assert codes == [0, 0], gang.logs()
    return gang


def test_the_rendered_pods_train_to_an_export_that_loads(reference, volume):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = reference.record(0)
    assert record and record["outcome"] == "succeeded", reference.terminations[0].read_text()
    export = record["exportPath"]
    assert export.startswith(render.SHARED_DIR + "/"), export
    local = volume / export.removeprefix(render.SHARED_DIR + "/")
    model = AutoModelForCausalLM.from_pretrained(local)
    tokenizer = AutoTokenizer.from_pretrained(local)
    original = AutoModelForCausalLM.from_pretrained(ROOT / "examples" / "tiny-model")
    assert model.num_parameters() == original.num_parameters()
    assert tokenizer("hello")["input_ids"]
    # Trained: the weights moved away from the bundled model's.
    assert not all(
        (a == b).all() for a, b in zip(model.parameters(), original.parameters(), strict=True)
    )
    steps = reference.losses()
    assert sorted(steps) == list(range(5, 61, 5))
    assert steps[60] < steps[5]
    # Files on the volume are the pods' user's: written as uid 1000, not root.
    assert {p.stat().st_uid for p in local.iterdir()} == {render.RUN_AS}


def test_the_containers_wrote_nothing_outside_their_volumes(reference):
    for name in reference.names:
        inspect = json.loads(podman("inspect", name))[0]
        assert inspect["HostConfig"]["ReadonlyRootfs"] is True
        assert inspect["Config"]["User"] == f"{render.RUN_AS}:{render.RUN_AS}"
        assert layer_writes(name) == [], name
