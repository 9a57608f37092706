"""A Pending job says why, and does not wait forever: the pure lifecycle reads the pods' own
status (the scheduler's PodScheduled condition, the kubelet's waiting reasons).

    python -m pytest tests/unit/test_pending.py -q

The same on the real control plane: tests/cluster/test_real_operator.py.
"""

from datetime import timedelta

import pytest
from test_status import T0, decide, pod

from ftjob.operator import lifecycle
from ftjob.operator import status as st

GATE = {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}


def unschedulable(message, rank=1):
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": message, "lastTransitionTime": "2026-01-01T12:00:00Z"}  # fmt: skip
    p = pod(rank, phase="Pending", extra={"conditions": [cond]})
    del p["spec"]["nodeName"]
    return p


def waiting(reason, message):
    p = pod(1, phase="Pending")
    p["status"]["containerStatuses"][0]["state"] = {
        "waiting": {"reason": reason, "message": message}
    }
    return p


CASES = [
    (
        unschedulable(
            "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 "
            "nodes are available: 2 No preemption victims found for incoming pod."
        ),
        "Unschedulable",
        "2 Insufficient nvidia.com/gpu",
    ),  # fmt: skip
    (
        unschedulable('0/2 nodes are available: persistentvolumeclaim "shared-fs" not found.'),
        "Unschedulable",
        'persistentvolumeclaim "shared-fs" not found',
    ),  # fmt: skip
    (
        unschedulable(
            "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."
        ),
        "Unschedulable",
        "node affinity",
    ),  # fmt: skip
    (
        waiting("ErrImagePull", 'failed to pull and unpack image "ghcr.io/x/nope:1": not found'),
        "ErrImagePull",
        "ghcr.io/x/nope:1",
    ),  # fmt: skip
    (
        waiting("ImagePullBackOff", 'Back-off pulling image "ghcr.io/x/nope:1"'),
        "ImagePullBackOff",
        "Back-off pulling image",
    ),  # fmt: skip
    (
        waiting(
            "CreateContainerError",
            'failed to create containerd container: exec: "python": '
            "executable file not found in $PATH",
        ),
        "CreateContainerError",
        "executable file",
    ),  # fmt: skip
    (
        waiting("CreateContainerConfigError", 'secret "hf" not found'),
        "CreateContainerConfigError",
        'secret "hf" not found',
    ),  # fmt: skip
]


@pytest.mark.parametrize("stuck, reason, words", CASES)
def test_a_pod_that_cannot_start_names_the_cause_in_the_condition_and_a_warning(
    stuck, reason, words
):
    created = decide(None, [])
    # Decided from the operator's trimmed view of the pods, as it runs.
    pods = [st.observed_pod(p) for p in (pod(0), stuck)]
    d = decide(created.status, pods)
    cond = st.condition(d.status["conditions"], "Running")
    assert d.phase == "Pending" and cond["reason"] == reason
    assert "node-1" in cond["message"] and words in cond["message"]
    warnings = [e for e in d.events if e[0] == "Warning"]
    assert [(r, words in m) for _, r, m in warnings] == [(reason, True)]
    # Level-triggered: the same cause again says nothing new.
    again = decide(d.status, pods, now=T0 + timedelta(seconds=20))
    assert not [e for e in again.events if e[0] == "Warning"]


def test_a_gang_in_a_pod_group_waits_whole_and_names_the_nodes_verdict():
    """Kubernetes 1.37's PodGroup: the scheduler binds none of a gang it cannot place whole;
    one pod carries why no node fits it, the others repeat the group's minCount."""
    created = decide(None, [])
    echo = unschedulable("minCount (2) cannot be satisfied: 0 scheduled, 1 remaining", rank=0)
    verdict = unschedulable("0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
    for p in (echo, verdict):
        p["spec"]["schedulingGroup"] = {"podGroupName": "tiny-a0"}
    pods = [st.observed_pod(p) for p in (echo, verdict)]
    cond = st.condition(decide(created.status, pods).status["conditions"], "Running")
    assert cond["reason"] == "Unschedulable", cond
    assert cond["message"].startswith("waiting for the whole gang to be placed (2 pod(s), all")
    assert "Insufficient nvidia.com/gpu" in cond["message"], cond


def test_a_gang_partly_placed_without_a_pod_group_gives_its_nodes_back_and_waits_whole():
    """A cluster that does not serve the PodGroup API: node 0 bound, node 1 unschedulable.
    After the grace the bound pod is given back (no restart budget spent) with a Warning
    naming the fix, and the next gang is made whole only after the backoff."""
    grace, backoff = lifecycle.SPLIT_GRACE_SECONDS, lifecycle.SPLIT_BACKOFF_SECONDS
    pods = [pod(0, phase="Pending"), unschedulable("0/4 nodes are available: 4 Insufficient")]
    d = decide(decide(None, []).status, pods)
    assert d.phase == "Pending" and not d.delete and d.requeue_after <= grace
    waited = decide(d.status, pods, now=T0 + timedelta(seconds=grace - 1))
    assert not waited.delete and waited.requeue_after <= 1
    split = decide(waited.status, pods, now=T0 + timedelta(seconds=grace))
    cond = st.condition(split.status["conditions"], "Running")
    assert cond["reason"] == "PartlyPlaced" and "1 of 2 pods bound" in cond["message"]
    assert "PodGroup API" in cond["message"] and "Insufficient" in cond["message"]
    assert sorted(split.delete) == ["tiny-node-0", "tiny-node-1"]
    assert split.status["attempt"] == 1 and split.status["restarts"] == 0
    assert [r for k, r, _ in split.events if k == "Warning"] == ["PartlyPlaced"]
    later = T0 + timedelta(seconds=grace + 1)
    # Its pods take a moment to go: the job still says why, and warns no more.
    going = decide(split.status, pods, now=later)
    cond = st.condition(going.status["conditions"], "Running")
    assert going.phase == "Pending" and cond["reason"] == "PartlyPlaced", cond
    assert "1 of 2 pods bound" in cond["message"] and not going.events, going.events
    held = decide(going.status, [], now=later)
    assert not held.create and held.requeue_after == pytest.approx(backoff - 1)
    made = decide(held.status, [], now=later + timedelta(seconds=backoff))
    assert made.create == [0, 1] and made.status["attempt"] == 1


def test_a_pod_being_scheduled_or_pulled_is_not_stuck():
    created = decide(None, [])
    d = decide(created.status, [pod(0), pod(1, phase="Pending")])  # ContainerCreating
    assert st.condition(d.status["conditions"], "Running")["reason"] == "PodsPending"
    assert not [e for e in d.events if e[0] == "Warning"]


def test_a_gang_that_cannot_start_fails_at_the_start_limit_with_the_cause():
    created = decide(None, [], startTimeoutSeconds=120)
    why = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    pods = [unschedulable(why, rank=0), unschedulable(why)]  # none bound: nothing to give back
    d = decide(created.status, pods, startTimeoutSeconds=120)
    assert d.phase == "Pending" and d.requeue_after == 120
    d = decide(d.status, pods, now=T0 + timedelta(seconds=119), startTimeoutSeconds=120)
    assert d.phase == "Pending" and 0 < d.requeue_after <= 1
    d = decide(d.status, pods, now=T0 + timedelta(seconds=120), startTimeoutSeconds=120)
    assert d.phase == "Failed" and d.status["failure"]["reason"] == "StartTimeout"
    assert "startTimeoutSeconds (120)" in d.status["failure"]["message"]
    assert "Insufficient nvidia.com/gpu" in d.status["failure"]["message"]
    assert "pod(s) of attempt" not in d.status["failure"]["message"]


def test_the_default_start_limit_is_half_an_hour():
    created = decide(None, [])
    why = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    d = decide(created.status, [unschedulable(why, rank=0), unschedulable(why)])
    assert d.requeue_after == 1800


def test_waiting_for_kueue_quota_does_not_count_against_the_start_limit():
    created = decide(None, [], startTimeoutSeconds=60)
    gated = [pod(r, phase="Pending") for r in (0, 1)]
    for p in gated:
        p["spec"] |= GATE
        del p["spec"]["nodeName"]
    d = decide(created.status, gated, startTimeoutSeconds=60)
    # An hour in the queue: still Pending, Queued, no deadline counted.
    d = decide(d.status, gated, now=T0 + timedelta(hours=1), startTimeoutSeconds=60)
    assert d.phase == "Pending" and "waitingSince" not in d.status
    assert st.condition(d.status["conditions"], "Running")["reason"] == "Queued"
    # Admitted at T0+1h, then unschedulable: the limit counts from the admission.
    stuck = [pod(0), unschedulable("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")]
    for p in stuck:  # Kueue's gang is a PodGroup too (1.37): never given back, only limited
        p["spec"]["schedulingGroup"] = {"podGroupName": "tiny-a0"}
    later = T0 + timedelta(hours=1, seconds=30)
    d = decide(d.status, stuck, now=later, startTimeoutSeconds=60)
    assert d.phase == "Pending" and d.requeue_after == 60
    d = decide(d.status, stuck, now=later + timedelta(seconds=60), startTimeoutSeconds=60)
    assert d.phase == "Failed" and d.status["failure"]["reason"] == "StartTimeout"


def test_a_gang_that_starts_stops_the_start_clock():
    created = decide(None, [], startTimeoutSeconds=60)
    stuck = [pod(0), waiting("ImagePullBackOff", 'Back-off pulling image "x"')]
    d = decide(created.status, stuck, startTimeoutSeconds=60)
    d = decide(d.status, [pod(0), pod(1)], now=T0 + timedelta(seconds=50), startTimeoutSeconds=60)
    assert d.phase == "Running" and "waitingSince" not in d.status


def test_the_kubelets_pull_back_off_is_one_cause_not_an_event_each_flip():
    created = decide(None, [])
    pull = waiting("ErrImagePull", 'failed to pull image "x": not found')
    backoff = waiting("ImagePullBackOff", 'Back-off pulling image "x"')
    d = decide(created.status, [pod(0), pull])
    assert [e[1] for e in d.events if e[0] == "Warning"] == ["ErrImagePull"]
    for i, flip in enumerate((backoff, pull, backoff), start=1):
        d = decide(d.status, [pod(0), flip], now=T0 + timedelta(seconds=10 * i))
        assert not [e for e in d.events if e[0] == "Warning"]
    assert st.condition(d.status["conditions"], "Running")["reason"] == "ImagePullBackOff"
