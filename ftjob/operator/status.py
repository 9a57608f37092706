"""PURE: what the operator observed -> the values it writes into a FineTuneJob's status.

Pods and the progress snapshot go in as the plain dicts the API server and the trainer
return (pods whole, or as the slim :func:`observed_pod` views the operator keeps); what
comes out is camelCase dicts in the shape of ``ftjob/api/status.py``:

* :func:`observed_pod` -- the few fields of a pod that the decisions read;
* :func:`diagnose` -- why a pod failed (OOMKilled, BadData, CudaOOM, CollectiveTimeout, ...),
  from its phase, container state, exit code and the trainer's termination record
  (ftjob.api.contract), or the log tail when the trainer left none;
* :func:`progress` -- rank 0's ``/progress`` snapshot as ``status.progress``;
* :func:`set_condition` / :func:`conditions` -- conditions after the API conventions,
  keeping ``lastTransitionTime`` while a condition's status does not change.

:mod:`ftjob.operator.lifecycle` decides what to do with these.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from ftjob.api import contract, objectives
from ftjob.operator.render import CONTAINER, LABEL_ATTEMPT, LABEL_JOB, LABEL_RANK, TEMPLATE

# One condition per phase-like state, always present, plus Planned (ftjob.plan.describe's verdict)
# and, for a job with a Kueue queue, Queued and Admitted (operator/queueing.py).
PHASE_CONDITIONS = (
    "Created",
    "Running",
    "Restarting",
    "Suspended",
    "Stopped",
    "Succeeded",
    "Failed",
)
CONDITION_TYPES = ("Planned", "Queued", "Admitted", *PHASE_CONDITIONS)
MESSAGE_LIMIT = 1500  # of the termination message kept in status (the schema allows 4096)

# A pod that left no termination record (killed, or crashed below Python) is diagnosed from
# the log tail Kubernetes puts in the message instead (FallbackToLogsOnError), by the signs
# `ftjob run` reads too (contract.LOG_SIGNS).
# Hardware trouble as CUDA, NCCL and the driver word it, in a record's message or a log tail:
# the node's fault whatever reason the trainer could give (Internal, NCCLError, Error).
LOG_HARDWARE = re.compile(
    r"uncorrectable ECC|ECC error|GPU is lost|fallen off the bus|NVML_ERROR_GPU_IS_LOST"
    r"|cudaErrorECCUncorrectable|\bXid\b|unrecoverable hardware|hardware error"
)
NO_RECORD = "no termination record (killed, or crashed below Python): diagnosed from the log tail"

_RETRY_CANNOT_HELP = "retrying cannot help -- fix it and create the job again"
ADVICE = {
    contract.BAD_DATA: f"the data cannot be trained on; {_RETRY_CANNOT_HELP}",
    contract.BAD_MODEL: f"the model source cannot be read; {_RETRY_CANNOT_HELP}",
    contract.BAD_SPEC: f"the trainer cannot read the job's spec; {_RETRY_CANNOT_HELP}",
    contract.WILL_NOT_FIT: "the plan, made from the model's config.json before anything was "
    f"loaded, says the job will not fit its memory (figures below); {_RETRY_CANNOT_HELP}",
    contract.HUB_UNREACHABLE: "the Hugging Face Hub could not be reached for a download (the "
    "network, DNS, a timeout, or the Hub busy): transient, the next gang downloads again",
    contract.STORE_UNREACHABLE: "an s3:// endpoint did not answer for a download (the network, "
    "DNS, the store down or busy): transient, the next gang resumes the download",
    "BadInput": f"the spec or the data cannot be trained on; {_RETRY_CANNOT_HELP}",
    "OOMKilled": "the pod ran out of memory: raise resources.memory, or lower "
    "dataset.maxSeqLength / training.microBatchSize",
    contract.HOST_OOM: "a trainer process could not get host memory: raise resources.memory, "
    "or lower dataset.maxSeqLength / training.microBatchSize",
    contract.CUDA_OOM: "a GPU ran out of memory: lower training.microBatchSize or "
    "dataset.maxSeqLength, or set training.activationCheckpointing: all or "
    "parallelism.cpuOffload: true",
    contract.COLLECTIVE_TIMEOUT: "a collective waited longer than "
    "network.collectiveTimeoutSeconds: a rank died or hung (the message names it when its "
    "heartbeat told), or the fabric between nodes is broken",
    contract.NCCL_TIMEOUT: "a collective waited longer than network.collectiveTimeoutSeconds: a "
    "rank died or hung, or the fabric between nodes is broken",
    contract.NCCL_ERROR: "a collective failed: a rank died, or the fabric between nodes is broken",
    contract.DISK_FULL: "the checkpoint volume is full: enlarge it, or lower checkpoint.keep",
    contract.CHECKPOINT_UNREADABLE: "the newest checkpoint cannot be loaded into this model: "
    "move it aside on the volume to resume from an older one",
    contract.EXPORT_FAILED: "the trained model could not be written to output.path",
    contract.PUSH_FAILED: "the upload to output.push failed (the destination named, the "
    "network or the credentials' rights): the export is kept and the next gang only pushes",
    contract.HUB_PUSH_FAILED: "the upload to output.push failed (the Hub, the network or the "
    "token's rights): the export is kept and the next gang only pushes",
    contract.OWNED_ELSEWHERE: "another run owns the job folder on the volume",
    contract.NODE_UNHEALTHY: "a GPU of this node failed the preflight (slow, short of memory "
    "or broken): the next gang avoids the node",
    contract.FABRIC_MISCONFIGURED: "the preflight's all-reduce is far slower than "
    "network.fabric gives, or NCCL chose the wrong transport",
    contract.VOLUME_UNUSABLE: "the preflight could not write and read back the job's volume",
    contract.INTERNAL: "the trainer failed (a bug, or something it cannot name)",
    "Evicted": "the node evicted the pod",
    "Preempted": "the pod was stopped from outside the job (Kueue preempting for another "
    "workload, an eviction such as a node drain, the scheduler's preemption, a taint, its node "
    "deleted, or the pod deleted by a person or a controller): no restart budget is spent",
    "Lost": "the pod or its node disappeared",
    "Error": "the trainer exited with an error",
}
# How the kubelet words a node-pressure eviction (the node ran short of memory, disk or
# pids): the node's fault. It evicts for the pod's own limits too ("Pod ephemeral local
# storage usage exceeds the total limit of containers ...", "Container ... exceeded its local
# ephemeral storage limit ..."): the job's, which another node would not change.
NODE_PRESSURE = "The node was low on resource"
# Retrying the same inputs cannot help: the job fails at once.
PERMANENT = contract.PERMANENT | {"BadInput"}
# When several pods fail together the most specific cause is the diagnosis: the rank that ran
# out of memory, not the ranks whose collectives then failed.
SPECIFICITY = (
    contract.BAD_SPEC,
    contract.WILL_NOT_FIT,
    contract.BAD_DATA,
    contract.BAD_MODEL,
    "BadInput",
    contract.HUB_UNREACHABLE,
    contract.STORE_UNREACHABLE,
    contract.CHECKPOINT_UNREADABLE,
    contract.DISK_FULL,
    contract.VOLUME_UNUSABLE,
    contract.NODE_UNHEALTHY,
    "OOMKilled",
    contract.HOST_OOM,
    contract.CUDA_OOM,
    contract.OWNED_ELSEWHERE,
    contract.FABRIC_MISCONFIGURED,
    contract.EXPORT_FAILED,
    contract.PUSH_FAILED,
    contract.HUB_PUSH_FAILED,
    "Preempted",
    "Evicted",
    "Lost",
    contract.INTERNAL,
    contract.NCCL_ERROR,
    contract.COLLECTIVE_TIMEOUT,
    contract.NCCL_TIMEOUT,
    "Error",
)


def now_iso(now: datetime) -> str:
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def observed_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a pod that the operator's decisions read, in the pod's own shape.

    The operator holds every pod it manages in memory for as long as the pod exists (kopf's
    pod index), and a whole pod -- containers with their env, volumes, managedFields -- is
    many times the few fields the decisions read (the fleet suite measures the operator's
    memory per job: bench/RESULTS.md). This keeps exactly what this module, :mod:`lifecycle`
    and the handlers read: name, uid, the ftjob labels, the template annotation (what the pod
    was made of), owner uids, deletionTimestamp, node name, Kueue's admission gate, the
    PodGroup it is in, phase/reason/message, pod IP, the scheduler's Unschedulable condition
    and the trainer container's state (its termination message included). A new reader of
    another field must add it here; tests/unit/test_status.py checks that decisions made
    from these views equal those made from whole pods.
    """
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    view_meta: dict[str, Any] = {
        "name": meta.get("name"),
        "uid": meta.get("uid"),
        "labels": {k: labels[k] for k in (LABEL_JOB, LABEL_RANK, LABEL_ATTEMPT) if k in labels},
        "ownerReferences": [{"uid": r.get("uid")} for r in meta.get("ownerReferences") or []],
    }
    if meta.get("deletionTimestamp"):
        view_meta["deletionTimestamp"] = meta["deletionTimestamp"]
    if TEMPLATE in (meta.get("annotations") or {}):
        view_meta["annotations"] = {TEMPLATE: meta["annotations"][TEMPLATE]}
    view_status = {k: status[k] for k in ("phase", "reason", "message", "podIP") if k in status}
    stopped = [c for c in status.get("conditions") or [] if c.get("type") in STOPPED_BY_CLUSTER
               or _unschedulable(c)]  # fmt: skip
    if stopped:  # a copy, as below
        view_status["conditions"] = copy.deepcopy(stopped)
    trainer = trainer_state(pod)
    if trainer:
        # A copy: the view outlives the watch event it came from, whose dicts kopf owns.
        state = copy.deepcopy(trainer.get("state") or {})
        view_status["containerStatuses"] = [{"name": CONTAINER, "state": state}]
    view: dict[str, Any] = {"metadata": view_meta, "status": view_status}
    view_spec = {"nodeName": spec["nodeName"]} if spec.get("nodeName") else {}
    if queued(pod):  # only Kueue's gate: the one a decision reads
        view_spec["schedulingGates"] = [{"name": KUEUE_ADMISSION_GATE}]
    if grouped(pod):
        view_spec["schedulingGroup"] = dict(spec["schedulingGroup"])
    if view_spec:
        view["spec"] = view_spec
    return view


def rank_of(pod: dict) -> int:
    return int(pod["metadata"].get("labels", {}).get(LABEL_RANK, -1))


def attempt_of(pod: dict) -> int:
    return int(pod["metadata"].get("labels", {}).get(LABEL_ATTEMPT, -1))


def template_of(pod: dict) -> dict[str, str] | None:
    """What the pod was made of (render.template), or None for a pod that does not say (made
    by an operator before it said so, or its annotation edited away)."""
    text = (pod["metadata"].get("annotations") or {}).get(TEMPLATE)
    try:
        made = json.loads(text) if text else None
    except ValueError:
        return None
    return made if isinstance(made, dict) else None


def trainer_state(pod: dict) -> dict:
    """The trainer container's status ({} before it has one)."""
    for cs in pod.get("status", {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            return cs
    return {}


def terminated(pod: dict) -> dict | None:
    """The trainer container's terminated state, if it has ended."""
    return trainer_state(pod).get("state", {}).get("terminated")


# The kubelet's waiting reasons that do not end by themselves: a wrong or unreachable image, a
# missing Secret or ConfigMap, a container the runtime refuses to create or start.
CANNOT_START = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerError",
    "CreateContainerConfigError",
    "RunContainerError",
)


def _unschedulable(cond: dict) -> bool:
    return (cond.get("type"), cond.get("status"), cond.get("reason")) == (
        "PodScheduled", "False", "Unschedulable")  # fmt: skip


def not_starting(pod: dict) -> tuple[str, str] | None:
    """Why the pod cannot start, in the scheduler's or the kubelet's own words: (reason,
    message), e.g. ("Unschedulable", "...: 0/2 nodes are available: 2 Insufficient
    nvidia.com/gpu"), ("ImagePullBackOff", "...: Back-off pulling image ..."); None while
    nothing says it is stuck (being scheduled, pulling, or gated by Kueue: not stuck)."""
    name = pod["metadata"].get("name")
    for cond in pod.get("status", {}).get("conditions") or []:
        if _unschedulable(cond):
            return "Unschedulable", f"pod {name}: {cond.get('message') or 'no node fits it'}"
    waiting = trainer_state(pod).get("state", {}).get("waiting") or {}
    if waiting.get("reason") in CANNOT_START:
        said = waiting.get("message") or "(the kubelet gave no message)"
        return waiting["reason"], f"pod {name}: {waiting['reason']}: {said}"
    return None


def grouped(pod: dict) -> bool:
    """Whether the pod is in a PodGroup (Kubernetes 1.37's gang: placed all or none)."""
    return bool((pod.get("spec") or {}).get("schedulingGroup"))


def gang_echo(cause: tuple[str, str]) -> bool:
    """Whether a :func:`not_starting` cause only repeats the gang's verdict: of a PodGroup's
    unplaced pods the scheduler tells one why no node fits it, the others that the group's
    minCount cannot be satisfied."""
    return "minCount (" in cause[1]


def waiting_reason(pod: dict) -> str | None:
    """Why the trainer container has not started (ImagePullBackOff, ...), if it is waiting."""
    return trainer_state(pod).get("state", {}).get("waiting", {}).get("reason")


# Kueue's webhook gates every pod it manages until the pod's group is admitted whole.
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"
# The pod conditions the cluster sets on a pod it stops for reasons of its own, before deleting
# it: Kueue's on each pod of a group it stops (preemption, its eviction policy), Kubernetes' on
# a pod evicted through the API (`kubectl drain`, a node upgrade), preempted by the scheduler,
# removed by a NoExecute taint, or collected after its node was deleted (a spot reclaim).
STOPPED_BY_CLUSTER = ("TerminationTarget", "DisruptionTarget")


def stopped_by_cluster(pod: dict) -> str | None:
    """The cluster's word for why it stopped the pod, if it did (not the job's doing). A pod
    the kubelet evicted for the node's pressure (status.reason Evicted) is not: the job may
    have caused the pressure, and it is said as Evicted."""
    st = pod.get("status", {})
    if st.get("reason") == "Evicted":
        return None
    for c in st.get("conditions") or []:
        if c.get("type") in STOPPED_BY_CLUSTER and c.get("status") == "True":
            return f"{c.get('reason', '')}: {c.get('message', '')}".strip(": ")
    return None


def queued(pod: dict) -> bool:
    """Kueue holds the pod back from the scheduler (its admission gate): the gang waits in its
    LocalQueue for quota."""
    gates = pod.get("spec", {}).get("schedulingGates") or []
    return any(g.get("name") == KUEUE_ADMISSION_GATE for g in gates)


def succeeded(pod: dict) -> bool:
    term = terminated(pod)
    if term is not None:
        return term.get("exitCode") == 0
    return pod.get("status", {}).get("phase") == "Succeeded"


def running(pod: dict) -> bool:
    return pod.get("status", {}).get("phase") == "Running" and terminated(pod) is None


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MESSAGE_LIMIT else "..." + text[-MESSAGE_LIMIT:]


def record(pod: dict | None) -> dict[str, Any] | None:
    """The trainer's termination record (ftjob.api.contract) in the pod's message, if any."""
    term = terminated(pod) if pod else None
    return contract.parse((term or {}).get("message"))


def export_path(pod: dict | None) -> str | None:
    """The exported model rank 0 announced in its termination record, if any."""
    rec = record(pod) or {}
    path = rec.get("exportPath") if rec.get("outcome") == "succeeded" else None
    return path if isinstance(path, str) and path else None


def diagnose(pod: dict) -> dict[str, Any] | None:
    """``status.failure`` for a pod that failed, or None while it has not."""
    meta, st = pod["metadata"], pod.get("status", {})
    where = {"pod": meta["name"], "node": pod.get("spec", {}).get("nodeName"), "rank": rank_of(pod)}
    reason, detail, code, note, fix = None, "", None, "", None
    node_fault = False  # the node's fault, not the job's: the next gangs avoid it (badNodes)
    term = terminated(pod)
    if preempted := _preemption(pod, term):
        reason, detail = "Preempted", preempted
    elif st.get("reason") == "Evicted":
        reason, detail = "Evicted", st.get("message", "")
        node_fault = detail.startswith(NODE_PRESSURE)
    elif st.get("phase") == "Unknown" or st.get("reason") == "NodeLost":
        reason, detail = "Lost", st.get("message", "the node stopped reporting")
        node_fault = True
    elif meta.get("deletionTimestamp") and term is None and trainer_state(pod):
        # Deleted (by a person, a controller) while its trainer runs: a SIGTERM is a
        # checkpoint, and the record it ends with says what was saved. Not a failure yet.
        return None
    elif meta.get("deletionTimestamp") and not succeeded(pod):
        reason, detail = "Lost", "the pod was deleted while the gang was running"
    elif term is not None and term.get("exitCode") != 0:
        code = term.get("exitCode")
        rec = contract.parse(term.get("message")) or {}
        reason, detail, note, fix = _from_container(term, rec)
        if rec.get("reason") == reason and rec.get("node"):
            where["node"] = rec["node"]  # the trainer names the node at fault (preflight)
        node_fault = reason == contract.NODE_UNHEALTHY or (
            reason not in PERMANENT and bool(LOG_HARDWARE.search(term.get("message") or ""))
        )
    elif st.get("phase") == "Failed":
        reason, detail = "Error", st.get("message", "")
    if reason is None:
        return None
    message = _failure_message(where, fix or ADVICE[reason], code, note, detail)
    failure = {"reason": reason, "message": message, **where, "exitCode": code}
    if node_fault and where["node"]:
        failure["nodeFault"] = True
    return {k: v for k, v in failure.items() if v is not None}


def _failure_message(where: dict, fix: str, code: int | None, note: str, detail: str) -> str:
    """The pod and its rank, then the fix (the trainer's for this very cause, a field to set,
    else the reason's general advice), the exit code, a note and the detail's tail."""
    message = f"{where['pod']} (node rank {where['rank']}): {fix}"
    if code is not None:
        message += f" (exit code {code})"
    if note:
        message += f"; {note}"
    return message + (f"\n{_tail(detail)}" if detail else "")


def _from_container(term: dict, rec: dict) -> tuple[str, str, str, str | None]:
    """(reason, detail, note, fix) of a trainer container that exited non-zero: from its
    termination record ``rec`` ({} if none); only without one (killed, segfault) from the
    log tail, noted so."""
    text = term.get("message") or ""
    if term.get("reason") == "OOMKilled":  # the kernel's word, whatever was written before
        return "OOMKilled", _record_detail(rec) if rec else "", "", None
    if rec and rec.get("outcome") == "failed" and rec.get("reason") in ADVICE:
        return rec["reason"], _record_detail(rec), "", rec.get("fix")
    return contract.reason_in_log(text) or "Error", text, NO_RECORD, None


def _preemption(pod: dict, term: dict | None) -> str | None:
    """Why the cluster stopped the pod (its conditions) and what the trainer saved then (its
    record), or None when neither says so. A record alone is enough: the trainer stopped for
    a SIGTERM (its own pod's, or another's: the gang stops together), not for a failure."""
    stopped = stopped_by_cluster(pod)
    saved = _saved(contract.parse((term or {}).get("message")))
    if saved and not stopped and pod["metadata"].get("deletionTimestamp"):
        stopped = "the pod was deleted"
    if stopped and saved:
        return f"{stopped}; {saved}"
    return stopped or saved


def _saved(rec: dict | None) -> str | None:
    """What a trainer stopped by a SIGTERM says it saved (its record), or None."""
    if not rec or rec.get("outcome") != "preempted":
        return None
    return str(rec.get("message") or f"stopped for a SIGTERM after step {rec.get('step')}")


def _record_detail(rec: dict) -> str:
    """The record's message with where it happened: rank, step, file:line or field."""
    at = [f"rank {rec['rank']}" if "rank" in rec else "", f"step {rec['step']}" if "step" in rec
          else "", f"at {rec['where']}" if rec.get("where") else ""]  # fmt: skip
    context = ", ".join(a for a in at if a)
    return f"{rec.get('message', '')}" + (f" ({context})" if context else "")


# What a rank reports when another rank went first: its collective failed or timed out waiting
# for the peer. A pod that ends with one of these may be followed by a peer that says why.
CONSEQUENCES = frozenset({contract.NCCL_ERROR, contract.COLLECTIVE_TIMEOUT,
                          contract.NCCL_TIMEOUT, "Error"})  # fmt: skip


def killed(failure: dict) -> bool:
    """A process killed by a signal with no record of its own (exit 128 + N: SIGKILL's 137,
    an OOM kill outside the pod's cgroup)."""
    return failure["reason"] == "Error" and (failure.get("exitCode") or 0) > 128


def specificity(failure: dict) -> float:
    """Where a failure stands in SPECIFICITY (lower: more telling). A killed process explains
    what its peers then saw, so it stands just before the collectives' errors (seen on two real
    nodes: rank 0 SIGKILLed, rank 1's gloo "Connection closed by peer")."""
    if killed(failure):
        return SPECIFICITY.index(contract.NCCL_ERROR) - 0.5
    return SPECIFICITY.index(failure["reason"])


def root_cause(failures: list[dict], stopped: frozenset[str] = frozenset()) -> dict:
    """The most telling failure of several. Among equally specific ones, a pod the cluster
    stopped (``stopped``: their names) explains its peers, which stop with the gang (seen on
    a deleted rank 1: rank 0 saved at the same SIGTERM); then the lowest rank."""
    return min(failures, key=lambda f: (specificity(f), f.get("pod") not in stopped,
                                        f.get("rank", 0)))  # fmt: skip


def consequence(failure: dict, stopped: frozenset[str]) -> bool:
    """Whether ``failure`` may be what a peer's failure caused: a collective's error or a bare
    Error (not a killed process, a cause of its own), or a save at a SIGTERM on a pod nobody
    stopped (``stopped``: the names of those the cluster did), which its gang agreed to when
    a peer got the signal."""
    if failure["reason"] == "Preempted":
        return failure.get("pod") not in stopped
    return failure["reason"] in CONSEQUENCES and not killed(failure)


def stopped_from_outside(pod: dict) -> bool:
    """The cluster stopped or deleted this pod: not the job's doing, nor its gang's."""
    return bool(stopped_by_cluster(pod) or pod["metadata"].get("deletionTimestamp"))


# An Event is one line of `kubectl describe`, and kopf cuts a longer message in its middle at
# 1024 characters (where a failure's cause would be).
EVENT_LIMIT = 1000


def event_message(message: str, limit: int = EVENT_LIMIT) -> str:
    """``message`` as an Event says it: one line of at most ``limit`` characters, its first
    line (what happened, what to do) and then its cause (a record's words naming the file and
    line, a log tail), the lines joined by " | ". A cause too long loses its beginning: the
    end of a log tail names what failed."""
    lines = [" ".join(line.split()) for line in message.splitlines()]
    head, *rest = [line for line in lines if line] or [""]
    if len(head) > limit:
        return head[: limit - 3] + "..."
    cause = " | ".join(rest)
    room = limit - len(head) - len(" | ")
    if not cause or room < 8:
        return head
    return f"{head} | " + (cause if len(cause) <= room else "..." + cause[-(room - 3) :])


def format_eta(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s % 60:02d}s" if m else f"{s}s"


# Losses and the objectives' metrics are kept to this many decimals: the printer columns show
# a number as it is stored (2.4004, not 2.4003989696502686).
DECIMALS = 4


def _readable(value: Any) -> Any:
    return round(value, DECIMALS) if isinstance(value, float) else value


def _display(step: int, total: int | None) -> str:
    return f"{step}/{total}" if total else str(step)


def progress(snapshot: dict) -> dict[str, Any]:
    """``status.progress`` from rank 0's ``/progress`` JSON (docs/progress.md)."""
    step, total = snapshot.get("step") or 0, snapshot.get("totalSteps")
    mfu = snapshot.get("mfu")
    out = {
        "phase": snapshot.get("phase"),
        "step": step,
        "totalSteps": total,
        "display": _display(step, total),
        "loss": _readable(snapshot.get("loss")),
        "evalLoss": _readable(snapshot.get("evalLoss")),
        **{k: _readable(snapshot.get(k)) for k in objectives.status()},  # the job's objective's
        "learningRate": snapshot.get("learningRate"),
        "tokensPerSecond": snapshot.get("tokensPerSecond"),
        "mfu": round(mfu * 100, 2) if mfu is not None else None,  # the trainer reports 0-1
        "eta": format_eta(snapshot.get("etaSeconds")),
        "replacesExport": snapshot.get("replacesExport"),
        "pushedTo": snapshot.get("pushedTo"),
        "download": _download(snapshot.get("downloadedBytes"), snapshot.get("downloadBytes")),
        "promotion": snapshot.get("promotion"),
        "trackingWarnings": snapshot.get("trackingWarnings") or None,
        "updateTime": snapshot.get("updatedAt"),
    }
    return {k: v for k, v in out.items() if v is not None}


def _download(got: int | None, total: int | None) -> str | None:
    """PURE: '1.20 of 5.00 GiB (24%)' from the trainer's byte counts."""
    if got is None or not total:
        return None
    return f"{got / 2**30:.2f} of {total / 2**30:.2f} GiB ({100 * got / total:.0f}%)"


def final_progress(pods: list[dict]) -> dict[str, Any] | None:
    """What a gang's termination records say it ended with (None while none has one): rank
    0's final numbers (contract.final_progress), the furthest step any record names, and the
    checkpoint a SIGTERM saved (a preempted record's)."""
    records = [r for p in pods if (r := record(p))]
    out: dict[str, Any] = {}
    for rec in records:
        out |= rec.get("progress") if isinstance(rec.get("progress"), dict) else {}
    for rec in records:
        step = rec.get("step")
        if isinstance(step, int) and step > out.get("step", -1):
            out["step"] = step
        saved = out.get("lastCheckpointStep", -1)
        if rec.get("outcome") == "preempted" and rec.get("checkpoint") and rec["step"] >= saved:
            out |= {"lastCheckpointStep": rec["step"], "lastCheckpoint": rec["checkpoint"]}
    return out or None


def with_final(old: dict[str, Any] | None, final: dict[str, Any]) -> dict[str, Any]:
    """``status.progress`` once the records' final numbers (:func:`final_progress`) are known:
    theirs where they reach at least as far as what rank 0 last served."""
    out = dict(old or {})
    if final.get("step", 0) >= out.get("step", 0):
        out |= {k: _readable(final[k]) for k in ("step", "totalSteps", "loss", "evalLoss")
                if k in final}  # fmt: skip
    # Where the export went and whether it was promoted: only a record says it (see above).
    out |= {k: final[k] for k in ("pushedTo", "promotion") if final.get(k)}
    out.setdefault("step", 0)
    out["display"] = _display(out["step"], out.get("totalSteps"))
    return out


def ended(old: dict[str, Any], phase: str) -> dict[str, Any]:
    """``status.progress`` of a job that ended (Succeeded, Failed): the trainer's phase says
    so, and there is no time left to estimate."""
    out = {k: v for k, v in old.items() if k != "eta"}
    return out | {"phase": phase.lower()}


def restarts_in_place(snapshot: dict | None) -> int | None:
    """How often torchrun restarted this gang's workers in place, as rank 0 reports it."""
    n = (snapshot or {}).get("restartsInPlace")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


STRAGGLERS_KEPT = 16  # status.stragglers is a bounded list (the schema says so too)


def stragglers(snapshot: dict) -> list[dict[str, Any]]:
    """``status.stragglers``: the ranks rank 0 names as persistently slower than the median."""
    out = []
    for s in snapshot.get("stragglers") or []:
        if isinstance(s, dict) and isinstance(s.get("rank"), int):
            keys = ("rank", "node", "stepSeconds", "medianSeconds")
            out.append({k: s[k] for k in keys if s.get(k) is not None})
    return out[:STRAGGLERS_KEPT]


def preflight(snapshot: dict) -> dict[str, Any] | None:
    """``status.preflight``: the gang's figures from the preflight (not each node's)."""
    found = snapshot.get("preflight")
    if not isinstance(found, dict):
        return None
    keys = ("busBandwidthGBps", "transport", "matmulTflops", "volumeWriteMBps", "seconds", "note")
    out = {k: found[k] for k in keys if found.get(k) is not None}
    return out | {"nodes": len(found["nodes"])} if isinstance(found.get("nodes"), dict) else out


BAD_NODES_KEPT = 16  # status.badNodes: the oldest entry goes when a new one would pass this


def note_bad_node(bad: list[dict], failure: dict, now: datetime) -> tuple[list[dict], dict | None]:
    """``status.badNodes`` after ``failure``, and the entry it added to or made (None when the
    failure is not the node's). Entries are {node, reason, count, lastSeen}, one per node."""
    node = failure.get("node")
    if not failure.get("nodeFault") or not node:
        return bad, None
    out = [dict(b) for b in bad]
    entry = next((b for b in out if b.get("node") == node), None)
    if entry is None:
        entry = {"node": node, "count": 0}
        out.append(entry)
    entry.update(reason=failure["reason"], count=entry["count"] + 1, lastSeen=now_iso(now))
    out.sort(key=lambda b: b.get("lastSeen") or "")
    return out[-BAD_NODES_KEPT:], entry


def last_checkpoint(snapshot: dict) -> dict[str, Any] | None:
    step = snapshot.get("lastCheckpointStep")
    if step is None:
        return None
    out = {"step": step, "path": snapshot.get("lastCheckpoint") or ""}
    return out | ({"time": snapshot["updatedAt"]} if snapshot.get("updatedAt") else {})


def set_condition(
    conditions: list[dict],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[dict]:
    """A copy of ``conditions`` with one condition set (``status`` None: "Unknown"); its
    transition time moves only when its status changes (so level-triggered re-runs do not
    churn it)."""
    value = "Unknown" if status is None else "True" if status else "False"
    old = next((c for c in conditions if c["type"] == type_), None)
    since = old["lastTransitionTime"] if old and old["status"] == value else now_iso(now)
    new = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        new["observedGeneration"] = generation
    out = [c for c in conditions if c["type"] != type_] + [new]
    return sorted(out, key=lambda c: CONDITION_TYPES.index(c["type"]))


def condition(conditions: list[dict], type_: str) -> dict | None:
    return next((c for c in conditions if c["type"] == type_), None)


# The Created condition's reason while the API server refuses the job's children.
REFUSED = "PodsRefused"


def conditions(
    old: list[dict],
    phase: str,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
    created: bool,
) -> list[dict]:
    """Every phase condition for a phase: the phase's own True, the rest False, each with a
    reason, so ``kubectl wait --for=condition=X`` always has something to read."""
    truths = {
        "Created": created,
        "Running": phase == "Running",
        "Restarting": phase == "Restarting",
        "Suspended": phase == "Suspended",
        "Stopped": phase == "Stopped",
        "Succeeded": phase == "Succeeded",
        "Failed": phase == "Failed",
    }
    out = old
    for type_ in PHASE_CONDITIONS:
        is_true = truths[type_]
        prior = condition(old, "Created") if type_ == "Created" else None
        if prior and not created and prior.get("reason") == REFUSED:
            # The API server's refusal stays in view until the pods exist.
            why, text = REFUSED, prior.get("message", "")
        elif type_ == "Created":
            why = "PodsCreated" if created else "PodsNotCreated"
            text = "every pod of the gang exists" if created else "the gang has no pods now"
        elif is_true or type_ == "Running":
            why, text = reason, message
        else:
            why, text = f"Not{type_}", ""
        out = set_condition(out, type_, is_true, why, text, now, generation)
    return out


def merge_patch(old: dict, new: dict) -> dict:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``: removed keys become
    null, so a new failure does not inherit the old one's exitCode."""
    patch: dict[str, Any] = {}
    for key in set(old) | set(new):
        if key not in new:
            patch[key] = None
        elif isinstance(old.get(key), dict) and isinstance(new[key], dict):
            inner = merge_patch(old[key], new[key])
            if inner:
                patch[key] = inner
        elif old.get(key) != new[key]:
            patch[key] = new[key]
    return patch
