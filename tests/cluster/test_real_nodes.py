"""Real nodes (`scripts/k8s.sh up DIR --nodes 2`, scripts/nodes.sh): kubelet v1.37.2 and
containerd run the pods the real scheduler binds to them. A pod runs to Completed and
`kubectl logs` shows what it printed (the apiserver reaches the kubelet); a pod whose memory
outgrows its limit is killed by the kernel and reported OOMKilled, while the same program under
a larger limit finishes; a pod resolves a headless Service's pod name (hostname + subdomain, as
the operator's gang pods have them) through the cluster's DNS, and a pod on the other node
connects to it by that name; and `down` leaves no process (CoreDNS's included), mount, network
namespace, veth, bridge or cgroup of the nodes behind.

    python -m pytest tests/cluster/test_real_nodes.py -q   # root, containerd, podman, go
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import hangs
import pytest
from plane import Plane

pytestmark = pytest.mark.timeout(1800)  # the first test also waits for the image build
NODE, OTHER = "real-node-0", "real-node-1"


@pytest.fixture(scope="module")
def real(real_nodes, images):
    """The session's two real nodes (tests/cluster/conftest.py; test_real_gang.py ran its gangs
    there first) and the operator image, which has a shell and Python: enough for these pods."""
    return real_nodes, images.operator


def pod(name: str, image: str, command: list[str], memory: str = "128Mi", **spec) -> dict:
    """A pod of one container; ``spec``: more of the pod's spec (nodeName, hostname, ...)."""
    limits = {"memory": memory, "cpu": "500m"}
    resources = {"limits": limits, "requests": limits}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "c", "image": image, "command": command, "resources": resources}
            ],
            **spec,
        },
    }


def finished(plane: Plane, name: str) -> dict:
    """The pod once the kubelet has reported it Succeeded or Failed."""

    def done():
        got = plane.get("pod", name)
        return got if got and got["status"].get("phase") in ("Succeeded", "Failed") else None

    return plane.wait(done, hangs.FLOOR * 2, f"pod {name} finished")


def gang_member(name: str, image: str, command: list[str], node: str) -> dict:
    """A pod named as the operator names a gang's: hostname + subdomain (the headless
    Service), which the kubelet writes only into the pod's own /etc/hosts."""
    doc = pod(name, image, command, nodeName=node, hostname=name, subdomain="gang")
    doc["metadata"]["labels"]["gang"] = "yes"
    return doc


# The operator's gang Service (ftjob.operator.render.service): headless, publishing pods that
# are not ready (a rendezvous happens before any is).
GANG = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "gang"},
    "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"gang": "yes"},
             "ports": [{"name": "echo", "port": 7000, "protocol": "TCP"}]},
}  # fmt: skip
# Answers one connection: its peer's address, then what it sent, upper-cased.
ECHO = """
import socket
s = socket.create_server(("", 7000))
print("listening", flush=True)
c, peer = s.accept()
print("peer", peer[0], flush=True)
c.sendall(c.recv(100).upper())
"""
# Resolves NAME (argv[1]) until the cluster's DNS has the record (the pods start before the
# EndpointSlice names them), prints the address and its reverse name; with argv[2], connects
# and sends it. Each waits as torch's rendezvous does: the name is published before its pod
# is ready (publishNotReadyAddresses), so the server may not listen yet (a loaded CI machine
# refused the first connection and left the server waiting).
CLIENT = f"""
import socket, sys, time
deadline = time.monotonic() + {hangs.FLOOR}
def retried(call, errors):
    while True:
        try:
            return call()
        except errors:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
addr = retried(lambda: socket.gethostbyname(sys.argv[1]), socket.gaierror)
print("resolved", addr, flush=True)
print("reverse", socket.gethostbyaddr(addr)[0], flush=True)  # what torch's c10d store asks
if len(sys.argv) > 2:
    connect = lambda: socket.create_connection((sys.argv[1], 7000), timeout=30)
    c = retried(connect, OSError)  # refused, or no route yet: the name is ahead of the pod
    c.sendall(sys.argv[2].encode())
    print("reply", c.recv(100).decode(), flush=True)
"""


def test_a_pod_resolves_a_gang_members_name_through_the_cluster_dns(real):
    """`pod.job.ns.svc` (the operator's node_address) and its full name resolve to the pod's
    address: CoreDNS's kubernetes plugin reads the headless Service's EndpointSlice, and the
    kubelet's clusterDNS and search path lead the pod there."""
    plane, image = real
    plane.apply(GANG)
    plane.apply(gang_member("member", image, ["sleep", "3600"], NODE))
    names = ["member.gang.default.svc", "member.gang.default.svc.cluster.local"]
    for i, name in enumerate(names):
        plane.apply(pod(f"resolve{i}", image, ["python3", "-c", CLIENT, name], nodeName=NODE))
    ip = plane.wait(lambda: (plane.get("pod", "member") or {}).get("status", {}).get("podIP"),
                    hangs.FLOOR, "the member's address")  # fmt: skip
    for i in range(len(names)):
        got = finished(plane, f"resolve{i}")
        assert got["status"]["phase"] == "Succeeded", plane.kubectl("logs", f"resolve{i}").stdout
        assert plane.kubectl("logs", f"resolve{i}").stdout.split() == [
            "resolved", ip, "reverse", names[1]]  # fmt: skip
    plane.kubectl("delete", "pod", "member", "resolve0", "resolve1", "--wait=false")


def test_a_pod_on_one_node_connects_to_a_pod_on_the_other_by_its_name(real):
    """Each node's pods are on its own bridge and /24; the host routes between them: rank1 on
    the other node reaches rank0 by its gang name, and rank0 sees rank1's own address (no
    masquerade on the way)."""
    plane, image = real
    plane.apply(GANG)
    plane.apply(gang_member("rank0", image, ["python3", "-c", ECHO], NODE))
    client = ["python3", "-c", CLIENT, "rank0.gang.default.svc", "hello"]
    plane.apply(gang_member("rank1", image, client, OTHER))
    # The client first: had it failed, the server would wait for it and name nothing.
    got = finished(plane, "rank1")
    assert got["status"]["phase"] == "Succeeded", plane.kubectl("logs", "rank1").stdout
    server = finished(plane, "rank0")
    subnets = {n: (plane.dir / "nodes" / n / "subnet").read_text().strip() for n in (NODE, OTHER)}
    assert server["status"]["podIP"].startswith(f"10.214.{subnets[NODE]}.")
    assert got["status"]["podIP"].startswith(f"10.214.{subnets[OTHER]}.")
    assert server["status"]["phase"] == "Succeeded"
    assert plane.kubectl("logs", "rank1").stdout.split() == [
        "resolved", server["status"]["podIP"],
        "reverse", "rank0.gang.default.svc.cluster.local", "reply", "HELLO"]  # fmt: skip
    assert plane.kubectl("logs", "rank0").stdout.split() == [
        "listening", "peer", got["status"]["podIP"]]  # fmt: skip


def test_a_pod_runs_to_completed_and_kubectl_logs_shows_its_output(real):
    plane, image = real
    script = "echo hello from $(hostname); cat /proc/self/cgroup"
    plane.apply(pod("hello", image, ["sh", "-c", script], nodeName=NODE))
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


def traces(root: Path, netns: list[str], bridges: list[str], cgroup: str) -> dict[str, list]:
    """What of the nodes exists on this machine now: processes and mounts that name the
    plane's folder (``root``), the cluster's DNS among them, a node's sandboxes' network
    namespaces, every node's bridge and the veths on it, a node's cgroups in every
    hierarchy."""
    procs, dns = [], []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        if str(root) in argv:
            procs.append(cmdline.parent.name)
            dns += [cmdline.parent.name] if f"{root}/Corefile" in argv else []
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if str(root) in line or line.split()[4] in netns]  # fmt: skip
    links = json.loads(run("ip", "-j", "link", "show"))
    return {
        "processes": procs,
        "cluster DNS": dns,
        "mounts": mounts,
        "netns": [p for p in netns if Path(p).exists()],
        "links": [x["ifname"] for x in links if {x["ifname"], x.get("master")} & set(bridges)],
        "cgroups": [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{cgroup}")],
    }


def test_down_leaves_nothing_of_the_node(real):
    """Last of the session's real-node tests: the plane they share goes down here."""
    plane, image = real
    plane.apply(pod("sleeper", image, ["sleep", "3600"], nodeName=NODE))
    plane.kubectl("wait", "--for=condition=Ready", "pod/sleeper", "--timeout=120s")
    node = plane.dir / "nodes" / NODE
    bridges = ["ftjn" + (plane.dir / "nodes" / n / "subnet").read_text().strip()
               for n in (NODE, OTHER)]  # fmt: skip
    cgroup = re.search(r"^cgroupRoot: /(\S+)", (node / "kubelet.yaml").read_text(), re.M)[1]
    args = (plane.dir, sandbox_netns(node), bridges, cgroup)
    before = traces(*args)
    # What the checks look for is there while the node runs (so that their emptiness after
    # means something): kubelet, containerd and the shim, the sandbox's netns and veth, cgroups.
    assert all(before.values()), before
    plane.down()
    assert traces(*args) == {k: [] for k in before}
