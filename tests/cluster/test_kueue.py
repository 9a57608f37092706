"""Kueue v0.17 on the session's real control plane, driven as a platform team drives it:
docs/install.md's "Queues with Kueue" applied verbatim, the operator running as the chart's
ServiceAccount, and FineTuneJobs naming the LocalQueue. Kueue admits a gang whole or not at all."""

from __future__ import annotations

import time

import hangs
import pytest
import yaml
from kueue_plane import (
    ADMISSION_GATE,
    GPU_PRODUCT,
    TEAM,
    Operator,
    PodWatch,
    admitted,
    condition,
    delete_job,
    docs_kueue_configuration,
    docs_kueue_topology_yaml,
    gates,
    gpu_job,
    job_pods,
    leftovers,
    placed,
    setup_team,
    workload,
)
from plane import Plane

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def team(installed: Plane):
    """The session's plane (Kueue's on it), ftjob installed and its operator running, team-a's
    queues. The team's jobs go with the module (tests/cluster/conftest.py)."""
    setup_team(installed)
    operator = Operator(installed, installed.dir / "operator.log").start()
    try:
        yield installed
    finally:
        operator.stop()


def submit(plane: Plane, name: str, **spec_changes) -> None:
    plane.apply(gpu_job(name, **spec_changes))


def job_condition(plane: Plane, name: str, kind: str) -> dict:
    return condition({"status": plane.get("ftj", name, TEAM)["status"]}, kind)


def short_of_quota(plane: Plane, name: str) -> dict:
    """The Workload's QuotaReserved condition once Kueue says the quota is short."""
    reserved = condition(workload(plane, name), "QuotaReserved")
    ok = reserved.get("status") == "False" and "insufficient unused quota" in reserved.get(
        "message", ""
    )
    return reserved if ok else {}


def test_the_plane_runs_kueue_with_the_configuration_the_docs_give(team):
    docs = docs_kueue_configuration()
    running = yaml.safe_load((team.dir / "kueue" / "config.yaml").read_text())
    assert docs["apiVersion"] == running["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"
    assert "pod" in docs["integrations"]["frameworks"]
    for key in ("integrations", "managedJobsNamespaceSelector"):
        assert running[key] == docs[key], key
    # Kueue's cert management made the webhook's certificate and injected its CA.
    hooks = team.get("mutatingwebhookconfiguration", "kueue-mutating-webhook-configuration")
    assert all(h["clientConfig"].get("caBundle") for h in hooks["webhooks"])
    queue = team.get("clusterqueue.kueue.x-k8s.io", "gpu-training")
    assert condition(queue, "Active")["status"] == "True", queue


def test_a_gang_is_gated_until_kueue_admits_it_whole_then_placed_on_gpu_nodes(team, tmp_path):
    watch = PodWatch(team, "whole", tmp_path / "watch.json")
    submit(team, "whole")
    pods = team.wait(lambda: placed(team, "whole"), 60, "the gang admitted and placed")
    wl = team.wait(lambda: admitted(team, "whole-a0"), hangs.FLOOR, "workload whole-a0 admitted")
    versions = watch.stop()

    # One Workload for the gang, owned by both pods, asking for both pods' GPUs.
    assert wl["spec"]["queueName"] == "research"
    assert sum(ps["count"] for ps in wl["spec"]["podSets"]) == 2
    owners = sorted(o["name"] for o in wl["metadata"]["ownerReferences"])
    assert owners == ["whole-node-0", "whole-node-1"]
    assert wl["status"]["admission"]["clusterQueue"] == "gpu-training"
    # Every pod was created gated, and no version of any pod had a node while gated.
    first = {}
    for pod in versions:
        first.setdefault(pod["metadata"]["name"], pod)
        assert not (gates(pod) and pod["spec"].get("nodeName")), pod["metadata"]["name"]
    assert sorted(first) == ["whole-node-0", "whole-node-1"]
    for pod in first.values():
        assert ADMISSION_GATE in gates(pod) and not pod["spec"].get("nodeName")
    # Kueue admits the gang whole, and the scheduler places it whole: it is a PodGroup too.
    group = team.get("podgroup", "whole-a0", TEAM)
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 2, group
    assert {p["spec"]["schedulingGroup"]["podGroupName"] for p in pods} == {"whole-a0"}
    # Placed on kwok's GPU nodes of the flavor: Kueue added the flavor's node label.
    for pod in pods:
        assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == GPU_PRODUCT
        node = team.get("node", pod["spec"]["nodeName"], "")
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    team.wait(
        lambda: team.get("ftj", "whole", TEAM)["status"].get("phase") == "Running",
        hangs.FLOOR,
        "the job Running",
    )
    delete_job(team, "whole")


def test_quota_for_one_gang_keeps_the_second_gated_until_the_first_goes(team, tmp_path):
    submit(team, "first")
    team.wait(lambda: placed(team, "first"), 60, "the first gang placed")
    watch = PodWatch(team, "second", tmp_path / "watch.json")
    # A start limit shorter than its time in the queue: waiting for quota is not being stuck.
    submit(team, "second", runPolicy={"startTimeoutSeconds": 5})
    team.wait(lambda: len(job_pods(team, "second")) == 2, hangs.FLOOR, "the second gang's 2 pods")

    def short():
        reserved = condition(workload(team, "second-a0"), "QuotaReserved")
        return (
            reserved.get("status") == "False"
            and "insufficient unused quota" in reserved.get("message", "")
            and reserved
        )

    reserved = team.wait(short, hangs.FLOOR, "second-a0 waiting for quota")
    assert "nvidia.com/gpu" in reserved["message"], reserved
    time.sleep(8)  # reconciles and the start limit later, still all gated, none placed
    for pod in job_pods(team, "second"):
        assert ADMISSION_GATE in gates(pod) and not pod["spec"].get("nodeName")
    local = team.get("localqueue.kueue.x-k8s.io", "research", TEAM)
    assert local["status"]["pendingWorkloads"] == 1
    # The job says why it waits, and where: Kueue's own words on what is short.
    status = team.get("ftj", "second", TEAM)["status"]
    running = condition({"status": status}, "Running")
    assert status["phase"] == "Pending" and running["reason"] == "Queued", status
    assert "waitingSince" not in status and "failure" not in status, status
    assert "LocalQueue research" in running["message"], running
    assert reserved["message"] in running["message"], running
    queued = condition({"status": status}, "Queued")
    assert queued["status"] == "True" and queued["reason"] == reserved["reason"], queued
    assert queued["message"] == f"LocalQueue research: {reserved['message']}", queued
    assert condition({"status": status}, "Admitted")["status"] == "False", status
    wide = team.kubectl("get", "ftj", "second", "-n", TEAM, "-o", "wide").stdout
    header, row = wide.splitlines()
    assert "REASON" in header and "QUEUE" in header, wide
    assert "Queued" in row.split() and reserved["message"] in row, wide
    # The admitted gang's job names the ClusterQueue that admitted it.
    first = condition({"status": team.get("ftj", "first", TEAM)["status"]}, "Admitted")
    assert first["status"] == "True", first
    assert "Workload first-a0 admitted by ClusterQueue gpu-training" in first["message"], first
    assert "nvidia.com/gpu: a100-80gb" in first["message"], first

    delete_job(team, "first")
    team.wait(lambda: placed(team, "second"), 60, "the second gang admitted and placed")
    assert admitted(team, "second-a0")
    job_admitted = team.wait(
        lambda: job_condition(team, "second", "Admitted").get("status") == "True",
        hangs.FLOOR,
        "the second job's Admitted condition",
    )
    assert job_admitted
    status = team.get("ftj", "second", TEAM)["status"]
    assert condition({"status": status}, "Queued")["status"] == "False", status
    assert "ClusterQueue gpu-training" in condition({"status": status}, "Admitted")["message"]
    for pod in watch.stop():  # never a node while gated, never half the gang placed alone
        assert not (gates(pod) and pod["spec"].get("nodeName")), pod["metadata"]["name"]
    delete_job(team, "second")


def test_deleting_a_queued_job_leaves_nothing(team):
    submit(team, "holder")
    team.wait(lambda: placed(team, "holder"), 60, "the holder gang placed")
    submit(team, "queued")
    team.wait(lambda: workload(team, "queued-a0"), hangs.FLOOR, "queued-a0's Workload")
    pods = job_pods(team, "queued")
    assert len(pods) == 2
    assert all("kueue.x-k8s.io/managed" in p["metadata"]["finalizers"] for p in pods)
    delete_job(team, "queued")  # waits until no pod, Workload, ConfigMap or Service is left
    assert not leftovers(team, "queued")
    assert placed(team, "holder")  # the admitted gang is untouched
    delete_job(team, "holder")


def test_a_replaced_gang_is_a_new_group_kueue_admits(team):
    submit(team, "phoenix")
    pods = team.wait(lambda: placed(team, "phoenix"), 60, "attempt 0 placed")
    team.wait(
        lambda: team.get("ftj", "phoenix", TEAM)["status"].get("phase") == "Running",
        hangs.FLOOR,
        "the job Running",
    )
    # A node's pod goes (as when its node is lost): the operator replaces the gang.
    team.kubectl("delete", "pod", pods[1]["metadata"]["name"], "-n", TEAM, "--wait=false")
    new = team.wait(lambda: placed(team, "phoenix", attempt=1), 90, "attempt 1 placed")
    wl = admitted(team, "phoenix-a1")
    assert wl, workload(team, "phoenix-a1")
    assert all(
        p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "phoenix-a1" for p in new
    )
    status = team.get("ftj", "phoenix", TEAM)["status"]
    assert status["attempt"] == 1 and status["restarts"] == 1, status
    delete_job(team, "phoenix")


PRIORITIES = """
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: ftjob-test-low}
value: 100
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: ftjob-test-high}
value: 1000
"""


def test_kueue_preempts_a_lower_priority_gang_and_no_restart_budget_is_spent(team):
    team.kubectl("apply", "-f", "-", input=PRIORITIES)
    submit(team, "low", scheduling={"queue": "research", "priorityClassName": "ftjob-test-low"},
           runPolicy={"backoffLimit": 1})  # fmt: skip
    team.wait(lambda: placed(team, "low"), 60, "the low-priority gang placed")
    # A PodGroup is placed only at its pods' priority: the job's class is the group's too.
    assert team.get("podgroup", "low-a0", TEAM)["spec"]["priority"] == 100
    submit(team, "high", scheduling={"queue": "research", "priorityClassName": "ftjob-test-high"})
    team.wait(lambda: placed(team, "high"), 90, "the high-priority gang admitted and placed")
    assert admitted(team, "high-a0")

    def requeued():
        status = team.get("ftj", "low", TEAM)["status"]
        return status.get("attempt") == 1 and status

    status = team.wait(requeued, hangs.FLOOR, "the low job's next gang")
    assert status["restarts"] == 0, status  # budget untouched: a preemption is not a failure
    assert status["failure"]["reason"] == "Preempted", status
    assert "Preempted to accommodate" in status["failure"]["message"], status
    # The next gang waits in the queue, gated, and the job says so.
    team.wait(lambda: workload(team, "low-a1"), hangs.FLOOR, "low-a1's Workload")
    team.wait(
        lambda: (
            condition({"status": team.get("ftj", "low", TEAM)["status"]}, "Running").get("reason")
            == "Queued"
        ),
        hangs.FLOOR,
        "the low job Queued",
    )
    assert all(ADMISSION_GATE in gates(p) for p in job_pods(team, "low"))
    # The high job goes: the low one is admitted again, still with its whole budget.
    delete_job(team, "high")
    team.wait(lambda: placed(team, "low", attempt=1), 60, "the low job's gang placed again")
    assert team.get("ftj", "low", TEAM)["status"]["restarts"] == 0
    delete_job(team, "low")


def test_suspending_a_queued_job_takes_it_out_of_the_queue_and_resuming_queues_it_again(team):
    submit(team, "holder")  # the whole quota
    team.wait(lambda: placed(team, "holder"), 60, "the holder gang placed")
    submit(team, "sleeper", runPolicy={"backoffLimit": 1})
    team.wait(lambda: short_of_quota(team, "sleeper-a0"), hangs.FLOOR, "sleeper-a0 queued")

    patch = '{"spec": {"runPolicy": {"suspend": %s}}}'
    team.kubectl("patch", "ftj", "sleeper", "-n", TEAM, "--type=merge", "-p", patch % "true")
    team.wait(lambda: not job_pods(team, "sleeper"), hangs.FLOOR, "the queued gang's pods gone")
    team.wait(lambda: not workload(team, "sleeper-a0"), hangs.FLOOR, "sleeper-a0 gone")
    team.wait(
        lambda: (
            team.get("localqueue.kueue.x-k8s.io", "research", TEAM)["status"].get(
                "pendingWorkloads"
            )
            == 0
        ),
        hangs.FLOOR,
        "the LocalQueue with nothing pending",
    )
    status = team.wait(
        lambda: (s := team.get("ftj", "sleeper", TEAM)["status"])["phase"] == "Suspended" and s,
        hangs.FLOOR,
        "the job Suspended",
    )
    assert status["restarts"] == 0, status
    assert condition({"status": status}, "Queued")["status"] == "False", status
    assert placed(team, "holder")  # the admitted gang is untouched

    team.kubectl("patch", "ftj", "sleeper", "-n", TEAM, "--type=merge", "-p", patch % "false")
    reserved = team.wait(
        lambda: short_of_quota(team, "sleeper-a1"), hangs.FLOOR, "sleeper-a1 queued again"
    )
    pods = job_pods(team, "sleeper")
    assert len(pods) == 2 and all(ADMISSION_GATE in gates(p) for p in pods), pods
    team.wait(
        lambda: reserved["message"] in job_condition(team, "sleeper", "Queued").get("message", ""),
        hangs.FLOOR,
        "the job Queued again",
    )
    delete_job(team, "holder")
    team.wait(lambda: placed(team, "sleeper", attempt=1), 60, "the resumed gang placed")
    status = team.get("ftj", "sleeper", TEAM)["status"]
    assert status["restarts"] == 0 and status["attempt"] == 1, status
    delete_job(team, "sleeper")


RACK = "cloud.provider.com/topology-rack"
# Two racks of two nodes; one node of rack-a is taken by a pod Kueue does not manage.
RACKS = {"gpu-node-0": "rack-a", "gpu-node-1": "rack-a", "gpu-node-2": "rack-b"}
RACKS["gpu-node-3"] = "rack-b"
FILLER = """
apiVersion: v1
kind: Pod
metadata: {name: rack-a-filler, namespace: default}
spec:
  nodeName: gpu-node-1
  containers:
  - name: c
    image: busybox
    resources:
      requests: {nvidia.com/gpu: "8"}
      limits: {nvidia.com/gpu: "8"}
"""


def test_a_gang_that_asks_for_one_rack_is_placed_inside_one_rack(team):
    for node, rack in RACKS.items():
        team.kubectl("label", "node", node, f"{RACK}={rack}", "--overwrite")
    team.kubectl("apply", "-f", "-", input=docs_kueue_topology_yaml())
    team.kubectl("apply", "-f", "-", input=FILLER)
    team.wait(
        lambda: (
            (team.get("pod", "rack-a-filler") or {}).get("status", {}).get("phase") == "Running"
        ),
        hangs.FLOOR,
        "the filler running on gpu-node-1",
    )
    team.wait(
        lambda: condition(team.get("clusterqueue.kueue.x-k8s.io", "gpu-training-racks"), "Active")
        .get("status") == "True",
        hangs.FLOOR,
        "the racks ClusterQueue active",
    )  # fmt: skip
    submit(team, "racked", scheduling={"queue": "research-racks", "topology": RACK})
    pods = team.wait(lambda: placed(team, "racked"), 90, "the racked gang placed")
    wl = admitted(team, "racked-a0")
    assert wl, workload(team, "racked-a0")
    (podset,) = wl["spec"]["podSets"]
    assert podset["topologyRequest"]["required"] == RACK, podset
    (assignment,) = wl["status"]["admission"]["podSetAssignments"]
    assert assignment["topologyAssignment"], assignment
    # rack-a has one free node, rack-b two: the gang of two is inside rack-b, on both its nodes.
    nodes = sorted(p["spec"]["nodeName"] for p in pods)
    assert nodes == ["gpu-node-2", "gpu-node-3"], (nodes, assignment)
    for pod in pods:
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == RACK
        assert (
            pod["spec"]["nodeSelector"].get("kubernetes.io/hostname") == pod["spec"]["nodeName"]
        ), pod["spec"]["nodeSelector"]
    delete_job(team, "racked")
    team.kubectl("delete", "pod", "rack-a-filler", "--wait=false")
