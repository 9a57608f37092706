"""Status and lifecycle decisions, as pure functions of spec, pods, progress and the clock.

What a trainer container ends with -- its termination record or, without one, its log tail --
comes from the real trainer (the ``trainer_runs`` fixture, tests/trainer_outputs.py), never
from a line typed here.
"""

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ftjob.api import contract, crd, manifest
from ftjob.api.jobspec import parse_resource
from ftjob.api.status import FAILURE_REASONS, PHASES
from ftjob.operator import lifecycle, render
from ftjob.operator import status as st

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def job(**run_policy):
    doc = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
    doc["spec"]["runPolicy"] = {"stallTimeoutSeconds": 600, **run_policy}
    doc["spec"]["network"] = {"collectiveTimeoutSeconds": 60}
    return parse_resource(doc)


def pod(rank, attempt=0, phase="Running", exit_code=None, reason=None, message=None, extra=None,
        real=None):  # fmt: skip
    """A pod of the tiny job; ``real``: its trainer ended as that real run did."""
    name, spec = job()
    p = render.pod(name, "ns", spec, rank, attempt, "uid")
    state = {"running": {}} if phase == "Running" else {"waiting": {"reason": "ContainerCreating"}}
    if real is not None:
        phase = "Succeeded" if real.exit_code == 0 else "Failed"
        state = {"terminated": real.terminated()}
    elif exit_code is not None:
        term = {
            "exitCode": exit_code,
            "reason": reason or ("Completed" if not exit_code else "Error"),
        }
        state = {"terminated": term | ({"message": message} if message else {})}
    p["status"] = {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}]}
    p["spec"]["nodeName"] = f"node-{rank}"
    p["status"].update(extra or {})
    return p


def decide(status, pods, now=T0, snapshot=None, **policy):
    """The lifecycle's decision, whose status the API server keeps whole: a field the CRD's
    status schema lacks is pruned by the server (not by an emulator), and what the operator
    remembered there is lost (a gang's partlyPlacedSince once was, so it never split)."""
    name, spec = job(**policy)
    decision = lifecycle.decide(spec, name, 1, status, pods, now, snapshot)
    assert not unknown_to_the_server(decision.status, STATUS_SCHEMA), decision.status
    return decision


STATUS_SCHEMA = crd.schema()["properties"]["status"]


def unknown_to_the_server(value, schema: dict, path: str = ".status") -> list[str]:
    """The paths in ``value`` that structural pruning drops: object keys the schema has no
    property for (where it does not preserve unknown fields)."""
    unknown, inner = [], []
    if isinstance(value, list) and "items" in schema:
        inner = [(f"{path}[{i}]", item, schema["items"]) for i, item in enumerate(value)]
    elif isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        unknown = [f"{path}.{key}" for key in value if key not in props]
        inner = [(f"{path}.{k}", item, props[k]) for k, item in value.items() if k in props]
    return unknown + [p for at, item, sub in inner for p in unknown_to_the_server(item, sub, at)]


def run_to(phase_pods, **policy):
    """Status after the gang was created and observed with ``phase_pods``."""
    d = decide(None, [], **policy)
    assert d.create == [0, 1]
    return decide(d.status, phase_pods, **policy)


# ----------------------------------------------------------------------------- diagnosis


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(phase="Failed", exit_code=137, reason="OOMKilled"), "OOMKilled"),
        (dict(phase="Failed", reason_="Evicted"), "Evicted"),
        (dict(phase="Unknown"), "Lost"),
    ],
)
def test_diagnosis_from_what_the_kubelet_reports(kwargs, reason):
    evicted = kwargs.pop("reason_", None)
    extra = (
        {"reason": evicted, "message": "The node was low on resource: memory."} if evicted else {}
    )
    failure = st.diagnose(pod(1, **kwargs, extra=extra))
    assert failure["reason"] == reason and reason in FAILURE_REASONS
    assert failure["pod"] == "tiny-node-1" and failure["rank"] == 1 and failure["node"] == "node-1"
    assert st.ADVICE[reason].split(":")[0] in failure["message"]


@pytest.mark.parametrize(
    "scenario, reason, permanent, detail",
    [
        ("bad-data", contract.BAD_DATA, True, "line 2: has no field 'text'"),
        ("bad-model", contract.BAD_MODEL, True, "no-such-model"),
        ("bad-spec", contract.BAD_SPEC, True, "spec.method.type"),
        ("will-not-fit", contract.WILL_NOT_FIT, True, "2.5 GiB of 300.0 MiB CPU memory per pod"),
        ("checkpoint-unreadable", contract.CHECKPOINT_UNREADABLE, False, "step-00000001"),
        ("disk-full", contract.DISK_FULL, False, "No space left on device"),
        ("host-oom", contract.HOST_OOM, False, "can't allocate memory"),
        ("volume-unusable", contract.VOLUME_UNUSABLE, False, "cannot write and read back"),
    ],
)
def test_diagnosis_from_the_real_trainers_record(trainer_runs, scenario, reason, permanent, detail):
    run = trainer_runs.get(scenario)
    assert run.exit_code != 0 and contract.parse(run.record)["reason"] == reason, run.log[-3000:]
    failure = st.diagnose(pod(1, real=run))
    assert failure["reason"] == reason and reason in FAILURE_REASONS
    assert (reason in st.PERMANENT) == permanent
    # The trainer's fix for this very cause when its record has one, else the reason's advice.
    fix = contract.parse(run.record).get("fix") or st.ADVICE[reason]
    assert fix in failure["message"] and detail in failure["message"]
    assert "rank 0" in failure["message"] and st.NO_RECORD not in failure["message"]
    # The decision follows: a permanent reason fails the job at once, others restart the gang.
    d = run_to([pod(0), pod(1)], backoffLimit=5)
    r = decide(d.status, [pod(0), pod(1, real=run)], backoffLimit=5)
    assert r.phase == ("Failed" if permanent else "Restarting"), r.status
    assert r.status["failure"]["reason"] == reason


def test_without_a_record_the_log_tail_decides_and_the_message_says_so(trainer_runs):
    killed = trainer_runs.get("killed")
    assert killed.exit_code == -9 and killed.record == ""
    failure = st.diagnose(pod(0, real=killed))
    assert failure["reason"] == "Error" and st.NO_RECORD in failure["message"]
    assert killed.log.strip().splitlines()[-1] in failure["message"]  # its real log's tail


@pytest.mark.parametrize(
    "tail, reason",  # torch's and NCCL's own words, for a process that died before writing
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried", contract.CUDA_OOM),
        ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)",
         contract.COLLECTIVE_TIMEOUT),
        ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed "
         "out waiting 30000ms for send operation to complete", contract.COLLECTIVE_TIMEOUT),
    ],
)  # fmt: skip
def test_log_tail_patterns_only_apply_without_a_record(trainer_runs, tail, reason):
    killed = trainer_runs.get("killed")
    failure = st.diagnose(pod(0, phase="Failed", exit_code=-9, message=killed.message + tail))
    assert failure["reason"] == reason and st.NO_RECORD in failure["message"]
    bad = trainer_runs.get("bad-data")  # a record wins, whatever its message mentions
    record = json.loads(bad.record) | {"message": tail}
    assert (
        st.diagnose(pod(0, phase="Failed", exit_code=1, message=json.dumps(record)))["reason"]
        == contract.BAD_DATA
    )


def test_running_and_succeeded_pods_are_not_failures():
    assert st.diagnose(pod(0)) is None
    assert st.diagnose(pod(0, phase="Succeeded", exit_code=0)) is None
    assert st.diagnose(pod(0, phase="Pending")) is None


def test_the_most_specific_failure_is_the_root_cause(trainer_runs):
    killed = st.diagnose(pod(0, real=trainer_runs.get("killed")))
    oom = st.diagnose(pod(1, phase="Failed", exit_code=137, reason="OOMKilled"))
    assert st.root_cause([killed, oom])["reason"] == "OOMKilled"
    bad = st.diagnose(pod(1, real=trainer_runs.get("bad-data")))
    assert st.root_cause([killed, oom, bad])["reason"] == contract.BAD_DATA


def collective_error(rank: int) -> dict:
    """A pod whose trainer's collective failed because a peer went away: the record the
    trainer's own classifier (termination.classify) makes of gloo's words for it."""
    from ftjob.trainer.gang import termination

    try:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[10.214.1.9]:682")  # fmt: skip
    except RuntimeError as e:
        reason, message, where = termination.classify(e)
    record = contract.Failure(reason, message, rank=rank, where=where).record()
    return pod(rank, phase="Failed", exit_code=1, message=contract.dumps(record))


def test_a_killed_process_explains_its_peers_collective_error():
    """Seen on two real nodes: rank 0's process SIGKILLed (137, no record), rank 1's gloo
    "Connection closed by peer". The kill is the cause; a peer's real error still outranks it."""
    sigkilled = st.diagnose(pod(0, phase="Failed", exit_code=137))
    peer = st.diagnose(collective_error(1))
    assert (sigkilled["reason"], peer["reason"]) == ("Error", contract.NCCL_ERROR)
    assert st.root_cause([peer, sigkilled])["rank"] == 0
    record = contract.Failure(contract.INTERNAL, "KeyError: 'x'", rank=1).record()
    bug = st.diagnose(pod(1, phase="Failed", exit_code=1, message=contract.dumps(record)))
    assert st.root_cause([bug, sigkilled])["reason"] == contract.INTERNAL
    crashed = st.diagnose(pod(0, phase="Failed", exit_code=1))  # exit 1, no record: not a kill
    assert st.root_cause([peer, crashed])["rank"] == 1


def test_a_collective_error_waits_for_the_peer_that_was_killed():
    """Rank 1's collective error is seen first, rank 0 still running in the operator's view:
    it waits (GangEnding); rank 0 then shows its SIGKILL, which is the failure named."""
    d = run_to([pod(0), pod(1)])
    peer = collective_error(1)
    peer["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = st.now_iso(T0)
    waiting = decide(d.status, [pod(0), peer], T0 + timedelta(seconds=1))
    assert (waiting.phase, waiting.status["restarts"]) == ("Running", 0)
    assert st.condition(waiting.status["conditions"], "Running")["reason"] == "GangEnding"
    told = decide(waiting.status, [pod(0, phase="Failed", exit_code=137), peer],
                  T0 + timedelta(seconds=2))  # fmt: skip
    assert told.phase == "Restarting" and told.status["restarts"] == 1
    assert (told.status["failure"]["rank"], told.status["failure"]["exitCode"]) == (0, 137)


def test_long_termination_messages_are_cut_to_their_tail():
    failure = st.diagnose(pod(0, phase="Failed", exit_code=1, message="x" * 5000 + "THE END"))
    assert failure["message"].endswith("THE END") and len(failure["message"]) < 2000


def test_progress_snapshot_becomes_status_progress():
    snap = {
        "step": 30,
        "totalSteps": 60,
        "loss": 2.5,
        "mfu": 0.41,
        "etaSeconds": 4380,
        "updatedAt": "2026-01-01T12:00:00Z",
        "lastCheckpointStep": 20,
        "lastCheckpoint": "/ftjob/tiny-0f3c9a52/checkpoints/step-20",
    }
    p = st.progress(snap)
    assert p == {
        "step": 30,
        "totalSteps": 60,
        "display": "30/60",
        "loss": 2.5,
        "mfu": 41.0,
        "eta": "1h13m",
        "updateTime": "2026-01-01T12:00:00Z",
    }
    assert st.last_checkpoint(snap)["step"] == 20
    assert st.format_eta(75) == "1m15s" and st.format_eta(9) == "9s"
    dpo = {"rewardAccuracy": 0.75, "rewardMargin": 0.3, "evalRewardAccuracy": 0.7}
    assert st.progress({**snap, **dpo, "chosenReward": 0.1}).items() >= dpo.items()
    assert "chosenReward" not in st.progress({**snap, **dpo, "chosenReward": 0.1})


def test_conditions_keep_their_transition_time_while_unchanged():
    first = st.conditions([], "Running", "AllPodsRunning", "m", T0, 1, True)
    assert [c["type"] for c in first] == list(st.PHASE_CONDITIONS)
    later = st.conditions(first, "Running", "AllPodsRunning", "m", T0 + timedelta(hours=1), 2, True)
    running = st.condition(later, "Running")
    assert running["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert running["observedGeneration"] == 2
    done = st.conditions(later, "Succeeded", "Completed", "ok", T0 + timedelta(hours=2), 2, True)
    assert st.condition(done, "Running")["status"] == "False"
    assert st.condition(done, "Running")["lastTransitionTime"] == "2026-01-01T14:00:00Z"
    assert all(c["reason"] and c["reason"].isalnum() for c in done)


def test_a_refusal_of_the_pods_stays_in_the_created_condition_until_they_exist():
    """The operator records the API server's refusal (e.g. PodSecurity) in Created; the next
    reconciles keep it rather than 'the gang has no pods now', and drop it once created."""
    pending = st.conditions([], "Pending", "Creating", "m", T0, 1, False)
    why = 'pods "j-node-0" is forbidden: violates PodSecurity "baseline:latest"'
    refused = st.set_condition(pending, "Created", False, st.REFUSED, why, T0, 1)
    again = st.conditions(refused, "Pending", "Creating", "m", T0, 1, False)
    assert st.condition(again, "Created")["message"] == why
    created = st.conditions(again, "Running", "AllPodsRunning", "m", T0, 1, True)
    assert st.condition(created, "Created")["reason"] == "PodsCreated"


# ----------------------------------------------------------------------------- lifecycle


def test_new_job_creates_the_gang_then_runs():
    d = decide(None, [])
    assert d.phase == "Pending" and d.create == [0, 1] and d.status["attempt"] == 0
    assert d.status["startTime"] == "2026-01-01T12:00:00Z"
    d2 = decide(d.status, [pod(0), pod(1, phase="Pending")])
    assert d2.phase == "Pending" and d2.create == [] and "ContainerCreating" in str(d2.status)
    d3 = decide(d2.status, [pod(0), pod(1)])
    assert d3.phase == "Running" and not d3.create and not d3.delete
    assert ("Normal", "AllPodsRunning", "all 2 pods run") in d3.events
    assert all(p in PHASES for p in (d.phase, d2.phase, d3.phase))


def test_a_gang_kueue_holds_is_queued_naming_its_queue():
    """Kueue's admission gate on the pods: Pending, reason Queued, the LocalQueue named."""
    doc = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
    doc["spec"]["scheduling"] = {"queue": "research"}
    name, spec = parse_resource(doc)
    gate = {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}
    pods = [pod(r, phase="Pending") for r in (0, 1)]
    for p in pods:
        p["spec"] |= gate
        del p["spec"]["nodeName"]
    created = lifecycle.decide(spec, name, 1, None, [], T0, None)
    d = lifecycle.decide(spec, name, 1, created.status, pods, T0, None)
    running = st.condition(d.status["conditions"], "Running")
    assert d.phase == "Pending" and running["reason"] == "Queued"
    assert "LocalQueue research" in running["message"] and "2 of 2 pod(s)" in running["message"]
    # Admitted: the gates go, the pods wait for the kubelet as any pod does.
    for p in pods:
        del p["spec"]["schedulingGates"]
    after = lifecycle.decide(spec, name, 1, d.status, pods, T0, None)
    assert st.condition(after.status["conditions"], "Running")["reason"] == "PodsPending"


# What Kueue 0.17 writes on each pod of a group it preempts, before deleting them all.
KUEUE_STOP = {
    "type": "TerminationTarget",
    "status": "True",
    "reason": "WorkloadEvicted",
    "message": "Preempted to accommodate a workload (UID: 1) due to prioritization in the "
    "ClusterQueue",
}


def test_a_gang_kueue_preempts_is_queued_again_without_spending_restart_budget():
    d = run_to([pod(0), pod(1)], backoffLimit=1)
    assert d.phase == "Running"
    gone = [pod(r, phase="Failed", exit_code=143) for r in (0, 1)]
    for p in gone:
        p["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:30Z"
        p["status"]["conditions"] = [KUEUE_STOP]
    r = decide(d.status, gone, backoffLimit=1)
    assert r.phase == "Restarting" and r.status["restarts"] == 0 and r.status["attempt"] == 1
    assert r.status["failure"]["reason"] == "Preempted"
    assert "Preempted to accommodate" in r.status["failure"]["message"]
    assert (
        "no restart budget spent" in st.condition(r.status["conditions"], "Restarting")["message"]
    )
    # Twice, with a budget of one: still not Failed.
    for p in gone:
        p["metadata"]["labels"]["ftjob.dev/attempt"] = "1"
    again = decide(r.status, gone, backoffLimit=1)
    assert again.phase == "Restarting" and again.status["restarts"] == 0


# What kube-apiserver 1.37 writes on a pod evicted through the Eviction API (`kubectl drain`)
# before its graceful deletion; the scheduler's preemption, a NoExecute taint and a deleted
# node's pods get the same condition with their own reason.
DISRUPTION = {
    "type": "DisruptionTarget",
    "status": "True",
    "reason": "EvictionByEvictionAPI",
    "message": "Eviction API: evicting",
}


@pytest.mark.parametrize("reason", ["EvictionByEvictionAPI", "PreemptionByScheduler",
                                    "DeletionByTaintManager", "DeletionByPodGC"])  # fmt: skip
def test_a_pod_the_cluster_disrupts_replaces_the_gang_without_spending_restart_budget(reason):
    d = run_to([pod(0), pod(1)], backoffLimit=1)
    drained = pod(1)
    drained["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:30Z"
    drained["status"]["conditions"] = [DISRUPTION | {"reason": reason}]
    r = decide(d.status, [pod(0), drained], backoffLimit=1)
    assert r.phase == "Restarting" and r.status["restarts"] == 0 and r.status["attempt"] == 1
    assert r.status["failure"]["reason"] == "Preempted" and reason in r.status["failure"]["message"]
    restarting = st.condition(r.status["conditions"], "Restarting")["message"]
    assert "no restart budget spent" in restarting and "queues" not in restarting  # no queue


def test_a_pod_the_kubelet_evicts_for_the_nodes_pressure_still_spends_budget():
    """The kubelet marks its own evictions DisruptionTarget too (TerminationByKubelet), with
    status.reason Evicted: the job may have caused the pressure, so it stays Evicted."""
    d = run_to([pod(0), pod(1)], backoffLimit=1)
    evicted = pod(1, phase="Failed", extra={"reason": "Evicted", "message": "low on memory"})
    evicted["status"]["conditions"] = [DISRUPTION | {"reason": "TerminationByKubelet"}]
    r = decide(d.status, [pod(0), evicted], backoffLimit=1)
    assert r.status["failure"]["reason"] == "Evicted" and r.status["restarts"] == 1


def test_reconciling_twice_changes_nothing():
    d = run_to([pod(0), pod(1)])
    again = decide(d.status, [pod(0), pod(1)])
    assert again.status == d.status and not again.events and not again.create and not again.delete


@pytest.mark.parametrize("scenario", ["succeeded", "already-trained"])
def test_success_needs_every_node_to_exit_zero_and_rank0_to_name_the_export(trainer_runs, scenario):
    run = trainer_runs.get(scenario)
    model = str(run.job_dir / "model")
    d = run_to([pod(0), pod(1)])
    rank0_done = pod(0, real=run)
    half = decide(d.status, [rank0_done, pod(1)])
    assert half.phase == "Running"
    snap = {"step": 60, "totalSteps": 60}
    done = decide(half.status, [rank0_done, pod(1, 0, "Succeeded", 0)], snapshot=snap)
    assert done.phase == "Succeeded" and done.status["completionTime"]
    again = decide(done.status, [rank0_done, pod(1, 0, "Succeeded", 0)])
    assert again.status == done.status and not again.events
    assert done.status["modelPath"] == model
    assert st.condition(done.status["conditions"], "Succeeded")["status"] == "True"


def test_exit_zero_without_an_export_fails_without_a_retry():
    d = run_to([pod(0), pod(1)])
    hollow = decide(d.status, [pod(0, 0, "Succeeded", 0), pod(1, 0, "Succeeded", 0)])
    assert hollow.phase == "Failed" and hollow.status["restarts"] == 0
    assert "named no exported model" in hollow.status["failure"]["message"]
    not_json = pod(0, 0, "Succeeded", 0, message="done!")
    assert st.export_path(not_json) is None


def test_a_failed_pod_restarts_the_whole_gang_as_the_next_attempt():
    d = run_to([pod(0), pod(1)], backoffLimit=2)
    failed = [pod(0), pod(1, phase="Failed", exit_code=137, reason="OOMKilled")]
    r = decide(d.status, failed, backoffLimit=2)
    assert r.phase == "Restarting" and sorted(r.delete) == ["tiny-node-0", "tiny-node-1"]
    assert r.status["attempt"] == 1 and r.status["restarts"] == 1
    assert r.status["failure"]["reason"] == "OOMKilled" and r.events[0][0] == "Warning"
    # Old pods still terminating: wait, do not create a second gang under the same names.
    waiting = decide(r.status, failed, backoffLimit=2)
    assert waiting.phase == "Restarting" and not waiting.create
    # Gone: the next attempt is created.
    nxt = decide(waiting.status, [], backoffLimit=2)
    assert nxt.create == [0, 1] and nxt.status["attempt"] == 1


def test_a_bare_error_waits_briefly_for_a_peer_that_says_why(trainer_runs):
    """Seen on podman nodes: rank 0 refused its model, and rank 1 (its rendezvous store gone
    with rank 0's agent) ended first, a bare Error with no record. A bare Error waits up to
    PEERS_GRACE for the running peers' records; the telling one then decides."""
    d = run_to([pod(0), pod(1)])
    bare = pod(1, phase="Failed", exit_code=1)
    bare["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = st.now_iso(T0)
    waiting = decide(d.status, [pod(0), bare], T0 + timedelta(seconds=2))
    assert (waiting.phase, waiting.status["restarts"], waiting.delete) == ("Running", 0, [])
    assert st.condition(waiting.status["conditions"], "Running")["reason"] == "GangEnding"
    assert waiting.requeue_after == pytest.approx(lifecycle.PEERS_GRACE - 2)
    # Rank 0 ends with its record: the job fails on it, not retried, no restart spent.
    told = decide(waiting.status, [pod(0, real=trainer_runs.get("bad-data")), bare],
                  T0 + timedelta(seconds=3))  # fmt: skip
    assert (told.phase, told.status["failure"]["reason"]) == ("Failed", contract.BAD_DATA)
    assert told.status["restarts"] == 0
    # No peer says more within the grace: the bare Error restarts the gang, as before.
    late = decide(waiting.status, [pod(0), bare], T0 + timedelta(seconds=16))
    assert (late.phase, late.status["failure"]["reason"]) == ("Restarting", "Error")


def test_backoff_limit_fails_the_job():
    d = run_to([pod(0), pod(1)], backoffLimit=0)
    f = decide(d.status, [pod(0), pod(1, phase="Failed", exit_code=1)], backoffLimit=0)
    assert f.phase == "Failed" and "backoffLimit (0) reached" in f.status["failure"][
        "message"
    ] + str(f.status["conditions"])
    assert f.events[-1][:2] == ("Warning", "Error")  # the Event says why it is final
    assert f.events[-1][2].startswith("backoffLimit (0) reached: ")
    assert f.delete == ["tiny-node-0"]  # the survivor is killed, the failed pod kept for logs
    assert f.status["completionTime"]


def test_bad_input_fails_at_once_without_spending_retries(trainer_runs):
    d = run_to([pod(0), pod(1)], backoffLimit=5)
    bad = pod(0, real=trainer_runs.get("bad-data"))
    f = decide(d.status, [bad, pod(1)], backoffLimit=5)
    assert f.phase == "Failed" and f.status["restarts"] == 0
    assert f.status["failure"]["reason"] == contract.BAD_DATA
    assert "badNodes" not in f.status  # the job's fault, not the node's
    assert "not retried" in st.condition(f.status["conditions"], "Failed")["message"]


def test_cuda_oom_twice_in_a_row_is_permanent():
    # CPU cannot run out of GPU memory: the record as contract.py builds it for the trainer.
    record = contract.Failure(contract.CUDA_OOM, "CUDA out of memory", rank=0).record()
    oom = dict(phase="Failed", exit_code=1, message=contract.dumps(record))
    d = run_to([pod(0), pod(1)], backoffLimit=5)
    r = decide(d.status, [pod(0, **oom), pod(1)], backoffLimit=5)
    assert r.phase == "Restarting"
    r = decide(decide(r.status, [], backoffLimit=5).status, [pod(0, 1), pod(1, 1)], backoffLimit=5)
    assert r.phase == "Running"
    f = decide(r.status, [pod(0, 1, **oom), pod(1, 1)], backoffLimit=5)
    assert f.phase == "Failed" and "twice" in str(f.status["conditions"])


def test_a_pod_lost_from_a_running_gang_restarts_it():
    d = run_to([pod(0), pod(1)])
    r = decide(d.status, [pod(0)])
    assert r.phase == "Restarting" and r.status["failure"]["reason"] == "Lost"
    evicted = pod(1, phase="Failed", extra={"reason": "Evicted", "message": "low on memory"})
    r2 = decide(d.status, [pod(0), evicted])
    assert r2.status["failure"]["reason"] == "Evicted"


def test_no_progress_for_the_stall_timeout_restarts_the_gang():
    d = run_to([pod(0), pod(1)])
    snap = {"step": 5, "totalSteps": 60, "updatedAt": "2026-01-01T12:05:00Z"}
    ok = decide(d.status, [pod(0), pod(1)], T0 + timedelta(seconds=700), snap)
    assert ok.phase == "Running" and ok.requeue_after == pytest.approx(200)
    stalled = decide(ok.status, [pod(0), pod(1)], T0 + timedelta(seconds=901), snap)
    assert stalled.phase == "Restarting" and stalled.status["failure"]["reason"] == "Stalled"
    assert "step 5" in stalled.status["failure"]["message"]


def test_a_long_load_is_not_a_stall_but_has_its_own_limit():
    d = run_to([pod(0), pod(1)])  # stallTimeoutSeconds 600; startupTimeoutSeconds 3600
    pods = [pod(0), pod(1)]
    loading = {"phase": "loading", "step": 0, "updatedAt": "2026-01-01T12:00:30Z"}
    slow = decide(d.status, pods, T0 + timedelta(seconds=1800), loading)
    assert slow.phase == "Running" and slow.requeue_after == pytest.approx(1800)
    assert slow.status["progress"]["phase"] == "loading"
    late = decide(slow.status, pods, T0 + timedelta(seconds=3600), loading)
    assert late.phase == "Restarting" and late.status["failure"]["reason"] == "StartupTimeout"
    assert "rank 0 is loading" in late.status["failure"]["message"]
    # Once training, the stall clock runs from rank 0's latest report.
    training = {"phase": "training", "step": 3, "updatedAt": "2026-01-01T12:30:00Z"}
    ok = decide(slow.status, pods, T0 + timedelta(seconds=2000), training)
    assert ok.phase == "Running" and ok.requeue_after == pytest.approx(400)
    stalled = decide(ok.status, pods, T0 + timedelta(seconds=2400), training)
    assert stalled.status["failure"]["reason"] == "Stalled"


def test_the_previous_gangs_report_does_not_count_for_the_new_one():
    d = run_to([pod(0), pod(1)])
    old = {"phase": "training", "step": 9, "updatedAt": "2026-01-01T11:00:00Z"}  # before T0
    quiet = decide(d.status, [pod(0), pod(1)], T0 + timedelta(seconds=1200), old)
    assert quiet.phase == "Running"  # 1200s > stallTimeoutSeconds, but the gang is starting


def test_suspend_removes_pods_and_resume_starts_a_new_gang():
    d = run_to([pod(0), pod(1)])
    s = decide(d.status, [pod(0), pod(1)], suspend=True)
    assert s.phase == "Suspended" and sorted(s.delete) == ["tiny-node-0", "tiny-node-1"]
    gone = decide(s.status, [], suspend=True)
    assert gone.phase == "Suspended" and not gone.delete and not gone.events
    r = decide(gone.status, [], T0 + timedelta(hours=1))
    assert r.create == [0, 1] and r.status["attempt"] == 1 and r.status["restarts"] == 0
    assert ("Normal", "Resumed", "resuming as attempt 1") in r.events


def test_active_deadline_fails_the_job():
    d = run_to([pod(0), pod(1)], activeDeadlineSeconds=60)
    ok = decide(d.status, [pod(0), pod(1)], T0 + timedelta(seconds=30), activeDeadlineSeconds=60)
    assert ok.phase == "Running" and ok.requeue_after == pytest.approx(30)
    late = decide(ok.status, [pod(0), pod(1)], T0 + timedelta(seconds=61), activeDeadlineSeconds=60)
    assert late.phase == "Failed" and late.status["failure"]["reason"] == "DeadlineExceeded"
    assert sorted(late.delete) == ["tiny-node-0", "tiny-node-1"]


def test_ttl_after_finished_deletes_the_job():
    d = run_to([pod(0), pod(1)], ttlSecondsAfterFinished=100)
    done_pods = [pod(0, 0, "Succeeded", 0), pod(1, 0, "Succeeded", 0)]
    done = decide(d.status, done_pods, ttlSecondsAfterFinished=100)
    wait = decide(done.status, done_pods, T0 + timedelta(seconds=40), ttlSecondsAfterFinished=100)
    assert not wait.delete_job and wait.requeue_after == pytest.approx(60) and not wait.events
    gone = decide(done.status, done_pods, T0 + timedelta(seconds=100), ttlSecondsAfterFinished=100)
    assert gone.delete_job


def test_an_invalid_spec_fails_at_once_with_the_field():
    d = lifecycle.invalid(["spec.training: set exactly one of maxSteps and epochs"], 3, None, T0)
    assert d.phase == "Failed" and d.status["failure"]["reason"] == "BadInput"
    assert "spec.training" in d.status["failure"]["message"] and d.status["observedGeneration"] == 3


def test_a_finished_job_stays_as_it_is():
    d = lifecycle.invalid(["spec.x: bad"], 1, None, T0)
    again = lifecycle.invalid(["spec.x: bad"], 1, d.status, T0 + timedelta(minutes=5))
    assert again.status == d.status and not again.events
    f = run_to([pod(0), pod(1, phase="Failed", exit_code=1)], backoffLimit=0)
    later = decide(f.status, [pod(1, phase="Failed", exit_code=1)], T0 + timedelta(hours=1))
    assert later.status == f.status and not later.events and not later.delete


def test_status_patches_null_what_is_gone():
    old = {"phase": "Restarting", "failure": {"reason": "OOMKilled", "exitCode": 137}, "x": 1}
    new = {"phase": "Restarting", "failure": {"reason": "Stalled"}}
    assert st.merge_patch(old, new) == {
        "failure": {"reason": "Stalled", "exitCode": None},
        "x": None,
    }
    assert st.merge_patch(new, new) == {}


@pytest.mark.parametrize("enforce", [True, False])
def test_a_job_that_will_not_fit_never_starts_pods_unless_told(enforce):
    doc = manifest.load(ROOT / "examples" / "llama3-8b-full-1gpu.yaml")[0]
    doc["spec"]["plan"] = {"enforce": enforce}
    name, spec = parse_resource(doc)
    d = lifecycle.decide(spec, name, 1, None, [], T0)
    planned = st.condition(d.status["conditions"], "Planned")
    assert planned["status"] == "False" and planned["reason"] == "WillNotFit"
    assert "GiB" in planned["message"]
    if enforce:
        assert d.phase == "Failed" and not d.create
        assert d.status["failure"]["reason"] == "WillNotFit"
    else:
        assert d.phase == "Pending" and d.create == [0]


def test_a_job_that_fits_says_so():
    name, spec = parse_resource(manifest.load(ROOT / "examples" / "llama3-8b-lora-efa.yaml")[0])
    planned = st.condition(
        lifecycle.decide(spec, name, 1, None, [], T0).status["conditions"], "Planned"
    )
    assert planned["status"] == "True" and planned["reason"] == "Fits"


# ----------------------------------------------------------------------------- pod views


def served(p, deleting=False, sidecar=False):
    """``p`` as the API server hands it back: server fields, defaults, conditions, the
    kubelet's container status details, and what other controllers add."""
    p = json.loads(json.dumps(p))
    meta, status = p["metadata"], p["status"]
    meta |= {
        "uid": f"pod-uid-{meta['name']}",
        "resourceVersion": "4242",
        "creationTimestamp": "2026-01-01T11:59:00Z",
        "managedFields": [{"manager": "ftjob-operator", "operation": "Update", "fieldsV1": {}}],
    }
    meta["labels"]["kueue.x-k8s.io/queue-name"] = "team-a"
    meta["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": "{}"}
    meta["ownerReferences"][0] |= {"kind": "FineTuneJob", "apiVersion": "ftjob.dev/v1alpha1"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:00:30Z"
    p["spec"] |= {"schedulerName": "default-scheduler", "dnsPolicy": "ClusterFirst"}
    status |= {
        "hostIP": "10.0.0.7",
        "podIP": "10.1.2.3",
        "qosClass": "Guaranteed",
        "conditions": [{"type": "Ready", "status": "False"}],
    }
    for cs in status["containerStatuses"]:
        cs |= {"image": "ghcr.io/ftjob/trainer:0.1.0", "restartCount": 0, "ready": False}
    if sidecar:  # another container (a mesh proxy) that must not be taken for the trainer
        state = {"terminated": {"exitCode": 1, "reason": "OOMKilled"}}
        status["containerStatuses"].insert(0, {"name": "proxy", "state": state})
    return p


def realistic_pods(runs):
    """Pods in every state the decisions tell apart, as the API server serves them."""
    image_pull = served(pod(1, phase="Pending"))
    image_pull["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] = "ImagePullBackOff"
    queued = served(pod(1, phase="Pending"))  # Kueue's webhook gated it; no node yet
    queued["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/topology"},
                                         {"name": "kueue.x-k8s.io/admission"}]  # fmt: skip
    del queued["spec"]["nodeName"]
    preempted = served(pod(0, phase="Failed", exit_code=143), deleting=True)
    preempted["status"]["conditions"].append(KUEUE_STOP)
    return {
        "queued": queued,
        "preempted": preempted,
        "pending": served(pod(0, phase="Pending")),
        "running": served(pod(0), sidecar=True),
        "running-1": served(pod(1)),
        "image-pull": image_pull,
        "exported": served(pod(0, real=runs.get("succeeded"))),
        "exited-0": served(pod(1, 0, "Succeeded", 0)),
        "oom-killed": served(pod(1, phase="Failed", exit_code=137, reason="OOMKilled")),
        "host-oom": served(pod(0, real=runs.get("host-oom"))),
        "disk-full": served(pod(1, real=runs.get("disk-full"))),
        "bad-input": served(pod(0, real=runs.get("bad-data"))),
        "error": served(pod(1, real=runs.get("killed"))),
        "evicted": served(pod(1, phase="Failed", extra={"reason": "Evicted", "message": "low"})),
        "lost": served(pod(0, phase="Unknown", extra={"reason": "NodeLost"})),
        "deleting": served(pod(1), deleting=True),
        "old-attempt": served(pod(0, attempt=3)),
    }


def test_a_pod_view_reads_the_same_as_the_whole_pod(trainer_runs):
    readers = [st.diagnose, st.succeeded, st.running, st.terminated, st.waiting_reason, st.queued]
    readers += [st.export_path, st.rank_of, st.attempt_of]
    for name, whole in realistic_pods(trainer_runs).items():
        view = st.observed_pod(whole)
        for read in readers:
            assert read(view) == read(whole), (name, read.__name__)
        # What the handlers read: the owner (handlers._owned_by) and rank 0's address.
        assert view["metadata"]["ownerReferences"] == [{"uid": "uid"}], name
        assert view["status"].get("podIP") == whole["status"].get("podIP"), name
        # Small whatever the pod's spec holds; only a termination message (at most 4 KiB, the
        # kubelet's limit) is kept whole, since the diagnosis searches all of it.
        message = (st.terminated(whole) or {}).get("message", "")
        assert len(json.dumps(view)) - len(json.dumps(message)) < 660, name


def test_decisions_from_pod_views_equal_those_from_whole_pods(trainer_runs):
    pods = realistic_pods(trainer_runs)
    gangs = [
        [],
        ["pending", "image-pull"],
        ["running", "running-1"],
        ["running"],
        ["exported", "running-1"],
        ["exported", "exited-0"],
        ["running", "exited-0"],
        ["running", "oom-killed"],
        ["host-oom", "running-1"],
        ["running", "disk-full"],
        ["bad-input", "running-1"],
        ["running", "error"],
        ["running", "evicted"],
        ["lost", "running-1"],
        ["running", "deleting"],
        ["old-attempt", "running-1"],
    ]
    running = run_to([pod(0), pod(1)]).status
    one_failed = [pod(0), pod(1, phase="Failed", exit_code=1)]
    restarting = decide(running, one_failed).status
    failed = decide(running, one_failed, backoffLimit=0).status
    later = T0 + timedelta(minutes=5)
    for old in (None, running, restarting, failed):
        for gang in gangs:
            for policy in ({}, {"suspend": True}, {"backoffLimit": 0}):
                whole = [pods[n] for n in gang]
                from_whole = decide(old, whole, later, **policy)
                from_views = decide(old, [st.observed_pod(p) for p in whole], later, **policy)
                assert from_views == from_whole, (gang, policy)


def test_a_pod_view_shares_no_dicts_with_the_event_it_came_from(trainer_runs):
    whole = realistic_pods(trainer_runs)["exported"]
    view = st.observed_pod(whole)
    whole["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] = 1
    whole["metadata"]["labels"][render.LABEL_RANK] = "1"
    assert st.succeeded(view) and st.rank_of(view) == 0
