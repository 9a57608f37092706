"""PURE: an OOMKilled pod held to the plan. The kernel's OOMKilled names no figure; the plan has
one for each phase of a pod's CPU memory. So the failure names the plan's figure for the phase
the gang was in beside the pod's limit, and says whether the plan foresaw it:

* foreseen (the plan said WILL NOT FIT, and spec.plan.enforce is false, so the gang started
  anyway): retrying cannot help, the job fails at once;
* not foreseen (the plan said it fits): a planner miss, retried as before and said in the
  message and a Warning Event (the operator's log names it too), so the planner can be fixed;
* no plan known (the model's config.json not read, no resources.memory): as before.

The plan is the trainer's when rank 0's progress served it (key ``plan``: made from the model's
own config.json, ftjob.trainer.model.planned), else the operator's own for the models it knows
offline (:func:`ftjob.plan.describe.planned_condition`).
"""

from __future__ import annotations

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.plan.describe import planned_condition
from ftjob.plan.estimate import gib

FORESEEN, MISS = "foreseen", "miss"
JUDGED = ("Fits", "WillNotFit")  # the verdicts an OOM can be held to
# The progress phase a gang was last seen in -> the plan's phase of a pod's CPU memory.
PLAN_PHASE = {"starting": "loading", "downloading": "loading", "preparing-data": "preparing",
              "loading": "loading", "training": "training", "evaluating": "training",
              "checkpointing": "saving", "exporting": "exporting",
              "pushing": "exporting"}  # fmt: skip


def plan_of(spec: FineTuneJobSpec, snapshot: dict | None) -> dict | None:
    """The plan an OOM is judged by: {reason, verdict, cpuPhaseBytes}, or None."""
    served = (snapshot or {}).get("plan")
    if isinstance(served, dict) and served.get("reason") in JUDGED:
        return served
    own = planned_condition(spec)
    if own["reason"] in JUDGED:
        phases = own["cpuPhases"]
        return {"reason": own["reason"], "verdict": own["message"], "cpuPhaseBytes": phases}
    return None


def judged(failure: dict, spec: FineTuneJobSpec, snapshot: dict | None) -> tuple[dict, str | None]:
    """An OOMKilled ``failure`` with the plan's figure and verdict added to its message, and
    :data:`FORESEEN`, :data:`MISS` or None (no plan to hold it to)."""
    plan = plan_of(spec, snapshot)
    if plan is None:
        return failure, None
    foreseen = plan["reason"] == "WillNotFit"
    head = "foreseen by the plan" if foreseen else "planner miss: the plan said it fits"
    line = f"{head}{_figure(plan, spec, snapshot)}: {plan['verdict']}"
    return {**failure, "message": f"{failure['message']}\n{line}"}, FORESEEN if foreseen else MISS


def _figure(plan: dict, spec: FineTuneJobSpec, snapshot: dict | None) -> str:
    """The plan's figure for the phase the gang was last seen in, beside the pod's limit
    (" (2.5 GiB while preparing, last seen, against the limit 300Mi)"), where both are known."""
    phase = PLAN_PHASE.get(str((snapshot or {}).get("phase")))
    figure = (plan.get("cpuPhaseBytes") or {}).get(phase)
    if figure is None or not spec.resources.memory:
        return ""
    return f" ({gib(figure)} while {phase}, last seen, against the limit {spec.resources.memory})"
