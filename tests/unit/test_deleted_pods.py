"""A pod deleted by a person or a controller while its trainer runs (issue 52, point 4): the
operator waits for the trainer to end, and one that saved at the SIGTERM (the real trainer's
"preempted" record) is Preempted, not Lost: no restart budget spent, and the Event names the
step saved. A deleted pod that ends without a record is still Lost."""

from datetime import timedelta

from test_status import T0, decide, pod, run_to

from ftjob.api import contract
from ftjob.operator import status as st

DELETED_AT = "2026-01-01T12:00:30Z"


def deleted(p: dict) -> dict:
    p["metadata"]["deletionTimestamp"] = DELETED_AT
    return p


def test_a_deleted_pod_that_saved_is_preempted_and_the_event_names_the_step(trainer_runs):
    run = trainer_runs.get("sigterm")
    record = contract.parse(run.record)
    assert record["outcome"] == "preempted" and record["checkpoint"]
    saved = f"stopped for a SIGTERM after step {record['step']}; checkpoint"
    running = run_to([pod(0), pod(1)], backoffLimit=3)
    # `kubectl delete pod tiny-node-1`: its trainer got the SIGTERM and is saving.
    saving = decide(running.status, [pod(0), deleted(pod(1))], backoffLimit=3)
    assert saving.phase == "Running" and not saving.delete and "failure" not in saving.status
    # It saved and ended with its record.
    ended = deleted(pod(1, real=run))
    r = decide(saving.status, [pod(0), ended], backoffLimit=3)
    assert r.phase == "Restarting" and r.status["attempt"] == 1
    assert r.status["restarts"] == 0  # no restart budget spent
    failure = r.status["failure"]
    assert failure["reason"] == "Preempted" and "the pod was deleted" in failure["message"]
    kind, reason, message = next(e for e in r.events if e[1] == "Preempted")
    assert kind == "Warning" and saved in message and "Lost" not in message
    assert r.status["lastCheckpoint"] == {"step": record["step"], "path": record["checkpoint"]}


def ended_at(p: dict, at) -> dict:
    p["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = st.now_iso(at)
    return p


def test_a_peer_that_saved_first_waits_for_the_deleted_pod_to_say_it_was_deleted(trainer_runs):
    """The gang stops together: a pod nobody deleted ends with a "preempted" record as well,
    and may end first (seen on the podman node: rank 0's record named, not the deleted rank
    1). Its save is a consequence: the operator waits up to PEERS_GRACE for the pod that was
    stopped, which is then named; without it, the peer's save is still Preempted, free."""
    run = trainer_runs.get("sigterm")
    running = run_to([pod(0), pod(1)], backoffLimit=3)
    peer = ended_at(pod(0, real=run), T0)
    waiting = decide(running.status, [peer, deleted(pod(1))], T0 + timedelta(seconds=1),
                     backoffLimit=3)  # fmt: skip
    assert (waiting.phase, waiting.delete) == ("Running", []) and "failure" not in waiting.status
    assert st.condition(waiting.status["conditions"], "Running")["reason"] == "GangEnding"
    told = decide(waiting.status, [peer, deleted(pod(1, real=run))], T0 + timedelta(seconds=2),
                  backoffLimit=3)  # fmt: skip
    failure = told.status["failure"]
    assert failure["pod"] == "tiny-node-1" and "the pod was deleted" in failure["message"]
    assert (told.phase, told.status["restarts"]) == ("Restarting", 0)
    late = decide(waiting.status, [peer, deleted(pod(1))], T0 + timedelta(seconds=16),
                  backoffLimit=3)  # fmt: skip
    assert late.status["failure"]["reason"] == "Preempted" and late.status["restarts"] == 0


def test_the_deleted_pod_not_its_peer_that_saved_with_it_is_the_cause(trainer_runs):
    """Seen on the podman node: tiny-node-1 deleted, both trainers saved at the SIGTERM and
    ended before the operator looked. Equally telling records: the pod the cluster stopped
    explains its peer's, whatever their ranks."""
    run = trainer_runs.get("sigterm")
    running = run_to([pod(0), pod(1)], backoffLimit=3)
    r = decide(running.status, [pod(0, real=run), deleted(pod(1, real=run))], backoffLimit=3)
    failure = r.status["failure"]
    assert failure["reason"] == "Preempted" and failure["pod"] == "tiny-node-1", failure
    assert "the pod was deleted" in failure["message"]


def test_a_deleted_pod_that_ends_without_a_record_is_lost():
    running = run_to([pod(0), pod(1)], backoffLimit=3)
    killed = deleted(pod(1, phase="Failed", exit_code=137, reason="Error"))
    r = decide(running.status, [pod(0), killed], backoffLimit=3)
    assert r.status["failure"]["reason"] == "Lost" and r.status["restarts"] == 1
    # ... and one that vanished before it was seen to end.
    gone = decide(running.status, [pod(0)], backoffLimit=3)
    assert gone.status["failure"]["reason"] == "Lost"
    assert st.diagnose(deleted(pod(1))) is None  # still running: not a failure yet


def test_a_gang_lost_whole_is_replaced_at_once_not_at_the_next_resync():
    """Every pod gone while no operator ran (deleted, a node pool drained): no pod event will
    come for them, so the decision that restarts the gang asks to be looked at again now,
    and the next look creates the new gang. With a pod still to delete, its deletion event
    is what wakes the next look, and no early look is asked for."""
    running = run_to([pod(0), pod(1)], backoffLimit=3)
    lost = decide(running.status, [], backoffLimit=3)
    assert lost.phase == "Restarting" and lost.status["failure"]["reason"] == "Lost"
    assert lost.requeue_after is not None and lost.requeue_after < 1
    again = decide(lost.status, [], backoffLimit=3)
    assert again.create == [0, 1] and again.status["attempt"] == 1
    one_left = decide(running.status, [pod(0)], backoffLimit=3)
    assert one_left.delete == ["tiny-node-0"] and one_left.requeue_after is None


def test_a_stopped_gangs_records_count_though_its_pods_are_gone(trainer_runs):
    """A gang stopped by its budget is deleted as it saves; its pods are gone from the
    operator's view a moment after their records are written. The records remembered
    (``ended``) still say where it stopped: the step and the checkpoint the SIGTERM saved."""
    from test_cost import budget_job

    from ftjob.operator import lifecycle

    run = trainer_runs.get("sigterm")
    record = contract.parse(run.record)
    name, spec = budget_job(0.5)
    running = run_to([pod(0), pod(1)])
    status = running.status | {"cost": {"gpuHours": 1.0, "attempts": []}}
    stopped = lifecycle.decide(spec, name, 1, status, [pod(0), pod(1)], T0)
    assert stopped.phase == "Stopped" and "lastCheckpoint" not in stopped.status
    ended = [deleted(pod(0, real=run)), deleted(pod(1, real=run))]
    unseen = lifecycle.decide(spec, name, 1, stopped.status, [], T0)
    assert "lastCheckpoint" not in unseen.status  # gone before any look: nothing to read
    told = lifecycle.decide(spec, name, 1, stopped.status, [], T0, ended=ended)
    assert told.phase == "Stopped" and told.create == []
    assert told.status["lastCheckpoint"] == {"step": record["step"], "path": record["checkpoint"]}
    message = {c["type"]: c for c in told.status["conditions"]}["Stopped"]["message"]
    assert f"reached at step {record['step']}:" in message
