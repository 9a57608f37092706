"""PURE: what Kueue says about a job's gang -> the job's Queued and Admitted conditions.

A job with ``spec.scheduling.queue`` hands each gang (attempt) to Kueue as one plain-pod
group, ``<job>-a<attempt>``; once all its pods exist Kueue makes one Workload of that name
(``kueue.x-k8s.io/v1beta2``, the version Kueue 0.17 stores) and reports there why the gang
waits (its ``QuotaReserved`` condition: "insufficient unused quota for nvidia.com/gpu in flavor
a100-80gb, 16 more needed") and, once admitted, through which ClusterQueue and flavors
(``status.admission``). The operator reads that Workload while its gang is gated or not yet
known to be admitted (:func:`workload_to_read`) and turns it into two conditions:

* ``Queued``: True while Kueue holds the gang back; its message (one line) names the
  LocalQueue and what is short, and ``kubectl get ftj -o wide`` shows it;
* ``Admitted``: True once Kueue admitted the gang whole; its message names the ClusterQueue.

Kueue 0.17 keeps no queue position on the Workload: only its visibility API (an aggregated
API server, the VisibilityOnDemand feature) serves one, so no position is reported here.
"""

from __future__ import annotations

from datetime import datetime

from ftjob.operator import status as st

GROUP, VERSION, PLURAL = "kueue.x-k8s.io", "v1beta2", "workloads"
QUEUED, ADMITTED = "Queued", "Admitted"


def workload_name(job: str, attempt: int) -> str:
    """Kueue names a plain-pod group's Workload after the group (render's pod-group-name)."""
    return f"{job}-a{attempt}"


def workload_to_read(queue: str | None, job: str, status: dict, pods: list[dict]) -> str | None:
    """The Workload worth a GET this reconcile, or None: the job has a queue, its current
    gang has pods, and they are gated or the gang is not yet known to be admitted (after
    that, nothing Kueue says changes the conditions until a pod is stopped or gated again)."""
    attempt = status.get("attempt", 0)
    current = [p for p in pods if st.attempt_of(p) == attempt]
    if not queue or not current or status.get("phase") in ("Succeeded", "Failed"):
        return None
    admitted = st.condition(status.get("conditions") or [], ADMITTED) or {}
    if any(map(st.queued, current)) or admitted.get("status") != "True":
        return workload_name(job, attempt)
    return None


def _cond(workload: dict | None, kind: str) -> dict:
    conds = ((workload or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c.get("type") == kind), {})


def _flavors(workload: dict) -> str:
    """The flavors Kueue assigned, e.g. ``nvidia.com/gpu: a100-80gb, cpu: a100-80gb``."""
    admission = (workload.get("status") or {}).get("admission") or {}
    seen: dict[str, str] = {}
    for ps in admission.get("podSetAssignments") or []:
        seen.update(ps.get("flavors") or {})
    return ", ".join(f"{r}: {f}" for r, f in sorted(seen.items()))


def verdict(queue: str, name: str, workload: dict | None) -> tuple[dict, dict]:
    """(Queued, Admitted) as (status, reason, message) dicts, from the gang's Workload (None:
    not made yet, Kueue waits for every pod of the group)."""
    if workload is None:
        why = f"LocalQueue {queue}: waiting for Kueue to make Workload {name} for the gang"
        return {"status": True, "reason": "WorkloadPending", "message": why}, _not_admitted(why)
    admitted = _cond(workload, "Admitted")
    if admitted.get("status") == "True":
        cq = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue", "")
        flavors = _flavors(workload)
        text = f"Workload {name} admitted by ClusterQueue {cq}" + (
            f" (flavors {flavors})" if flavors else ""
        )
        queued = {"status": False, "reason": "Admitted", "message": text}
        return queued, {"status": True, "reason": "Admitted", "message": text}
    reserved = _cond(workload, "QuotaReserved")
    if reserved.get("status") == "True":
        why = f"LocalQueue {queue}: quota reserved for Workload {name}, awaiting admission checks"
        return {"status": True, "reason": "QuotaReserved", "message": why}, _not_admitted(why)
    said = " ".join((reserved.get("message") or "not yet considered by Kueue").split())
    why = f"LocalQueue {queue}: {said}"
    reason = reserved.get("reason") or "Pending"
    return {"status": True, "reason": reason, "message": why}, _not_admitted(why)


def _not_admitted(why: str) -> dict:
    return {"status": False, "reason": "NotAdmitted", "message": why}


def conditions(
    old: list[dict],
    queue: str | None,
    read: tuple[str, dict | None] | None,
    has_pods: bool,
    now: datetime,
    generation: int | None,
) -> list[dict]:
    """``old`` with Queued and Admitted set: False when the gang has no live pods (suspended,
    being replaced); else from the Workload ``read`` (name, object or None) when one was read;
    as they were otherwise. A job without a queue carries neither."""
    if not queue:
        return [c for c in old if c["type"] not in (QUEUED, ADMITTED)]
    if not has_pods:
        why = f"LocalQueue {queue}: the gang has no pods now"
        pair = {"status": False, "reason": "NoPods", "message": why}, _not_admitted(why)
    elif read is not None:
        pair = verdict(queue, *read)
    else:
        return old
    out = old
    for kind, c in zip((QUEUED, ADMITTED), pair, strict=True):
        out = st.set_condition(out, kind, c["status"], c["reason"], c["message"], now, generation)
    return out
