"""The operator's children, rendered purely: valid Kubernetes objects wired for torchrun."""

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ftjob.api import manifest
from ftjob.api.jobspec import parse_resource
from ftjob.cli import commands as cli
from ftjob.operator import render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
UID = "0f3c9a52-7d4e-4b1a-9c55-3f2b8e1d6a70"
DESIGN_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/managed-by", "ftjob.dev/job-name")


def load(name: str, **patch):
    doc = manifest.load(ROOT / "examples" / name)[0]
    for dotted, value in patch.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return parse_resource(doc)


def env_of(pod: dict) -> dict:
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]
    }


@pytest.mark.parametrize("version", ["1.30", "1.37"])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_child_of_every_example_is_valid_strictly(path, version):
    name, spec = parse_resource(manifest.load(path)[0])
    objs = render.children(name, "team-a", spec, attempt=2, uid=UID)
    nodes = spec.resources.nodes
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "PodGroup"] + ["Pod"] * nodes
    if version < "1.37":  # no PodGroup API: the operator renders the pods on their own
        objs = objs[:2] + render.pods(name, "team-a", spec, 2, UID)
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_a_gang_is_one_pod_group_its_pods_name():
    name, spec = load("llama2-70b-full.yaml")
    group = render.pod_group(name, "ns", spec, 3, UID)
    assert group["metadata"]["name"] == f"{name}-a3"
    assert group["metadata"]["ownerReferences"][0]["uid"] == UID  # goes with the job
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": spec.resources.nodes}}}
    pods = render.pods(name, "ns", spec, 3, UID, grouped=True)
    assert {p["spec"]["schedulingGroup"]["podGroupName"] for p in pods} == {f"{name}-a3"}
    assert all("schedulingGroup" not in p["spec"] for p in render.pods(name, "ns", spec, 3, UID))
    # Placed only when the group's priority is its pods' (the scheduler refuses a mismatch).
    name, spec = load("llama3-8b-lora-dpo.yaml")
    spec.scheduling.priority_class_name = "research-high"
    group, pod = render.pod_group(name, "ns", spec, 0), render.pods(name, "ns", spec, 0)[0]
    assert group["spec"]["priorityClassName"] == pod["spec"]["priorityClassName"] == "research-high"


def test_strict_validation_catches_a_misspelt_field():
    name, spec = load("tiny.yaml")
    pod = render.pod(name, "default", spec, 0, 0, UID)
    pod["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, "1.37", strict=True)


def test_names_labels_and_owner_references_are_deterministic():
    name, spec = load("llama3-8b-lora-efa.yaml")
    first = render.children(name, "ns", spec, attempt=1, uid=UID)
    assert first == render.children(name, "ns", spec, attempt=1, uid=UID)
    names = [o["metadata"]["name"] for o in first]
    assert names == [f"{name}-spec", name, f"{name}-a1", f"{name}-node-0", f"{name}-node-1"]
    for obj in first:
        meta = obj["metadata"]
        assert all(meta["labels"][k] for k in DESIGN_LABELS)
        assert meta["labels"]["ftjob.dev/job-name"] == name
        (ref,) = meta["ownerReferences"]
        assert ref["uid"] == UID and ref["controller"] and ref["kind"] == "FineTuneJob"
    for rank, pod in enumerate(first[3:]):
        assert pod["metadata"]["labels"]["ftjob.dev/node-rank"] == str(rank)
        assert pod["metadata"]["labels"]["ftjob.dev/attempt"] == "1"


def test_headless_service_gives_every_pod_a_rendezvous_dns_name():
    name, spec = load("llama3-8b-lora-efa.yaml")
    svc, pods = render.service(name, "ns", spec, UID), render.pods(name, "ns", spec, 0, UID)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {"ftjob.dev/job-name": name}
    for pod in pods:
        assert pod["spec"]["subdomain"] == name
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]
    master = env_of(pods[1])["PET_MASTER_ADDR"]
    assert master == f"{pods[0]['spec']['hostname']}.{name}.ns.svc"
    # Each node's agent is reached at its own name through the same Service (node 0's hosts
    # the rendezvous and the workers' store), not at whatever getfqdn() says in the pod.
    for pod in pods:
        assert env_of(pod)["PET_LOCAL_ADDR"] == f"{pod['spec']['hostname']}.{name}.ns.svc"


def test_torchrun_reads_its_wiring_from_pet_variables():
    name, spec = load("llama3-8b-lora-efa.yaml")
    envs = [env_of(p) for p in render.pods(name, "ns", spec, 3, UID)]
    assert [e["PET_NODE_RANK"] for e in envs] == ["0", "1"]
    for e in envs:
        assert e["PET_NNODES"] == "2" and e["PET_NPROC_PER_NODE"] == "8"
        assert e["PET_MASTER_PORT"] == "29500"
    assert envs[0]["PET_RDZV_ID"] == envs[1]["PET_RDZV_ID"]
    next_attempt = env_of(render.pod(name, "ns", spec, 0, 4, UID))
    assert next_attempt["PET_RDZV_ID"] != envs[0]["PET_RDZV_ID"]


def test_the_trainer_reads_the_same_spec_from_the_config_map(tmp_path):
    name, spec = load("llama3-8b-lora-efa.yaml")
    cm = render.config_map(name, "ns", spec, UID)
    doc = json.loads(cm["data"][render.SPEC_FILE])
    assert parse_resource(doc) == (name, spec)
    pod = render.pod(name, "ns", spec, 0, 0, UID)
    (spec_volume,) = [v for v in pod["spec"]["volumes"] if v.get("configMap")]
    assert spec_volume["configMap"]["name"] == cm["metadata"]["name"]
    assert pod["spec"]["containers"][0]["command"][-1] == f"{render.SPEC_DIR}/{render.SPEC_FILE}"


def test_efa_gets_devices_and_libfabric_settings_and_adds_no_capability():
    name, spec = load("llama3-8b-lora-efa.yaml")
    pod = render.pod(name, "ns", spec, 0, 0, UID)
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "4"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"] == c["resources"]["limits"]  # Guaranteed QoS
    env = env_of(pod)
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["FI_EFA_FORK_SAFE"] == "1" and env["NCCL_SOCKET_IFNAME"]
    # IPC_LOCK would only reach a non-root container's bounding set: the memlock limit is the
    # node runtime's (docs/install.md), and the pod asks nothing that needs "privileged".
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_every_fabric_gets_nccl_error_handling_and_its_own_settings():
    base = dict(fabric="tcp")
    cases = {
        "tcp": ("llama31-70b-qlora.yaml", base),
        "infiniband": ("llama31-70b-qlora.yaml", dict(fabric="infiniband", socketInterface="ib0")),
    }
    for fabric, (example, network) in cases.items():
        name, spec = load(example, network=network)
        pod = render.pod(name, "ns", spec, 0, 0, UID)
        env = env_of(pod)
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_DEBUG"] == "WARN"
        assert "FI_PROVIDER" not in env
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert "vpc.amazonaws.com/efa" not in limits
        caps = pod["spec"]["containers"][0]["securityContext"]["capabilities"]
        assert caps == {"drop": ["ALL"]}  # RDMA too: memlock is the runtime's limit
        if fabric == "tcp":
            assert env["NCCL_IB_DISABLE"] == "1"
        else:
            assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_user_nccl_env_wins_and_user_env_is_passed():
    name, spec = load(
        "tiny.yaml",
        network={"ncclEnv": {"NCCL_DEBUG": "INFO"}},
        env=[{"name": "WANDB_MODE", "value": "offline"}],
    )
    env = env_of(render.pod(name, "ns", spec, 0, 0, UID))
    assert env["NCCL_DEBUG"] == "INFO" and env["WANDB_MODE"] == "offline"


def test_pods_are_locked_down_and_secrets_travel_only_as_references():
    name, spec = load("llama2-70b-full.yaml")
    pod = render.pod(name, "ns", spec, 1, 0, UID)
    ps, c = pod["spec"], pod["spec"]["containers"][0]
    assert ps["automountServiceAccountToken"] is False and ps["restartPolicy"] == "Never"
    assert ps["securityContext"]["runAsNonRoot"] and ps["securityContext"]["runAsUser"] != 0
    assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and "ALL" in sc["capabilities"]["drop"]
    (token,) = [e for e in c["env"] if e["name"] == "HF_TOKEN"]
    assert token == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
    }
    shm = {v["name"]: v for v in ps["volumes"]}["dshm"]
    assert shm["emptyDir"] == {"medium": "Memory"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    shared = {v["name"]: v for v in ps["volumes"]}["shared"]
    assert shared["persistentVolumeClaim"] == {"claimName": "shared-fs"}


def test_a_variable_from_a_secret_and_a_service_account_reach_the_pod_as_names():
    ref = {"secretKeyRef": {"name": "team-tokens", "key": "api"}}
    name, spec = load(
        "tiny.yaml",
        env=[{"name": "TEAM_API_TOKEN", "valueFrom": ref}, {"name": "MODE", "value": "x"}],
        serviceAccountName="trainer-irsa",
    )
    pod = render.pod(name, "ns", spec, 0, 0, UID)
    env = env_of(pod)
    assert env["TEAM_API_TOKEN"] == ref and env["MODE"] == "x"
    # The trainer masks these values: told the names, never the values.
    assert env["FTJOB_SECRET_ENV"] == "TEAM_API_TOKEN"
    assert pod["spec"]["serviceAccountName"] == "trainer-irsa"
    assert pod["spec"]["automountServiceAccountToken"] is False
    config = render.config_map(name, "ns", spec, UID)
    assert "team-tokens" in json.dumps(config) and "valueFrom" in json.dumps(config)


def test_a_variable_has_a_value_or_a_secret_not_both():
    both = {"name": "T", "value": "v", "valueFrom": {"secretKeyRef": {"name": "s"}}}
    with pytest.raises(ValueError, match=r"spec.env\[0\].valueFrom: set value or valueFrom"):
        load("tiny.yaml", env=[both])


def test_kueue_admits_each_attempt_as_one_pod_group():
    name, spec = load("llama2-70b-full.yaml")
    a0 = render.pods(name, "ns", spec, 0, UID)
    a1 = render.pods(name, "ns", spec, 1, UID)
    for pod in a0:
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
        # the group ends with its gang: Kueue lets its pods go instead of awaiting replacements
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/retriable-in-group"] == "false"
    groups = {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in a0 + a1}
    assert len(groups) == 2  # a new gang is a new group
    name, spec = load("llama3-8b-lora-efa.yaml")
    pod = render.pod(name, "ns", spec, 0, 0, UID)
    assert not any(k.startswith("kueue") for k in pod["metadata"]["labels"])
    assert not any(k.startswith("kueue") for k in pod["metadata"]["annotations"])
    assert "kueue.x-k8s.io/podset-required-topology" not in a0[0]["metadata"]["annotations"]


def test_a_gang_asking_for_one_topology_domain_tells_kueue_on_every_pod():
    rack = "cloud.provider.com/topology-rack"
    name, spec = load("llama2-70b-full.yaml", **{"scheduling.topology": rack})
    for pod in render.pods(name, "ns", spec, 0, UID):
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == rack
    with pytest.raises(Exception, match="set queue"):
        load("llama3-8b-lora-efa.yaml", **{"scheduling.topology": rack})


def test_scheduling_constraints_reach_the_pod():
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    }
    name, spec = load(
        "tiny.yaml",
        scheduling={
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": affinity,
            "priorityClassName": "high",
            "schedulerName": "volcano",
        },
    )
    ps = render.pod(name, "ns", spec, 0, 0, UID)["spec"]
    # The spec's affinity as given, and the gang's one pod per node beside it.
    assert ps["nodeSelector"] == {"pool": "gpu"}
    assert ps["affinity"]["nodeAffinity"] == affinity["nodeAffinity"]
    assert set(ps["affinity"]) == {"nodeAffinity", "podAntiAffinity"}
    assert ps["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert ps["priorityClassName"] == "high" and ps["schedulerName"] == "volcano"
    kubernetes_validate.validate(render.pod(name, "ns", spec, 0, 0, UID), "1.30", strict=True)


def test_cpu_job_requests_no_gpus():
    name, spec = load("tiny.yaml")
    pod = render.pod(name, "ns", spec, 0, 0, UID)
    assert "resources" not in pod["spec"]["containers"][0]
    assert env_of(pod)["PET_NPROC_PER_NODE"] == "1"


def test_ftjob_render_children_prints_the_objects(capsys):
    assert cli.main(["render", "--children", "-n", "ml", str(ROOT / "examples" / "tiny.yaml")]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    kinds = ["FineTuneJob", "ConfigMap", "Service", "PodGroup", "Pod", "Pod"]
    assert [d["kind"] for d in docs] == kinds
    assert {d["metadata"]["namespace"] for d in docs} == {"ml"}


def test_validate_warns_which_image_a_job_without_one_gets(capsys, tmp_path):
    """The walkthrough's sample names no image: valid (a cluster with a default image runs
    it), but validate says the pods get the operator's default or an unpullable placeholder,
    and names both fixes. A job that names its image gets no warning."""
    sample = ROOT / "manifests" / "samples" / "llama3-8b-lora-efa.yaml"
    assert cli.main(["validate", str(sample)]) == 0
    out = capsys.readouterr().out
    assert ": valid -- " in out
    (warning,) = [line for line in out.splitlines() if line.startswith("warning (")]
    assert warning.startswith("warning (llama3-8b-guanaco): spec.image is unset")
    assert "--default-image" in warning and "trainer.defaultImage" in warning
    assert f"placeholder {render.DEFAULT_IMAGE}, which is not published" in warning
    named = tmp_path / "named.yaml"
    text = sample.read_text().replace("\nspec:\n", "\nspec:\n  image: registry.example.com/t:1\n")
    named.write_text(text)
    assert cli.main(["validate", str(named)]) == 0
    out = capsys.readouterr().out
    assert ": valid -- " in out and "warning" not in out


def test_spec_image_wins_over_the_operators_default():
    _, spec = load("tiny.yaml")
    assert spec.image is None  # not defaulted by the schema: the operator's default applies
    pods = render.pods("j", "ns", spec, 0, UID, default_image="registry.example.com/t:2")
    assert {p["spec"]["containers"][0]["image"] for p in pods} == {"registry.example.com/t:2"}
    assert render.pods("j", "ns", spec, 0, UID)[0]["spec"]["containers"][0]["image"] == (
        render.DEFAULT_IMAGE
    )
    _, named = load("tiny.yaml", image="registry.example.com/t:1")
    pod = render.pod("j", "ns", named, 0, 0, UID, default_image="registry.example.com/t:2")
    assert pod["spec"]["containers"][0]["image"] == "registry.example.com/t:1"


def test_a_gang_of_several_nodes_puts_one_pod_on_each_node():
    """resources.nodes counts nodes: each pod of one attempt repels the others on a node's
    hostname (a hard rule), beside a podAntiAffinity the spec brings; one node needs none.
    tests/cluster/test_real_operator.py shows the real scheduler keeping to it."""
    own = {"labelSelector": {"matchLabels": {"team": "x"}}, "topologyKey": "zone"}
    given = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [own]}}
    name, spec = load("tiny.yaml", **{"scheduling.affinity": given})
    for attempt in (0, 3):
        for pod in render.pods(name, "ns", spec, attempt, UID):
            terms = pod["spec"]["affinity"]["podAntiAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]
            assert terms == [own, {
                "labelSelector": {"matchLabels": {"ftjob.dev/job-name": name,
                                                  "ftjob.dev/attempt": str(attempt)}},
                "topologyKey": "kubernetes.io/hostname",
            }]  # fmt: skip
            assert pod["metadata"]["labels"]["ftjob.dev/attempt"] == str(attempt)
            kubernetes_validate.validate(pod, "1.30", strict=True)
    name, one = load("tiny.yaml", **{"resources.nodes": 1})
    assert "affinity" not in render.pod(name, "ns", one, 0, 0, UID)["spec"]
