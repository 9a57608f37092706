"""Real nodes (`scripts/k8s.sh up DIR --nodes 1`, scripts/nodes.sh): kubelet v1.37.2 and
containerd run the pods the real scheduler binds to them. A pod runs to Completed and
`kubectl logs` shows what it printed (the apiserver reaches the kubelet); a pod whose memory
outgrows its limit is killed by the kernel and reported OOMKilled, while the same program under
a larger limit finishes; and `down` leaves no process, mount, network namespace, veth, bridge
or cgroup of the node behind.

    python -m pytest tests/cluster/test_real_nodes.py -q   # root, containerd, podman, go
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import envs
import hangs
import pytest
from plane import Plane, build

pytestmark = pytest.mark.timeout(1800)  # the first test also waits for the image build
NODE = "real-node-0"


@pytest.fixture(scope="module")
def real(images, tmp_path_factory):
    """A plane of its own with one real node whose containerd holds the operator image (it has
    a shell and Python: enough for these pods)."""
    build()
    for tool in ("containerd", "ctr"):
        if not shutil.which(tool):
            envs.unavailable(f"{tool} is not installed: bash scripts/podman-host.sh")
    p = Plane(tmp_path_factory.mktemp("real-nodes"), "--gpu-nodes", "0", "--nodes", "1",
              "--node-image", images.operator)  # fmt: skip
    p.up()
    try:
        yield p, images.operator
    finally:
        p.down()


def pod(name: str, image: str, command: list[str], memory: str = "128Mi") -> dict:
    limits = {"memory": memory, "cpu": "500m"}
    resources = {"limits": limits, "requests": limits}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "c", "image": image, "command": command, "resources": resources}
            ],
        },
    }


def finished(plane: Plane, name: str) -> dict:
    """The pod once the kubelet has reported it Succeeded or Failed."""

    def done():
        got = plane.get("pod", name)
        return got if got and got["status"].get("phase") in ("Succeeded", "Failed") else None

    return plane.wait(done, hangs.FLOOR * 2, f"pod {name} finished")


def test_a_pod_runs_to_completed_and_kubectl_logs_shows_its_output(real):
    plane, image = real
    script = "echo hello from $(hostname); cat /proc/self/cgroup"
    plane.apply(pod("hello", image, ["sh", "-c", script]))
    got = finished(plane, "hello")
    assert got["spec"]["nodeName"] == NODE
    assert got["status"]["phase"] == "Succeeded"
    assert got["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    logs = plane.kubectl("logs", "hello").stdout
    assert "hello from hello" in logs
    # The container sits in the kubelet's pod cgroup under the node's own cgroup root.
    uid = got["metadata"]["uid"]
    assert re.search(rf"memory:/ftjob-\w+-{NODE}/kubepods/pod{uid}/\w+", logs), logs


# 192 MiB, resident at once (bytearray writes its zeroes).
HOG = "print('allocating', flush=True); b = bytearray(192 << 20); print('survived', flush=True)"


def test_a_pod_over_its_memory_limit_is_oomkilled_by_the_kernel(real):
    plane, image = real
    plane.apply(pod("hog", image, ["python3", "-c", HOG], memory="64Mi"))
    plane.apply(pod("fits", image, ["python3", "-c", HOG], memory="512Mi"))
    hog, fits = finished(plane, "hog"), finished(plane, "fits")
    ended = hog["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (hog["status"]["phase"], ended["reason"], ended["exitCode"]) == (
        "Failed", "OOMKilled", 137)  # fmt: skip
    assert plane.kubectl("logs", "hog").stdout.split() == ["allocating"]
    # The same program with room for its 192 MiB: the 64 MiB limit, not the program, killed it.
    assert fits["status"]["phase"] == "Succeeded"
    assert plane.kubectl("logs", "fits").stdout.split() == ["allocating", "survived"]


def sandbox_netns(node: Path) -> list[str]:
    """The network namespaces (bind-mounted files) of the node's sandboxes, as containerd
    holds them (a container's own spec names its sandbox's process instead)."""
    ctr = ["ctr", "-a", str(node / "containerd.sock"), "-n", "k8s.io"]
    found = []
    for c in run(*ctr, "containers", "list", "-q").split():
        spec = json.loads(run(*ctr, "containers", "info", c))["Spec"]
        found += [n["path"] for n in spec["linux"]["namespaces"]
                  if n["type"] == "network" and "/netns/" in n.get("path", "")]  # fmt: skip
    return found


def run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


def traces(root: Path, netns: list[str], bridge: str, cgroup: str) -> dict[str, list[str]]:
    """What of a node exists on this machine now: processes and mounts that name its folder
    (``root``), its sandboxes' network namespaces, its bridge and the veths on it, its cgroups
    in every hierarchy."""
    procs = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(root) in cmdline.read_bytes().decode(errors="replace"):
                procs.append(cmdline.parent.name)
        except OSError:  # the process ended while we looked
            pass
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if str(root) in line or line.split()[4] in netns]  # fmt: skip
    links = json.loads(run("ip", "-j", "link", "show"))
    return {
        "processes": procs,
        "mounts": mounts,
        "netns": [p for p in netns if Path(p).exists()],
        "links": [x["ifname"] for x in links if bridge in (x["ifname"], x.get("master"))],
        "cgroups": [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{cgroup}")],
    }


def test_down_leaves_nothing_of_the_node(real):
    plane, image = real
    plane.apply(pod("sleeper", image, ["sleep", "3600"]))
    plane.kubectl("wait", "--for=condition=Ready", "pod/sleeper", "--timeout=120s")
    node = plane.dir / "nodes" / NODE
    bridge = "ftjn" + (node / "subnet").read_text().strip()
    cgroup = re.search(r"^cgroupRoot: /(\S+)", (node / "kubelet.yaml").read_text(), re.M)[1]
    args = (plane.dir, sandbox_netns(node), bridge, cgroup)
    before = traces(*args)
    # What the checks look for is there while the node runs (so that their emptiness after
    # means something): kubelet, containerd and the shim, the sandbox's netns and veth, cgroups.
    assert all(before.values()), before
    plane.down()
    assert traces(*args) == {k: [] for k in before}
