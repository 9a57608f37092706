"""The whole path a user takes, through the real control plane, on nodes that run containers:
`kubectl apply` of examples/tiny.yaml (with the built trainer image) -> the operator, as the
chart's ServiceAccount -> the real scheduler places the pods on two podman nodes
(tests/cluster/podman_node.py) -> the trainer gang trains in the containers -> `kubectl get
ftj` shows the loss, then Succeeded -> the export on the volume's host folder loads, and every
logged loss equals `ftjob run examples/tiny.yaml`'s. Then a container SIGKILLed mid-run, a
pod evicted, and a pod deleted: each time the operator replaces the gang and the run resumes
from its checkpoint with the same losses. And a job whose image does not exist, edited to the
built one: a new gang trains it. And a job whose model and data are s3:// objects on a real S3
server (tests/s3server.py), with the key pair from a Secret the job names, exported to an s3://
prefix; and the same job with a key pair the store refuses: BadModel, not retried.

    python -m pytest tests/cluster/test_podman_node.py -q   # needs podman and the plane
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import hangs
import losses
import pytest
from plane import ROOT, Plane, token_kubeconfig
from podman_node import LABEL, NODE_LABEL
from s3server import S3Server

sys.path.append(str(ROOT / "tests" / "emulator"))
from podrun import PODMAN  # noqa: E402  (podman_node put tests/images on the path)
from support import Operator  # noqa: E402  (the emulator tests' launcher, reused)

from ftjob.api import manifest  # noqa: E402
from ftjob.operator import render  # noqa: E402

pytestmark = pytest.mark.timeout(1800)  # the first test also waits for the image build
NAMESPACE = "podman"
# Named for this session: two CI runs on one machine share podman, and a node's clean-up (or a
# test's) takes only what carries its own nodes' names.
NODES = tuple(f"podman-{os.getpid()}-{i}" for i in range(2))
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]


def node_containers(name_part: str = "", running: bool = False) -> list[str]:
    """The containers this session's podman nodes made (those whose name holds ``name_part``;
    ``running``: only those running)."""
    found = []
    for node in NODES:
        named = ["--filter", f"name={name_part}"] if name_part else []
        argv = [*PODMAN, "ps", *([] if running else ["-a"]), "--filter", f"label={LABEL}={node}",
                *named, "--format", "{{.Names}}"]  # fmt: skip
        found += subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout.split()
    return found


@pytest.fixture(scope="module")
def nodes(installed: Plane, images, tmp_path_factory):
    """Two podman nodes, each its own process (as two kubelets would be)."""
    work = tmp_path_factory.mktemp("podman-nodes")
    procs = []
    for name in NODES:
        argv = [
            sys.executable,
            str(ROOT / "tests/cluster/podman_node.py"),
            "--kubeconfig",
            str(installed.kubeconfig),
            "--name",
            name,
            "--workdir",
            str(work / name),
        ]
        with open(work / f"{name}.log", "w") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    ready = "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
    for name in NODES:
        installed.wait(lambda n=name: installed.get("node", n, ok=False), hangs.FLOOR, name)
        installed.kubectl("wait", f"node/{name}", f"--for={ready}=True", "--timeout=60s")
    yield SimpleNamespace(names=NODES, logs=[work / f"{n}.log" for n in NODES])
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(hangs.FLOOR)
    # Every container a node started went with it. (Whatever a crashed node left is removed
    # anyway, by the label, before the test says so.)
    left = node_containers()
    for name in left:
        subprocess.run([*PODMAN, "rm", "-f", "-t", "0", name], capture_output=True, timeout=120)
    assert left == [], [p.read_text()[-2000:] for p in (work / f"{n}.log" for n in NODES)]


@pytest.fixture(scope="module")
def volume(installed: Plane, tmp_path_factory) -> Path:
    return installed.example_volume(NAMESPACE, tmp_path_factory.mktemp("podman-volume"))


@pytest.fixture(scope="module")
def operator(installed: Plane, nodes, volume, tmp_path_factory):
    work = tmp_path_factory.mktemp("podman-operator")
    kubeconfig = token_kubeconfig(installed, "ftjob-system", "ftjob", work / "sa.kubeconfig")
    op = Operator(SimpleNamespace(kubeconfig=kubeconfig, wait=Plane.wait), work / "op.log")
    op.start()
    op.plane = installed
    yield op
    installed.kubectl("delete", "ftj", "--all", "-n", NAMESPACE, "--timeout=120s", ok=False)
    # Every pod gone while the nodes still run to stop their containers; the later cluster
    # tests expect no job's pod anywhere.
    installed.wait(lambda: not installed.get("pods", namespace=NAMESPACE), hangs.FLOOR, "no pod")
    op.stop()


def tiny(name: str = "tiny") -> dict:
    """examples/tiny.yaml with the built image, kept to the podman nodes (the session's
    plane also has kwok's GPU nodes, which run nothing), one core a pod: the pods' torch
    then runs one thread a process, as `ftjob run` does with OMP_NUM_THREADS=1 -- the
    losses are equal to the last bit only at equal thread counts."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    doc["spec"]["image"] = "localhost/ftjob-trainer:test"
    doc["spec"]["scheduling"] = {"nodeSelector": {NODE_LABEL: "true"}}
    doc["spec"]["resources"]["cpu"] = 1
    return doc


@pytest.fixture(scope="module")
def reference(volume: Path, tmp_path_factory) -> SimpleNamespace:
    """`ftjob run` of the same job file: the losses to equal, and the time to compare with."""
    return losses.reference(tiny(), volume, tmp_path_factory.mktemp("ftjob-run") / "tiny")


def status_of(plane: Plane, name: str) -> dict:
    return (plane.get("ftj", name, NAMESPACE) or {}).get("status") or {}


def host_dir(volume: Path, plane: Plane, name: str) -> Path:
    return losses.host_dir(volume, plane, NAMESPACE, name)


def finished(plane: Plane, name: str) -> dict:
    def done():
        s = status_of(plane, name)
        return s.get("phase") in ("Succeeded", "Failed") and s

    status = plane.wait(done, hangs.RUN, f"{name} to finish")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    return status


def placed(plane: Plane, name: str) -> list[dict]:
    def check():
        pods = [p for p in plane.get("pods", namespace=NAMESPACE) or []
                if p["metadata"]["labels"].get(render.LABEL_JOB) == name]  # fmt: skip
        return len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods) and pods

    return plane.wait(check, hangs.FLOOR, f"{name}'s gang placed")


def test_apply_trains_on_podman_nodes_to_an_export_that_loads(operator, volume, reference):
    from transformers import AutoModelForCausalLM

    plane = operator.plane
    start = time.monotonic()
    # As a user would: kubectl apply -f the job file.
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(reference.file))
    assert {p["spec"]["nodeName"] for p in placed(plane, "tiny")} <= set(NODES)

    def training():
        s = status_of(plane, "tiny")
        return s.get("phase") == "Running" and (s.get("progress") or {}).get("loss") and s

    plane.wait(training, hangs.RUN, "a loss in the status while it runs")
    table = plane.kubectl("get", "ftj", "tiny", "-n", NAMESPACE).stdout
    assert "Running" in table, table
    print("\n" + table)
    status = finished(plane, "tiny")
    seconds = time.monotonic() - start
    assert "Succeeded" in plane.kubectl("get", "ftj", "tiny", "-n", NAMESPACE).stdout
    export = volume / status["modelPath"].removeprefix(render.SHARED_DIR + "/")
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.num_parameters() > 0
    assert losses.losses(host_dir(volume, plane, "tiny")) == reference.losses
    print(f"apply -> Succeeded {seconds:.1f} s; ftjob run {reference.seconds:.1f} s")


def trainer_container(job: str, rank: int) -> str:
    """The podman container running node ``rank`` of ``job`` (as podman_node names it)."""
    names = node_containers(f"-{NAMESPACE}-{job}-node-{rank}-", running=True)
    assert len(names) == 1, names
    return names[0]


def progress(folder: Path) -> dict:
    try:
        return json.loads((folder / "progress.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return {}


def checkpointed(plane: Plane, folder: Path, step: int, resumed: bool = False) -> dict:
    """progress.json once a checkpoint at ``step`` or later is committed (``resumed``: by a
    gang that resumed), before the last step."""

    def check():
        p = progress(folder)
        return (
            (p.get("lastCheckpointStep") or 0) >= step
            and (p.get("resumedFrom") or not resumed)
            and p
        )

    p = plane.wait(check, hangs.RUN, f"a checkpoint at step {step}")
    assert p["step"] < p["totalSteps"], f"it ended before the fault: {p}"
    return p


def evict(plane: Plane, pod: str) -> None:
    """What `kubectl drain` does to a pod: the Eviction API (the pod gets the condition
    DisruptionTarget, then is deleted gracefully: SIGTERM, the grace period)."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": pod, "namespace": NAMESPACE}}  # fmt: skip
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/eviction"
    plane.kubectl("create", "--raw", path, "-f", "-", input=json.dumps(body))


def resumed_step(folder: Path) -> int:
    resumed = progress(folder)["resumedFrom"]  # .../checkpoints/step-00000040
    return int(resumed.rsplit("-", 1)[-1])


def test_a_killed_container_then_an_evicted_pod_each_get_a_gang_that_resumes_exactly(
    operator, volume, reference
):
    """One job, two faults. A container SIGKILLed after the first checkpoint: its pod fails
    (137) and, a dead pod being past restarting in place, the operator replaces the gang.
    Then a pod of that new gang evicted (the Eviction API: SIGTERM, the grace period): the
    gang is replaced again. Each new gang resumes from a checkpoint, and every logged loss
    equals the uninterrupted run's. (One job for both: a tiny run less in CI.)"""
    plane = operator.plane
    plane.apply(tiny("faults"))
    placed(plane, "faults")
    folder = host_dir(volume, plane, "faults")
    checkpointed(plane, folder, 20)
    kill = [*PODMAN, "kill", "-s", "KILL", trainer_container("faults", 1)]
    subprocess.run(kill, check=True, capture_output=True, timeout=120)
    plane.wait(lambda: status_of(plane, "faults").get("attempt") == 1, hangs.FLOOR, "attempt 1")
    failure = status_of(plane, "faults")["failure"]
    assert failure["exitCode"] == 137 and failure["rank"] == 1, failure
    signalled = checkpointed(plane, folder, 40, resumed=True)
    assert 20 <= resumed_step(folder) < 40, progress(folder)
    evict(plane, "faults-node-0")
    status = finished(plane, "faults")
    # The API server marks the evicted pod (DisruptionTarget, EvictionByEvictionAPI): the
    # operator calls it Preempted and spends no budget on it; only the SIGKILL above counted.
    assert status["attempt"] == 2 and status["failure"]["pod"] == "faults-node-0", status
    assert status["failure"]["reason"] == "Preempted" and status["restarts"] == 1, status
    print(
        f"\nevicted at step {signalled['step']}, resumed from {resumed_step(folder)}; "
        f"restarts {status['restarts']}, the eviction called {status['failure']['reason']}"
    )
    assert resumed_step(folder) >= 40, progress(folder)
    assert losses.losses(folder) == reference.losses


def test_a_job_deleted_in_start_up_frees_its_nodes_in_seconds(operator, volume):
    """Deleted while its trainers start (the agent, PID 1 of its container, in the rendezvous
    or loading): the pods end within seconds of the SIGTERM, not at the end of the 60 s grace
    period (issue 52, point 5)."""
    plane = operator.plane
    job = tiny("gone")
    # Three nodes on two podman nodes: the third pod stays Pending (one pod a node), so the two
    # agents that run wait in the rendezvous, workers not started, as a gang whose last pod is
    # still pulling its image does.
    job["spec"]["resources"]["nodes"] = 3
    plane.apply(job)
    plane.wait(lambda: len(node_containers(f"-{NAMESPACE}-gone-node-", running=True)) >= 2,
               hangs.FLOOR,
               "both trainer containers running")  # fmt: skip
    time.sleep(10)  # the agents are past their imports, in the rendezvous
    started = time.monotonic()
    plane.kubectl("delete", "ftj", "gone", "-n", NAMESPACE, "--wait=false")

    def gone():
        return not [p for p in plane.get("pods", namespace=NAMESPACE) or []
                    if p["metadata"]["labels"].get(render.LABEL_JOB) == "gone"]  # fmt: skip

    plane.wait(gone, 90, "the deleted job's pods to go")
    took = time.monotonic() - started
    print(f"\ndeleted in start-up: pods gone {took:.1f} s after the delete (grace 60 s)")
    assert took < 30, took


def events_of(plane: Plane, name: str, reason: str) -> list[dict]:
    found = json.loads(plane.kubectl("get", "events", "-n", NAMESPACE, "-o", "json").stdout)
    return [e for e in found["items"]
            if e["involvedObject"].get("name") == name and e["reason"] == reason]  # fmt: skip


def test_an_image_that_does_not_exist_edited_to_the_built_one_trains_as_a_new_gang(operator):
    """The podman node cannot create a container from an image it does not have (as a kubelet
    says CreateContainerError or ErrImagePull): the job says so, and `kubectl apply` of the
    job with the right image replaces that gang, which never ran, by one that trains to the
    end; no restart budget is spent (issue 52, point 1)."""
    plane = operator.plane
    job = tiny("retag")
    good = job["spec"]["image"]
    job["spec"]["image"] = good.rsplit(":", 1)[0] + ":no-such-tag"
    plane.apply(job)

    def cannot_start():
        cond = next((c for c in status_of(plane, "retag").get("conditions", [])
                     if c["type"] == "Running"), {})  # fmt: skip
        return cond.get("reason") == "CreateContainerError" and cond

    cond = plane.wait(cannot_start, hangs.FLOOR, "the gang to say CreateContainerError")
    assert "no-such-tag" in cond["message"], cond
    job["spec"]["image"] = good
    plane.apply(job)
    status = finished(plane, "retag")
    assert status["attempt"] == 1 and status["restarts"] == 0, status
    assert status["image"] == good, status
    [event] = events_of(plane, "retag", "SpecChanged")
    assert event["type"] == "Normal", event
    assert f"(image {good.rsplit(':', 1)[0]}:no-such-tag -> {good})" in event["message"], event


def test_a_pod_deleted_mid_run_is_preempted_naming_the_step_it_saved(operator, volume, reference):
    """`kubectl delete pod` while the gang trains: the deleted pod's trainer saves at the
    SIGTERM and says so in its record; the operator calls it Preempted, not Lost (no restart
    budget spent), its Event names the step saved, and the next gang resumes from that step to
    the same losses as the uninterrupted run (issue 52, point 4)."""
    plane = operator.plane
    plane.apply(tiny("deleted"))
    placed(plane, "deleted")
    folder = host_dir(volume, plane, "deleted")
    checkpointed(plane, folder, 20)  # past the first checkpoint, before the end
    plane.kubectl("delete", "pod", "deleted-node-1", "-n", NAMESPACE, "--wait=false")
    status = finished(plane, "deleted")
    failure = status["failure"]
    assert failure["reason"] == "Preempted" and "the pod was deleted" in failure["message"], status
    assert status["attempt"] == 1 and status["restarts"] == 0, status
    saved = resumed_step(folder)
    [event] = events_of(plane, "deleted", "Preempted")
    message = event["message"]
    assert f"after step {saved}" in message and "Lost" not in message, message
    print(f"\ndeleted pod: {message}")
    assert losses.losses(folder) == reference.losses


def test_a_budget_reached_stops_at_a_checkpoint_and_raised_resumes_to_the_same_losses(
    operator, volume, reference
):
    """A real run stopped by its budget (issue 56, point 5): the CPU job spends node-hours
    (its pods' running time; it has no GPU-hours), and a budget below what it has spent, set
    once it passed its first checkpoint, stops the gang as a preemption does: SIGTERM, a
    checkpoint at the next step boundary (no step lost), phase Stopped with reason
    BudgetReached and the step. The budget raised, the next gang resumes from that checkpoint
    and ends Succeeded with every logged loss equal to the uninterrupted run's."""
    plane = operator.plane
    job = tiny("budget")
    job["spec"]["budget"] = {"nodeHours": 1}
    plane.apply(job)
    placed(plane, "budget")
    folder = host_dir(volume, plane, "budget")
    checkpointed(plane, folder, 20)
    plane.kubectl("patch", "ftj", "budget", "-n", NAMESPACE, "--type=merge",
                  "-p", json.dumps({"spec": {"budget": {"nodeHours": 0.0001}}}))  # fmt: skip

    def stopped():
        s = status_of(plane, "budget")
        pods = [p for p in plane.get("pods", namespace=NAMESPACE) or []
                if p["metadata"]["labels"].get(render.LABEL_JOB) == "budget"]  # fmt: skip
        return s.get("phase") == "Stopped" and not pods and s

    plane.wait(stopped, hangs.RUN, "the budget to stop the gang")
    newest = max(int(p.name.rsplit("-", 1)[1]) for p in (folder / "checkpoints").iterdir())

    def told():  # the stopped pods' termination records, read though the pods are gone
        s = status_of(plane, "budget")
        return (s.get("lastCheckpoint") or {}).get("step") == newest and s

    status = plane.wait(told, hangs.FLOOR, f"status.lastCheckpoint at step {newest}")
    reason = {c["type"]: c for c in status["conditions"]}["Running"]
    assert reason["reason"] == "BudgetReached", status["conditions"]
    step = int(reason["message"].split(" reached at step ")[1].split(":")[0])
    # The SIGTERM's checkpoint, past the first, before the end: the step the gang reached.
    assert 20 < newest < 60 and step == newest == status["progress"]["step"], status
    assert status["cost"]["nodeHours"] >= 0.0001 and status["cost"]["gpuHours"] == 0
    row = plane.kubectl("get", "ftj", "budget", "-n", NAMESPACE).stdout.splitlines()[1].split()
    assert row[1:3] == ["Stopped", "BudgetReached"], row
    plane.kubectl("patch", "ftj", "budget", "-n", NAMESPACE, "--type=merge",
                  "-p", json.dumps({"spec": {"budget": {"nodeHours": 1}}}))  # fmt: skip
    status = finished(plane, "budget")
    assert status["attempt"] == 1 and status["restarts"] == 0, status
    assert resumed_step(folder) == newest, progress(folder)
    assert [a["attempt"] for a in status["cost"]["attempts"]] == [0, 1], status["cost"]
    print(f"\nbudget reached: stopped at step {step}, checkpoint {newest}; resumed from it")
    assert losses.losses(folder) == reference.losses


@pytest.fixture(scope="module")
def pod_store(tmp_path_factory) -> SimpleNamespace:
    """A real S3 server the pods reach: weed listens on every address, and a container on
    podman's bridge reaches the host at the bridge's gateway (the host's address on podman's
    network; 127.0.0.1 in a pod is the pod itself). The example's model and chat data are
    uploaded to buckets models and data."""
    import s3server

    s3server.build()
    server = S3Server(tmp_path_factory.mktemp("s3"), bind="0.0.0.0").up()
    try:
        server.upload("models", ROOT / "examples" / "tiny-model", "tiny-model")
        server.upload("data", ROOT / "examples" / "data" / "tiny-chat.jsonl", "tiny-chat.jsonl")
        net = podman("network", "inspect", "podman", "--format",
                     "{{range .Subnets}}{{.Gateway}}{{end}}")  # fmt: skip
        gateway = net.stdout.strip()
        assert gateway, f"podman's network has no gateway: {net.stderr}"
        port = server.vars["S3_PORT"]
        yield SimpleNamespace(server=server, endpoint=f"http://{gateway}:{port}")
    finally:
        server.down()


def podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=120)


def s3_job(plane: Plane, store: SimpleNamespace, name: str, keys: tuple[str, str]) -> dict:
    """tiny() with its model and data on the store, the key pair in a Secret it names, the
    export pushed to s3://exports/<name>; a short run (the download and the upload are what
    it tests)."""
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": f"{name}-s3", "namespace": NAMESPACE},
              "stringData": {"id": keys[0], "secret": keys[1]}}  # fmt: skip
    plane.apply(secret)
    job = tiny(name)
    job["spec"]["model"]["source"] = "s3://models/tiny-model"
    job["spec"]["dataset"]["source"] = "s3://data/tiny-chat.jsonl"
    job["spec"]["training"] |= {"maxSteps": 10, "evalEvery": 10}
    job["spec"]["output"] = {"push": [f"s3://exports/{name}"]}
    job["spec"]["storage"] = {"s3": {
        "endpoint": store.endpoint, "region": "us-east-1",
        "accessKeyId": {"name": f"{name}-s3", "key": "id"},
        "secretAccessKey": {"name": f"{name}-s3", "key": "secret"}}}  # fmt: skip
    return job


def test_a_job_from_s3_through_the_operator_exports_to_s3_and_the_export_loads(
    operator, volume, pod_store, tmp_path
):
    """The pods get the job's endpoint and region as env and the Secret's keys as
    secretKeyRefs (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, as the SDKs read them); rank 0
    downloads the model and data into the volume's cache, both ranks train, the export goes
    up to the bucket, and what is there loads with from_pretrained."""
    from transformers import AutoModelForCausalLM

    from ftjob.trainer.data import s3

    plane, server = operator.plane, pod_store.server
    admin = server.env("admin")
    plane.apply(s3_job(plane, pod_store, "s3job", (admin["AWS_ACCESS_KEY_ID"],
                                                   admin["AWS_SECRET_ACCESS_KEY"])))  # fmt: skip
    pod = placed(plane, "s3job")[0]
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == pod_store.endpoint
    assert env["AWS_REGION"]["value"] == "us-east-1"
    ref = env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "s3job-s3", "key": "secret"}, ref  # the secret never in the pod spec
    status = finished(plane, "s3job")
    assert status["progress"]["pushedTo"] == ["s3://exports/s3job"], status["progress"]
    assert list((volume / "s3-cache").glob("*/.complete")), "the download is not in the cache"
    # What the bucket holds, fetched from it as any reader would, loads.
    with pytest.MonkeyPatch.context() as mp:
        for k, v in admin.items():
            mp.setenv(k, v)
        export, objects = s3.download("s3://exports/s3job", tmp_path, lambda m: None)
    assert {"config.json", "model.safetensors", "README.md", "ftjob-upload.json"} <= {
        o.name for o in objects
    }
    assert AutoModelForCausalLM.from_pretrained(export).num_parameters() > 0


def test_a_key_pair_the_store_refuses_fails_the_job_once_as_bad_model(operator, pod_store):
    """The same job with a key pair the store does not know: rank 0's download is refused,
    the job fails as BadModel naming the source and the cause, and no second gang starts."""
    plane = operator.plane
    plane.apply(s3_job(plane, pod_store, "s3refused", ("AKIAFTJOBSTRANGER", "not-known")))
    status = plane.wait(lambda: (s := status_of(plane, "s3refused")).get("phase") == "Failed"
                        and s, hangs.RUN, "s3refused to fail")  # fmt: skip
    failure = status["failure"]
    assert failure["reason"] == "BadModel", failure
    assert "s3://models/tiny-model" in failure["message"], failure
    assert "refused the credentials" in failure["message"], failure
    assert status["restarts"] == 0 and status["attempt"] == 0, status
