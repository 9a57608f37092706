"""PURE: the requests of each pod of a job's gang, and the quota the gang takes in Kueue.

Every pod of a gang asks for the same: ``resources.cpu`` and ``resources.memory`` when set,
``gpusPerNode`` of ``resources.gpu``, and with ``network.fabric: efa`` ``efaDevicesPerNode`` of
``vpc.amazonaws.com/efa``; requests equal limits (the operator's render uses :func:`requests`).
Kueue admits the gang as one Workload and counts, per resource, the sum of the requests of all
its pods (one container each, no init containers, no pod overhead): ``nodes`` x each pod's.
A ClusterQueue admits the gang only when its ``coveredResources`` name every one of these
resources and its quota (``nominalQuota``, plus what it may borrow) holds the whole gang.
"""

from __future__ import annotations

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import quantity

EFA_RESOURCE = "vpc.amazonaws.com/efa"
_GI = 2**30


def requests(spec: FineTuneJobSpec) -> dict[str, str]:
    """Each pod's requests (and limits), as quantities, in the order the pod lists them."""
    r = spec.resources
    amounts: dict[str, str] = {}
    if r.cpu is not None:
        amounts["cpu"] = str(r.cpu)
    if r.memory is not None:
        amounts["memory"] = str(r.memory)
    if r.on_gpu:
        amounts[r.gpu] = str(r.gpus_per_node)
    if spec.network.fabric == "efa":
        amounts[EFA_RESOURCE] = str(spec.network.efa_devices_per_node)
    return amounts


def _total(amount: str, nodes: int, resource: str) -> str:
    """``nodes`` x ``amount`` as a quantity: whole numbers plain, memory in Gi where whole."""
    value = quantity(amount) * nodes
    if resource == "memory" and value % _GI == 0:
        return f"{int(value // _GI)}Gi"
    if resource == "cpu" and value != int(value):
        return f"{round(value * 1000)}m"
    return str(int(value)) if value == int(value) else f"{value:g}"


def gang(spec: FineTuneJobSpec) -> dict[str, str]:
    """The quota the whole gang takes (what Kueue counts for its Workload), per resource."""
    nodes = spec.resources.nodes
    return {name: _total(amount, nodes, name) for name, amount in requests(spec).items()}


def text(spec: FineTuneJobSpec) -> str:
    """One line for ``ftjob plan``: the gang's quota, each pod's share, what is not counted."""
    per_pod, total = requests(spec), gang(spec)
    if not total:
        return "the pods request nothing: a Kueue ClusterQueue counts no quota for the gang"
    listed = ", ".join(f"{v} {k}" for k, v in total.items())
    each = ", ".join(f"{v} {k}" for k, v in per_pod.items())
    unset = [k for k in ("cpu", "memory") if k not in per_pod]
    note = (
        f"; no {' or '.join(unset)} request (resources.{unset[0]} unset): not counted"
        if unset
        else ""
    )
    return (
        f"{listed} for the gang, admitted whole by Kueue ({spec.resources.nodes} pod(s) x "
        f"{each}){note}; the ClusterQueue must cover each resource"
    )
