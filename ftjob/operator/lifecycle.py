"""PURE: one reconcile of a FineTuneJob -> the new status and what to change.

:func:`decide` is level-triggered: it looks only at the job (spec, generation, the status
written last time), the pods that exist now, the latest progress snapshot and the clock.
Run it twice on the same inputs and the second run asks for nothing new, which is what
makes handler retries and operator restarts safe.

Recovery is a ladder. Inside the pods torchrun restarts the workers of every node in place
(runPolicy.inPlaceRestarts per gang); rank 0 reports how often (``restartsInPlace``) and
the status counts them across gangs. When a pod fails (the in-place budget spent, a pod or
node lost, a stall), the gang is the unit: every pod of the attempt is deleted and the next
attempt starts once they are gone, resuming from the newest checkpoint on the shared volume,
its pods kept away from the nodes a failure was blamed on (``status.badNodes``). A
permanent failure, or backoffLimit spent, fails the job.

An edit of what the pods are made of (each pod says: render.template) replaces a gang that
never ran by one made from the edited spec, spending no budget; a gang that ran keeps its
spec until the next gang, and an Event says how to apply the edit sooner.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ftjob.api import contract
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.operator import foreseen, queueing
from ftjob.operator import status as st
from ftjob.plan.describe import planned_condition

TERMINAL = ("Succeeded", "Failed")
# Without pods, checkpoints kept, until resumed: by the user (Suspended: runPolicy.suspend) or
# by a raised budget (Stopped: spec.budget spent).
PAUSED = ("Suspended", "Stopped")
# A Pending gang's reasons when a pod of it cannot start: the scheduler's, or the kubelet's.
STUCK = ("Unschedulable", *st.CANNOT_START)
# The kubelet alternates these two while it backs off pulling one image: one cause, one Event.
SAME_CAUSE = {"ImagePullBackOff": "ErrImagePull"}


@dataclass
class Decision:
    status: dict[str, Any]
    create: list[int] = field(default_factory=list)  # node ranks to create for status.attempt
    delete: list[str] = field(default_factory=list)  # pod names to delete
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    delete_job: bool = False  # ttlSecondsAfterFinished ran out
    requeue_after: float | None = None  # a deadline that no watch event will announce

    @property
    def phase(self) -> str:
        return self.status["phase"]


class _Step:
    """Accumulates one decision; ``set`` writes phase, conditions and an Event on change."""

    def __init__(
        self, old: dict, spec, generation: int | None, pods: list[dict], now: datetime, name=""
    ):
        self.old, self.spec, self.generation, self.now, self.name = old, spec, generation, now, name
        self.workload: tuple[str, dict | None] | None = None  # Kueue's, when one was read
        self.template: dict[str, str] | None = None  # render.template of the spec, when given
        self.snapshot: dict | None = None  # rank 0's progress, when held (its plan, its phase)
        self.new = copy.deepcopy(old)
        self.new["observedGeneration"] = generation
        self.new.setdefault("attempt", 0)
        self.new.setdefault("restarts", 0)
        self.new.setdefault("restartsInPlace", 0)
        self.pods = pods
        self.decision = Decision(status=self.new)

    @property
    def attempt(self) -> int:
        return self.new["attempt"]

    @property
    def current(self) -> dict[int, dict]:
        """The pods of the attempt now running, by node rank."""
        return {st.rank_of(p): p for p in self.pods if st.attempt_of(p) == self.attempt}

    @property
    def missing(self) -> list[int]:
        """Node ranks of the current attempt that have no pod."""
        return [r for r in range(self.spec.resources.nodes) if r not in self.current]

    def set(self, phase: str, reason: str, message: str, created: bool = False) -> Decision:
        old_phase = self.old.get("phase")
        self.new["phase"] = phase
        self.new["conditions"] = st.conditions(
            self.new.get("conditions", []),
            phase,
            reason,
            message,
            self.now,
            self.generation,
            created,
        )
        if phase in TERMINAL and self.new.get("progress"):
            self.new["progress"] = st.ended(self.new["progress"], phase)
        # A pod that cannot start says so once per cause (its reason), as a Warning.
        was = _cond_reason(self.old, "Running")
        stuck = reason in STUCK and SAME_CAUSE.get(reason, reason) != SAME_CAUSE.get(was, was)
        if phase != old_phase or stuck:
            kind = "Warning" if phase in ("Failed", "Restarting") or stuck else "Normal"
            self.decision.events.append((kind, reason, st.event_message(message)))
        return self.decision

    def delete_live(self, pods: list[dict]) -> None:
        self.decision.delete += [
            p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")
        ]

    def fail(self, failure: dict, note: str = "") -> Decision:
        self.new["failure"] = failure
        self.new["completionTime"] = st.now_iso(self.now)
        # Kill what still runs (ranks hung in a collective hold GPUs); finished pods stay for
        # `kubectl logs`, and go with the job.
        self.delete_live([p for p in self.pods if not st.terminated(p)])
        # The note first: the Event's first words say why it is final ("backoffLimit (3)
        # reached"), its cause follows on the same line (status.event_message).
        message = f"{note}: {failure['message']}" if note else failure["message"]
        return self.set("Failed", failure["reason"], message)


def _since(old: dict, now: datetime) -> float:
    return (now - (st.parse_time(old) or now)).total_seconds()


def decide(
    spec: FineTuneJobSpec,
    name: str,
    generation: int | None,
    old_status: dict | None,
    pods: list[dict],
    now: datetime,
    snapshot: dict | None = None,
    workload: tuple[str, dict | None] | None = None,
    template: dict[str, str] | None = None,
    ended: list[dict] | None = None,
) -> Decision:
    """The new status of job ``name`` and the changes that bring its pods in line.

    ``workload``: Kueue's Workload of the current gang (name, object or None when absent), if
    the operator read it (queueing.workload_to_read). ``template``: what the spec's pods are
    made of (render.template, with the operator's default image); without it an edit of the
    spec is not compared with the running gang. ``ended``: pods seen ending with a termination
    record, some perhaps gone since (their records still say where the gang stopped). The
    steps below run in order; the first that decides ends the reconcile.
    """
    s = _Step(old_status or {}, spec, generation, pods, now, name)
    s.workload, s.template, s.snapshot = workload, template, snapshot
    _observe(s, snapshot, ended or [])
    if s.old.get("phase") in TERMINAL:
        return _finished(s)
    decision = _steps(s)
    live = [p for p in s.current.values() if not p["metadata"].get("deletionTimestamp")]
    has_pods = bool(live) and decision.phase not in PAUSED
    s.new["conditions"] = queueing.conditions(
        s.new.get("conditions", []), spec.scheduling.queue, workload, has_pods, now, generation
    )
    return decision


def _steps(s: _Step) -> Decision:
    steps = (_will_fit, _suspension, _deadline, _previous_gang, _gang_failures, _gang_done, _edited)
    for step in steps:
        decision = step(s)
        if decision is not None:
            return decision
    return _create_or_wait(s)


def gang_snapshot(held: tuple[int, dict] | None, status: dict | None) -> dict | None:
    """The snapshot to decide with: the one held (attempt of the pod that served it,
    snapshot), if that pod is of the gang ``status`` names; None if it is an older gang's (a
    fetch that ended after the new gang started): that gang's restarts in place are counted
    already, and the new gang's count starts at 0."""
    if held is None:
        return None
    attempt, snapshot = held
    return snapshot if attempt == (status or {}).get("attempt", 0) else None


def _observe(s: _Step, snapshot: dict | None, ended: list[dict]) -> None:
    """Rank 0's progress snapshot, when the operator has one, goes into the status: progress,
    the preflight's figures, stragglers and the workers' restarts in place (the current
    gang's: see :func:`gang_snapshot`)."""
    new = s.new
    if snapshot and s.old.get("phase") not in TERMINAL:  # a finished job's numbers are final
        new["progress"] = st.progress(snapshot)
        new["lastCheckpoint"] = st.last_checkpoint(snapshot) or new.get("lastCheckpoint")
        if (preflight := st.preflight(snapshot)) is not None:
            new["preflight"] = preflight
        if "stragglers" in snapshot:
            new["stragglers"] = st.stragglers(snapshot)
        _count_in_place(s, st.restarts_in_place(snapshot))
    _observe_records(s, ended)
    if new.get("lastCheckpoint") is None:
        new.pop("lastCheckpoint", None)


def _observe_records(s: _Step, ended: list[dict]) -> None:
    """The numbers the current gang's ended pods left in their termination records: a job
    that ends between two reads of rank 0's progress still shows the step, losses and
    checkpoint it ended with (and a failed one the step it reached), even where a pod is gone
    already (``ended``: a gang stopped by its budget is deleted as it saves)."""
    current = s.current
    gone = [p for p in ended if st.attempt_of(p) == s.attempt and st.rank_of(p) not in current]
    final = st.final_progress([*current.values(), *gone])
    if not final:
        return
    s.new["progress"] = st.with_final(s.new.get("progress"), final)
    saved = st.last_checkpoint(final)
    if saved and saved["step"] > (s.new.get("lastCheckpoint") or {}).get("step", -1):
        s.new["lastCheckpoint"] = saved


def _count_in_place(s: _Step, now_in_gang: int | None) -> None:
    """restartsInPlace: the job's total across gangs; attemptRestartsInPlace: this gang's,
    as torchrun counts them (TORCHELASTIC_RESTART_COUNT), which only grows within a gang."""
    new = s.new
    before = new.get("attemptRestartsInPlace", 0)
    if now_in_gang is None or now_in_gang <= before or s.old.get("phase") in TERMINAL:
        return
    new["attemptRestartsInPlace"] = now_in_gang
    new["restartsInPlace"] += now_in_gang - before
    s.decision.events.append(
        (
            "Warning",
            "RestartedInPlace",
            f"workers of attempt {s.attempt} restarted in place ({now_in_gang} in this gang, "
            f"{new['restartsInPlace']} in all): the pods stay, training resumes from the "
            "newest checkpoint",
        )
    )


def _finished(s: _Step) -> Decision:
    """Succeeded or Failed already: tidy up and wait for the TTL."""
    s.delete_live([p for p in s.pods if not st.terminated(p)])
    ttl = s.spec.run_policy.ttl_seconds_after_finished
    if ttl is not None:
        left = ttl - _since(s.new.get("completionTime"), s.now)
        if left <= 0:
            s.decision.delete_job = True
        else:
            s.decision.requeue_after = left
    created = (st.condition(s.old.get("conditions", []), "Created") or {}).get("status")
    return s.set(s.old["phase"], _cond_reason(s.old), _cond_message(s.old), created == "True")


# The Planned condition's status for each verdict of ftjob.plan.describe; any other
# (its "Unknown") is status Unknown, reason NOT_PLANNED. A fit within the plan's error is
# FITS_TIGHT, said once by a Warning Event (TIGHT_MARGIN).
PLANNED = {"Fits": True, "WillNotFit": False, "CannotRun": False}
NOT_PLANNED, FITS_TIGHT, TIGHT_MARGIN = "NotPlanned", "FitsTight", "TightMargin"


def _will_fit(s: _Step) -> Decision | None:
    """The plan's Planned condition, before the first pod (resources are immutable)."""
    planned = planned_condition(s.spec)
    _record_plan(s, _best_plan(planned, s.snapshot))
    if not planned["allowed"] and not s.new.get("startTime"):
        failure = {"reason": contract.WILL_NOT_FIT, "message": planned["message"]}
        return s.fail(failure, "spec.plan.enforce is on: no pod was started")
    return None


def _best_plan(planned: dict, snapshot: dict | None) -> tuple[str, str, bool]:
    """(reason, message, tight) of the best plan known, in the order ftjob.operator.foreseen
    judges an OOM by: the one rank 0 made from the model's own config.json and serves in its
    progress (ftjob.trainer.model.planned.published) where it has a verdict, else the
    operator's own (which cannot read a model on the volume)."""
    served = (snapshot or {}).get("plan")
    if isinstance(served, dict) and served.get("reason") in PLANNED:
        return served["reason"], str(served.get("verdict", "")), bool(served.get("tight"))
    return planned["reason"], planned["message"], bool(planned["tight"])


def _record_plan(s: _Step, plan: tuple[str, str, bool]) -> None:
    """The plan into the Planned condition. A verdict, once known, stays: the door's "not
    planned" of a model on the volume does not hide what a gang's rank 0 found."""
    reason, message, tight = plan
    old = st.condition(s.new.get("conditions") or [], "Planned") or {}
    fits = PLANNED.get(reason)
    if fits is None and old.get("status") in ("True", "False"):
        return
    reason = FITS_TIGHT if tight else reason if fits is not None else NOT_PLANNED
    s.new["conditions"] = st.set_condition(
        s.new.get("conditions", []), "Planned", fits, reason, message, s.now, s.generation
    )
    if reason == FITS_TIGHT and old.get("reason") != FITS_TIGHT:
        said = f"the plan's margin is tight (its error could tip it): {message}"
        s.decision.events.append(("Warning", TIGHT_MARGIN, said))


def _suspension(s: _Step) -> Decision | None:
    """Suspended: no pods; checkpoints stay on the volume. Resumed: a new gang. A budget
    reached stops the job the same way (phase Stopped, reason BudgetReached) until it is
    raised; a user's suspend says Suspended whatever the budget, so each has its own word."""
    spent = _budget_spent(s)
    if s.spec.run_policy.suspend or spent:
        s.delete_live(s.pods)
        s.new.pop(WAITING_SINCE, None)
        if s.spec.run_policy.suspend:
            return s.set(
                "Suspended", "Suspended", "runPolicy.suspend is true: the pods are removed"
            )
        return s.set("Stopped", BUDGET_REACHED, spent)
    if s.old.get("phase") in PAUSED:
        # A resumed job is a new gang (new rendezvous), but not a restart after a failure;
        # like a batch/v1 Job, the active deadline counts from the resume.
        _next_gang(s)
        s.new["startTime"] = st.now_iso(s.now)
        s.decision.events.append(("Normal", "Resumed", f"resuming as attempt {s.attempt}"))
    return None


BUDGET_REACHED = "BudgetReached"


def _budget_spent(s: _Step) -> str | None:
    """Why the job has spent its spec.budget (status.cost, from the last look at its pods),
    or None. Its pods are then deleted as on a preemption: SIGTERM, and the trainer saves a
    checkpoint at the next step boundary (checkpoint.gracePeriodSeconds) before it exits."""
    budget, cost = s.spec.budget, s.old.get("cost") or {}
    reached = None
    if budget.gpu_hours is not None and cost.get("gpuHours", 0) >= budget.gpu_hours:
        reached = f"{budget.gpu_hours:g} GPU-hours ({cost['gpuHours']:g} spent)"
    elif budget.amount is not None and (cost.get("amount") or 0) >= budget.amount:
        reached = f"{budget.amount:g} {cost.get('currency', '')} ({cost['amount']:g} spent)"
    elif budget.node_hours is not None and cost.get("nodeHours", 0) >= budget.node_hours:
        reached = f"{budget.node_hours:g} node-hours ({cost['nodeHours']:g} spent)"
    if reached is None:
        return None
    step = (s.new.get("progress") or {}).get("step", 0)
    return (
        f"budget of {reached} reached at step {step}: the pods are stopped as on a preemption "
        "(a checkpoint at the next step); raise spec.budget to resume from it"
    )


def _deadline(s: _Step) -> Decision | None:
    """activeDeadlineSeconds."""
    deadline = s.spec.run_policy.active_deadline_seconds
    if deadline is None or not s.new.get("startTime"):
        return None
    left = deadline - _since(s.new["startTime"], s.now)
    if left <= 0:
        failure = {
            "reason": "DeadlineExceeded",
            "message": f"the job was active longer than activeDeadlineSeconds ({deadline})",
        }
        return s.fail(failure)
    s.decision.requeue_after = left
    return None


def _previous_gang(s: _Step) -> Decision | None:
    """Pods of an older gang go first; the new one reuses their names."""
    stale = [p for p in s.pods if st.attempt_of(p) != s.attempt]
    if not stale:
        return None
    s.delete_live(stale)
    failure = s.new.get("failure") or {}
    message = (
        f"waiting for {len(stale)} pod(s) of the previous gang to go before attempt {s.attempt}"
    )
    # A gang replaced for an edit, or given back partly placed, never ran: still Pending, and
    # no Warning. The give-back's message says all while its pods go (the next gang's time).
    running = st.condition(s.old.get("conditions") or [], "Running") or {}
    if running.get("reason") == EDITED:
        return s.set("Pending", EDITED, f"{message} (made from the edited spec)")
    if running.get("reason") == PARTLY_PLACED:
        return s.set("Pending", PARTLY_PLACED, running.get("message") or message)
    return s.set("Restarting", failure.get("reason", "Restarting"), message)


# The reasons of an edit of the spec: applied to a gang that never ran (a new gang made from
# it), or waiting for the next gang (a running gang keeps the spec it was made from).
EDITED, EDIT_WAITS = "SpecChanged", "SpecChangeWaits"


def _edited(s: _Step) -> Decision | None:
    """An edit of what the pods are made of (render.template: the image, env, scheduling,
    ...). A gang that never ran (phase Pending: its pods have not all run, so no rank trained;
    stuck Unschedulable, on a wrong image, or just being placed) is replaced at once by a gang
    made from the edited spec, spending no restart budget. A gang that ran keeps its spec; an
    Event says so once per generation, and how to apply it."""
    made = [t for p in s.current.values() if (t := st.template_of(p)) is not None]
    changed = _changes(made, s.template or {})
    if not changed:
        return None
    if s.old.get("phase") != "Pending":
        if s.old.get("observedGeneration") != s.generation:
            s.decision.events.append(("Warning", EDIT_WAITS, (
                f"spec changed at generation {s.generation} ({changed}): attempt {s.attempt} "
                "is running and keeps the spec it was made from; the next gang takes the "
                "change: suspend and resume the job (runPolicy.suspend) to apply it now, or "
                "delete and re-apply it to start over")))  # fmt: skip
        return None
    old_attempt = s.attempt
    _next_gang(s)
    message = (
        f"spec changed at generation {s.generation} ({changed}): attempt {old_attempt} never "
        f"ran, so it is replaced by attempt {s.attempt} made from the edited spec; no restart "
        f"budget spent ({s.new['restarts']} of {s.spec.run_policy.backoff_limit} used)"
    )
    s.decision.events.append(("Normal", EDITED, message))
    return s.set("Pending", EDITED, message)


def _changes(made: list[dict[str, str]], wanted: dict[str, str]) -> str:
    """What differs between the pods' templates and the spec's, in words ("image a -> b,
    env"); "" when nothing does (or either side does not say)."""
    if not made or not wanted:
        return ""
    words = []
    for key, value in wanted.items():
        before = sorted({m[key] for m in made if key in m and m[key] != value})
        if before:
            words.append(f"{key} {', '.join(before)} -> {value}" if key == "image" else key)
    return ", ".join(words)


def _gang_failures(s: _Step) -> Decision | None:
    """A failed, evicted or lost pod fails the whole gang."""
    current = s.current
    was_complete = s.old.get("phase") == "Running" and s.old.get("attempt") == s.attempt
    failures = [f for f in map(st.diagnose, current.values()) if f]
    if was_complete:
        failures += [
            {
                "reason": "Lost",
                "message": f"pod of node rank {r} disappeared while the gang was running",
                "pod": f"{s.name}-node-{r}",
                "rank": r,
            }
            for r in s.missing
        ]
    if not failures:
        return None
    stopped = frozenset(
        p["metadata"]["name"] for p in current.values() if st.stopped_from_outside(p)
    )
    cause = st.root_cause(failures, stopped)
    if wait := _peers_may_say_more(s, cause, stopped):
        s.decision.requeue_after = min(wait, s.decision.requeue_after or wait)
        said = f"waiting up to {PEERS_GRACE:.0f} s for the other pods to say why"
        return s.set("Running", "GangEnding", f"{cause['pod']} ended ({cause['reason']}); {said}")
    return _gang_failed(s, cause)


# A gang ends together: once a node's process fails, the other nodes' agents stop within
# seconds, and the pod that ends first is not always the one that failed first (a node whose
# rendezvous store went down with the failing node crashes at once, with no record). Seen on a
# two-node job whose rank 0 was refused its model: rank 1's bare Error came first, and a restart
# was spent on it before BadModel was seen; on two real nodes, rank 1's collective error
# ("Connection closed by peer") beside rank 0's SIGKILL; and on the podman node, rank 0's save
# at rank 1's SIGTERM (rank 1's pod deleted) ending before rank 1's own. A failure that may be
# another's consequence (status.consequence) waits this long for a telling peer.
PEERS_GRACE = 15.0


def _peers_may_say_more(s: _Step, cause: dict, stopped: frozenset[str]) -> float:
    """Seconds to wait before acting on ``cause``: only a possible consequence of a peer's
    (status.consequence), while another pod of the gang still runs, within PEERS_GRACE of its
    pod's end; else 0."""
    pod = next((p for p in s.current.values() if p["metadata"]["name"] == cause.get("pod")), None)
    others_run = any(st.running(p) for p in s.current.values() if p is not pod)
    if not st.consequence(cause, stopped) or pod is None or not others_run:
        return 0.0
    ended = st.parse_time((st.terminated(pod) or {}).get("finishedAt"))
    left = PEERS_GRACE - ((s.now - ended).total_seconds() if ended else PEERS_GRACE)
    return max(left, 0.0)


def _gang_done(s: _Step) -> Decision | None:
    """Every node exited 0 and rank 0 names the export it wrote (its termination record):
    done. Exit 0 alone is not enough: a wrong image or wrapper can exit 0 without a model."""
    current = s.current
    if s.missing or not all(st.succeeded(p) for p in current.values()):
        return None
    model = st.export_path(current[0])
    if model is None:
        failure = {
            "reason": "Error",
            "message": f"{s.name}-node-0 (node rank 0): every node exited 0 but rank 0 named no "
            "exported model in its termination message: is the image an ftjob trainer?",
            "pod": f"{s.name}-node-0",
            "rank": 0,
        }
        return s.fail(failure, "not retried")
    s.new["completionTime"] = st.now_iso(s.now)
    s.new["modelPath"] = model
    # A failure that a restart got past stays: it explains `restarts`.
    return s.set("Succeeded", "Completed", f"training finished; model at {model}", True)


def _create_or_wait(s: _Step) -> Decision:
    """Create what is missing; wait for the rest; watch a running gang for a stall."""
    current = s.current
    if s.missing and (held := _held_back(s)):
        return held
    if s.missing:
        s.decision.create = s.missing
        s.new.setdefault("startTime", st.now_iso(s.now))
        return s.set(
            "Pending", "Creating", f"creating {len(s.missing)} pod(s) of attempt {s.attempt}"
        )
    if all(st.running(p) or st.succeeded(p) for p in current.values()):
        return _running(s)
    gated = sum(st.queued(p) for p in current.values())
    if gated:
        s.new.pop(WAITING_SINCE, None)  # waiting for quota is not being stuck
        return s.set("Pending", "Queued", _queued_message(s, gated), True)
    if split := _split(s):
        return split
    waiting = sorted({w for p in current.values() if (w := st.waiting_reason(p))})
    message = _waiting_for(list(current.values()))
    causes = [c for p in current.values() if not st.running(p) and (c := st.not_starting(p))]
    causes.sort(key=st.gang_echo)  # the scheduler's verdict on the nodes first
    reason, message = (
        (causes[0][0], f"{message}: {causes[0][1]}")
        if causes
        else ("PodsPending", message + (f" ({', '.join(waiting)})" if waiting else ""))
    )
    return _start_limit(s, reason, message) or s.set("Pending", reason, message, True)


WAITING_SINCE = "waitingSince"
# Where gangs are no PodGroups (the API not served, or --pod-groups off), a gang partly bound
# this long gives its bound pods back and is made again, whole, this much later (no restart
# budget spent): a gang never holds nodes while it waits for others (a queued one is Kueue's,
# which admits it whole).
# The grace is shorter than torch's 60 s for connecting to node 0's rendezvous store: where
# node 0's pod is the one not placed, the others' agents fail then (on real nodes, ~70 s after
# their pods were made), which would cost a restart for what is no failure.
PARTLY_PLACED, PARTLY_SINCE, WHOLE_AFTER = "PartlyPlaced", "partlyPlacedSince", "wholeAfter"
SPLIT_GRACE_SECONDS, SPLIT_BACKOFF_SECONDS = 30.0, 30.0
SPLIT_FIX = (
    "serve Kubernetes 1.37's PodGroup API (feature gate GenericWorkload and "
    "scheduling.k8s.io/v1beta1 on the API server, scheduler and controller manager), which "
    "places a gang whole, or queue the job with Kueue (spec.scheduling.queue)"
)


def _split(s: _Step) -> Decision | None:
    """A gang some of whose pods are bound while another cannot be placed, without a PodGroup
    (a cluster before 1.37, or the API off): after :data:`SPLIT_GRACE_SECONDS` its pods are
    given back, so that the nodes they held serve other jobs, and the gang waits whole."""
    pods = list(s.current.values())
    placed = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
    stuck = [p for p in pods if (st.not_starting(p) or ("",))[0] == "Unschedulable"]
    if any(st.grouped(p) for p in pods) or s.spec.scheduling.queue or not placed or not stuck:
        s.new.pop(PARTLY_SINCE, None)
        return None
    waited = s.new.get(WAITING_SINCE)
    if waited and _since(waited, s.now) >= s.spec.run_policy.start_timeout_seconds:
        return None  # the start limit is reached: it fails the job (_start_limit)
    left = SPLIT_GRACE_SECONDS - _since(s.new.setdefault(PARTLY_SINCE, st.now_iso(s.now)), s.now)
    if left > 0:
        s.decision.requeue_after = min(left, s.decision.requeue_after or left)
        return None
    s.new.pop(PARTLY_SINCE)
    old_attempt, cause = s.attempt, st.not_starting(stuck[0])[1]
    waiting = s.new.get(WAITING_SINCE)
    _next_gang(s)
    if waiting:  # the start limit counts from the first gang that waited, over every split
        s.new[WAITING_SINCE] = waiting
    s.new[WHOLE_AFTER] = st.now_iso(s.now + timedelta(seconds=SPLIT_BACKOFF_SECONDS))
    message = (
        f"attempt {old_attempt} was partly placed for {SPLIT_GRACE_SECONDS:.0f} s ({len(placed)} "
        f"of {len(pods)} pods bound; {cause}): its bound pods were given back, and the gang is "
        f"made again whole as attempt {s.attempt} in {SPLIT_BACKOFF_SECONDS:.0f} s, no restart "
        f"budget spent; fix: {SPLIT_FIX}"
    )
    s.decision.events.append(("Warning", PARTLY_PLACED, message))
    return s.set("Pending", PARTLY_PLACED, message)


def _held_back(s: _Step) -> Decision | None:
    """The next gang of a split one waits out its backoff before it is made (:func:`_split`)."""
    after = st.parse_time(s.new.get(WHOLE_AFTER))
    if after is None or after <= s.now:
        s.new.pop(WHOLE_AFTER, None)
        return None
    left = (after - s.now).total_seconds()
    s.decision.requeue_after = min(left, s.decision.requeue_after or left)
    cond = st.condition(s.new.get("conditions") or [], "Running") or {}
    return s.set("Pending", PARTLY_PLACED, cond.get("message") or f"waiting {left:.0f} s")


def _waiting_for(pods: list[dict]) -> str:
    pending = sum(not st.running(p) for p in pods)
    if any(st.grouped(p) for p in pods):  # a PodGroup: the scheduler binds all or none
        return f"waiting for the whole gang to be placed ({pending} pod(s), all or none)"
    return f"waiting for {pending} pod(s) to run"


def _start_limit(s: _Step, reason: str, message: str) -> Decision | None:
    """runPolicy.startTimeoutSeconds: a gang whose pods all exist but do not all run (not
    gated by Kueue) fails when it has waited that long, with what it waited for."""
    since = s.new.setdefault(WAITING_SINCE, st.now_iso(s.now))
    limit = s.spec.run_policy.start_timeout_seconds
    left = limit - _since(since, s.now)
    if left > 0:
        s.decision.requeue_after = min(left, s.decision.requeue_after or left)
        return None
    failure = {
        "reason": "StartTimeout",
        "message": f"attempt {s.attempt} did not start within runPolicy.startTimeoutSeconds "
        f"({limit}): {reason}: {message}",
    }
    return s.fail(failure, "not retried")


def _queued_message(s: _Step, gated: int) -> str:
    """Where the gang waits: Kueue admits it whole when the ClusterQueue behind the job's
    LocalQueue has quota for every pod; its Workload's QuotaReserved condition says what is
    short (the Queued condition, when the operator read it)."""
    queued = st.condition(s.new.get("conditions", []), queueing.QUEUED) or {}
    short = ""
    if s.workload is not None:
        short = ": " + queueing.verdict(s.spec.scheduling.queue, *s.workload)[0]["message"]
    elif queued.get("status") == "True":
        short = ": " + queued.get("message", "")
    return (
        f"queued in Kueue's LocalQueue {s.spec.scheduling.queue}: {gated} of "
        f"{s.spec.resources.nodes} pod(s) gated until the gang is admitted whole{short}"
    )


def _running(s: _Step) -> Decision:
    """Every pod runs; restart the gang if it made no progress for too long.

    Two clocks: before the first training step (rank 0 reports a startup phase --
    downloading, preparing data, loading -- or nothing yet from this gang) the generous
    startupTimeoutSeconds counts from when every pod ran; from then on stallTimeoutSeconds
    counts from rank 0's latest report.
    """
    policy, progress = s.spec.run_policy, s.new.get("progress") or {}
    s.new.pop(WAITING_SINCE, None)  # started: startTimeoutSeconds is over for this gang
    running_cond = st.condition(s.old.get("conditions", []), "Running")
    was_running = (
        s.old.get("phase") == "Running" and running_cond and running_cond["status"] == "True"
    )
    since = (st.parse_time(running_cond["lastTransitionTime"]) if was_running else None) or s.now
    reported = st.parse_time(progress.get("updateTime"))
    fresh = reported is not None and reported >= since  # not the previous gang's report
    if not fresh or progress.get("phase") in contract.STARTUP_PHASES:
        limit, quiet = policy.startup_timeout_seconds, (s.now - since).total_seconds()
        phase = progress.get("phase", "starting") if fresh else "starting"
        failure = {
            "reason": "StartupTimeout",
            "message": f"no training step {int(quiet)}s after every pod ran "
            f"(startupTimeoutSeconds {limit}); rank 0 is {phase}",
        }
    else:
        limit, quiet = policy.stall_timeout_seconds, (s.now - reported).total_seconds()
        failure = {
            "reason": "Stalled",
            "message": f"no training progress for {int(quiet)}s (stallTimeoutSeconds {limit}) "
            f"at step {progress.get('step', 0)}",
        }
    if quiet >= limit:
        return _gang_failed(s, failure)
    left = limit - quiet
    s.decision.requeue_after = min(left, s.decision.requeue_after or left)
    return s.set("Running", "AllPodsRunning", f"all {s.spec.resources.nodes} pods run", True)


# A look again "now" (requeue_after): 0 would read as "no deadline" to the caller.
AT_ONCE = 0.05


def _gang_failed(s: _Step, failure: dict) -> Decision:
    """Restart the gang as attempt+1, or fail the job if that cannot help any more."""
    new, limit = s.new, s.spec.run_policy.backoff_limit
    previous = (s.old.get("failure") or {}).get("reason")
    if failure["reason"] == "Preempted":
        return _preempted(s, failure)
    if failure["reason"] == "OOMKilled":  # held to the plan: its figure, foreseen or a miss
        failure, held = foreseen.judged(failure, s.spec, s.snapshot)
        if held == foreseen.FORESEEN:
            return s.fail(failure, "not retried: the plan foresaw it (spec.plan.enforce false)")
        if held == foreseen.MISS:  # the operator's log says it too (every Event is logged)
            miss = st.event_message(failure["message"])
            s.decision.events.append(("Warning", "PlannerMiss", miss))
    if failure["reason"] in st.PERMANENT:
        return s.fail(failure, "not retried")
    if failure["reason"] == "CudaOOM" and previous == "CudaOOM":
        return s.fail(failure, "CUDA out of memory twice in a row: not retried")
    if new["restarts"] >= limit:
        return s.fail(failure, f"backoffLimit ({limit}) reached")
    _keep_away(s, failure)  # only when there is a next gang to keep away
    new["failure"] = failure
    new["restarts"] += 1
    _next_gang(s)
    avoid = f"; avoiding node(s) {', '.join(bad_nodes(new))}" if new.get("badNodes") else ""
    message = (
        f"restarting the gang as attempt {new['attempt']} (restart {new['restarts']} of "
        f"{limit}) after {failure['reason']}{avoid}: {failure['message']}"
    )
    return s.set("Restarting", failure["reason"], message)


def _preempted(s: _Step, failure: dict) -> Decision:
    """The cluster stopped a pod of the gang (Kueue's TerminationTarget, or Kubernetes'
    DisruptionTarget: an eviction, a preemption, a taint, a deleted node): not the job's fault,
    so no restart budget is spent; the next gang (queued for admission again where the job
    has a Kueue queue) resumes from the newest checkpoint."""
    s.new["failure"] = failure
    _next_gang(s)
    queues = " queues for admission again," if s.spec.scheduling.queue else " starts,"
    message = (
        f"preempted: attempt {s.new['attempt']}{queues} no restart budget spent "
        f"({s.new['restarts']} of {s.spec.run_policy.backoff_limit} used): {failure['message']}"
    )
    return s.set("Restarting", "Preempted", message)


def _next_gang(s: _Step) -> None:
    """The next attempt: a new gang, whose own restarts in place start at 0, made once the
    old gang's pods are gone. Their deletion events wake the next look; with no pod left
    (all already gone, as after an operator restart) no event will come: look again now."""
    s.new["attempt"] += 1
    s.new.pop(WAITING_SINCE, None)
    s.new["attemptRestartsInPlace"] = 0
    s.delete_live(s.pods)
    if not s.pods:
        s.decision.requeue_after = AT_ONCE


def _keep_away(s: _Step, failure: dict) -> None:
    """A failure that is the node's (status.diagnose's nodeFault) puts the node on
    status.badNodes, which the next gang's pods avoid (required node anti-affinity)."""
    bad, entry = st.note_bad_node(s.new.get("badNodes") or [], failure, s.now)
    if entry is None:
        return
    s.new["badNodes"] = bad
    s.decision.events.append(
        (
            "Warning",
            "BadNode",
            f"node {entry['node']} is kept away from the next gangs: {entry['reason']} "
            f"({entry['count']} time(s)); clear status.badNodes to allow it again",
        )
    )


def bad_nodes(status: dict | None) -> list[str]:
    """The nodes the next gang's pods must avoid."""
    return [b["node"] for b in (status or {}).get("badNodes") or [] if b.get("node")]


def _cond_reason(old: dict, type_: str | None = None) -> str | None:
    type_ = type_ or old["phase"]
    cond = st.condition(old.get("conditions", []), type_) or {}
    return cond.get("reason", old.get("phase"))


def _cond_message(old: dict) -> str:
    cond = st.condition(old.get("conditions", []), old["phase"]) or {}
    return cond.get("message", "")


def invalid(
    errors: list[str],
    generation: int | None,
    old_status: dict | None,
    now: datetime,
    reason: str = "BadInput",
):
    """A spec the API server let through but ftjob cannot run (or its profile refuses:
    ``reason`` OverLimit, NoProfile, InvalidProfile): Failed at once, with the fix."""
    if (old_status or {}).get("phase") == "Failed":
        return Decision(status=copy.deepcopy(old_status))  # already said; nothing moves
    s = _Step(old_status or {}, None, generation, [], now)
    words = "invalid spec: " if reason == "BadInput" else "refused by its profile: "
    failure = {"reason": reason, "message": words + "; ".join(errors)}
    return s.fail(failure)
