"""The trainer pods against the Pod Security Standards, per fabric, as the docs state them.

No library evaluates Pod Security offline (kubernetes-validate checks only the schema), so
:func:`violations` transcribes the Standards' pod-spec rules (kubernetes.io/docs/concepts/
security/pod-security-standards, the checks of k8s.io/pod-security-admission) that a pod
can break; the AppArmor, SELinux, /proc mount, sysctl and Windows checks are written as
"any setting of these fields" where the Standards allow only some values, which is stricter
than admission, never looser. A pod meets the first level (restricted, baseline,
privileged) that reports nothing.
"""

import re
from pathlib import Path

import pytest

from ftjob.api import manifest
from ftjob.api.jobspec import parse_resource
from ftjob.operator import render

ROOT = Path(__file__).resolve().parents[2]
UID = "0f3c9a52-7d4e-4b1a-9c55-3f2b8e1d6a70"

# baseline: "Adding additional capabilities beyond those listed below must be disallowed."
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
LEVELS = ("restricted", "baseline", "privileged")


def _containers(pod_spec: dict) -> list[dict]:
    kinds = ("initContainers", "containers", "ephemeralContainers")
    return [c for kind in kinds for c in pod_spec.get(kind, [])]


def baseline_violations(pod: dict) -> list[str]:
    spec, out = pod["spec"], []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"{field}: true")
    out += [f"volume {v['name']}: hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    if spec.get("securityContext", {}).get("sysctls"):
        out.append("sysctls")
    if spec.get("securityContext", {}).get("seLinuxOptions"):
        out.append("seLinuxOptions")
    if spec.get("securityContext", {}).get("seccompProfile", {}).get("type") == "Unconfined":
        out.append("seccompProfile: Unconfined")
    for c in _containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if added := set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES:
            out.append(f"{c['name']}: adds capabilities {sorted(added)}")
        out += [f"{c['name']}: hostPort" for p in c.get("ports", []) if p.get("hostPort")]
        for field in ("seLinuxOptions", "appArmorProfile", "windowsOptions"):
            if sc.get(field):
                out.append(f"{c['name']}: {field}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{c['name']}: procMount")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            out.append(f"{c['name']}: seccompProfile Unconfined")
    return out


def restricted_violations(pod: dict) -> list[str]:
    spec, out = pod["spec"], baseline_violations(pod)
    psc = spec.get("securityContext", {})
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds)}")
    for c in _containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation is not false")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            out.append(f"{c['name']}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{c['name']}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{c['name']}: capabilities do not drop ALL")
        if added := set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: adds capabilities {sorted(added)}")
    return out


def level(pod: dict) -> str:
    """The strictest Pod Security level the pod meets."""
    if not restricted_violations(pod):
        return "restricted"
    return "baseline" if not baseline_violations(pod) else "privileged"


def pods_for(fabric: str, example: str) -> list[dict]:
    doc = manifest.load(ROOT / "examples" / example)[0]
    network = doc["spec"].setdefault("network", {})
    network["fabric"] = fabric
    if fabric == "efa":
        network.setdefault("efaDevicesPerNode", 4)
    else:
        network.pop("efaDevicesPerNode", None)
    name, spec = parse_resource(doc)
    return render.pods(name, "team-a", spec, 0, UID)


def documented_levels(doc: str) -> dict[str, str]:
    """The docs' table: | `fabric` | `level` |."""
    text = (ROOT / "docs" / doc).read_text()
    rows = re.findall(r"^\s*\| `(tcp|efa|infiniband)` \| `(\w+)` \|\s*$", text, re.MULTILINE)
    return dict(rows)


@pytest.mark.parametrize("doc", ["install.md", "operator.md"])
def test_the_docs_state_the_level_the_pods_of_each_fabric_meet(doc):
    documented = documented_levels(doc)
    assert sorted(documented) == ["efa", "infiniband", "tcp"], f"docs/{doc} lacks the table"
    gpu_examples = ["llama3-8b-lora-efa.yaml", "llama2-70b-full.yaml", "llama3-8b-full-1gpu.yaml"]
    for fabric, want in documented.items():
        cpu = ["tiny.yaml"] if fabric == "tcp" else []  # RDMA fabrics need GPUs
        for example in gpu_examples + cpu:
            got = {level(p) for p in pods_for(fabric, example)}
            assert got == {want}, (doc, fabric, example, got)


def test_rdma_pods_meet_restricted_with_their_devices_as_resources():
    """An EFA pod asks its devices of the device plugin (a resource, which no Pod Security
    level looks at) and adds no capability: an added IPC_LOCK would not reach the non-root
    trainer anyway (only the bounding set), so nothing sends the namespace to privileged."""
    for fabric in ("efa", "infiniband"):
        (pod, *_) = pods_for(fabric, "llama3-8b-lora-efa.yaml")
        assert restricted_violations(pod) == [] and baseline_violations(pod) == []
        (c,) = pod["spec"]["containers"]
        assert "add" not in c["securityContext"]["capabilities"]
        assert c["securityContext"]["runAsNonRoot"] is True
    (efa, *_) = pods_for("efa", "llama3-8b-lora-efa.yaml")
    assert efa["spec"]["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == "4"


@pytest.mark.parametrize(
    "change, finding",
    [
        (lambda p: p["spec"].update(hostNetwork=True), "hostNetwork: true"),
        (
            lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
            "volume h: hostPath",
        ),
        (
            lambda p: p["spec"]["containers"][0]["securityContext"].update(privileged=True),
            "trainer: privileged",
        ),
        (
            lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].update(
                add=["NET_RAW"]
            ),
            "trainer: adds capabilities ['NET_RAW']",
        ),
    ],
)
def test_the_checker_catches_what_baseline_forbids(change, finding):
    """The checker is not a rubber stamp: each baseline rule breaks a restricted pod."""
    (pod, *_) = pods_for("tcp", "tiny.yaml")
    assert level(pod) == "restricted"
    change(pod)
    assert finding in baseline_violations(pod) and level(pod) == "privileged"


def test_the_checker_catches_what_only_restricted_forbids():
    (pod, *_) = pods_for("tcp", "tiny.yaml")
    pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    assert level(pod) == "baseline"
