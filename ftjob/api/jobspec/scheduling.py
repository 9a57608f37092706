"""scheduling: where and when the pods may run (Kueue's queue, priority, node selection,
tolerations, affinity, topology).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ftjob.api import kubevalidation as kv
from ftjob.api.jobspec.fields import (
    DNS_LABEL,
    DNS_LABEL_HINT,
    DNS_SUBDOMAIN_HINT,
    LABEL_KEY_HINT,
    LABEL_VALUE_HINT,
    label_map,
)
from ftjob.api.schema import FreeForm, Rule, api_field


@dataclass(kw_only=True)
class Toleration:
    """A Kubernetes toleration."""

    key: str | None = api_field(
        "key of the taint; unset matches every key (operator Exists).",
        None,
        pattern=kv.QUALIFIED_NAME,
        pattern_hint=LABEL_KEY_HINT,
        max_length=kv.QUALIFIED_NAME_MAX,
    )
    operator: Literal["Exists", "Equal"] = api_field("operator: Exists or Equal.", "Equal")
    value: str | None = api_field(
        "value of the taint (operator Equal).",
        None,
        pattern=kv.LABEL_VALUE,
        pattern_hint=LABEL_VALUE_HINT,
        max_length=63,
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = api_field(
        "effect to tolerate; all effects when empty.", None
    )
    toleration_seconds: int | None = api_field(
        "tolerationSeconds for NoExecute taints.", None, minimum=0
    )

    # core/validation ValidateTolerations, so that the pods cannot be refused for them.
    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.key) || self.operator == 'Exists'",
            "a toleration without a key must have operator Exists (it then tolerates every "
            "taint); add a key or set operator: Exists",
            ".operator",
        ),
        Rule(
            "self.operator != 'Exists' || !has(self.value)",
            "operator Exists takes no value; remove value or use operator Equal",
            ".value",
        ),
        Rule(
            "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "tolerationSeconds needs effect NoExecute; remove it or set effect: NoExecute",
            ".tolerationSeconds",
        ),
    )


@dataclass(kw_only=True)
class SchedulingSpec:
    """scheduling: where and when the pods may run."""

    queue: str | None = api_field(
        "queue: a Kueue LocalQueue; the gang is admitted as one pod group.",
        None,
        pattern=DNS_LABEL,
        pattern_hint=DNS_LABEL_HINT,
        max_length=63,
    )
    priority_class_name: str | None = api_field(
        "priorityClassName of the pods.",
        None,
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )
    scheduler_name: str | None = api_field(
        "schedulerName of the pods.",
        None,
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )
    node_selector: dict[str, str] = label_map(
        "nodeSelector of the pods: node label keys and the values they must have.", 64
    )
    tolerations: list[Toleration] = api_field(
        "tolerations of the pods.", factory=list, max_items=64
    )
    affinity: FreeForm | None = api_field("affinity of the pods (a Kubernetes Affinity).", None)
    topology: str | None = api_field(
        "topology: a node label of a level of a Kueue Topology (e.g. "
        "cloud.provider.com/topology-rack): Kueue's Topology-Aware Scheduling admits the gang "
        "only into one domain of that level (one rack) and places it there; needs queue, and "
        "a ResourceFlavor of the queue's ClusterQueue with a topologyName.",
        None,
        pattern=kv.QUALIFIED_NAME,
        pattern_hint=LABEL_KEY_HINT,
        max_length=kv.QUALIFIED_NAME_MAX,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.topology) || has(self.queue)",
            "topology is Kueue's Topology-Aware Scheduling: set queue (a LocalQueue) too, or "
            "remove topology",
            ".topology",
        ),
    )
