"""What the operator needs before it reconciles anything, checked once at start-up.

kopf retries a failing start-up handler every 60 s and reconciles nothing meanwhile, saying
why only in its own log; an operator that cannot work should instead end, with one line
naming the cause and the fix, so that its pod restarts and ``kubectl describe`` (the last
termination message) and the log's last line say why. :class:`StartupError` is that line: the
start-up handler raises it, kopf stops at once (a permanent error), and ``ftjob operator``
exits non-zero with it (``__main__``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import kopf

from ftjob.api.jobspec import GROUP, PLURAL
from ftjob.api.profile import PLURAL as PROFILES

# (apiGroup, resource, verb): what kopf's watches and kube.py's calls need, the chart's
# ClusterRole in other words (tests/unit/test_chart.py keeps the three equal).
NEEDED: tuple[tuple[str, str, str], ...] = (
    (GROUP, PLURAL, "list"),
    (GROUP, PLURAL, "watch"),
    (GROUP, PLURAL, "get"),
    (GROUP, PLURAL, "patch"),
    (GROUP, PLURAL, "delete"),
    (GROUP, f"{PLURAL}/status", "patch"),
    (GROUP, f"{PLURAL}/finalizers", "update"),
    ("", "pods", "list"),
    ("", "pods", "watch"),
    ("", "pods", "get"),
    ("", "pods", "create"),
    ("", "pods", "delete"),
    ("", "services", "get"),
    ("", "services", "create"),
    ("", "services", "delete"),
    ("", "configmaps", "get"),
    ("", "configmaps", "create"),
    ("", "configmaps", "delete"),
    ("", "events", "create"),
    ("kueue.x-k8s.io", "workloads", "get"),  # kube.workload: a queued gang's admission
    ("scheduling.k8s.io", "podgroups", "get"),  # a gang's PodGroup, where the API is served
    ("scheduling.k8s.io", "podgroups", "create"),
    ("scheduling.k8s.io", "podgroups", "delete"),
    (GROUP, PROFILES, "list"),  # the profiles' index (handlers.job_profiles)
    (GROUP, PROFILES, "watch"),
    ("", "namespaces", "list"),  # their labels' index (handlers.namespace_labels)
    ("", "namespaces", "watch"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
)
CLUSTER_SCOPED = {"customresourcedefinitions", PROFILES, "namespaces"}


class StartupError(kopf.PermanentError):
    """The operator cannot start; the message is the one line that says why and what to do."""


def missing(may: Callable[[str, str, str, str], bool], namespaces: Iterable[str]) -> list[str]:
    """What of :data:`NEEDED` the authorizer refuses, as ``verb resource (in NS)`` phrases.
    ``may(group, resource, verb, namespace)`` asks it; namespace "" is every namespace."""
    scopes = list(namespaces) or [""]
    refused = []
    for group, resource, verb in NEEDED:
        full = f"{resource}.{group}" if group else resource
        for ns in [""] if resource in CLUSTER_SCOPED else scopes:
            if not may(group, resource, verb, ns):
                refused.append(f"{verb} {full} ({f'in {ns}' if ns else 'cluster-wide'})")
    return refused


def permissions_error(refused: list[str], user: str) -> StartupError:
    shown = ", ".join(refused[:4]) + (f" and {len(refused) - 4} more" if len(refused) > 4 else "")
    return StartupError(
        f"{user} may not {shown}: grant the chart's ClusterRole (charts/ftjob, rbac.create) "
        "to the operator's ServiceAccount, or a Role with the same rules in each watched "
        "namespace"
    )


def port_error(port: int, error: OSError) -> StartupError:
    return StartupError(
        f"the metrics port {port} cannot be served ({error.strerror or error}): free it, or "
        "choose another with --metrics-port / FTJOB_METRICS_PORT (the chart's metrics.port; "
        "0 serves no metrics)"
    )


def unreachable_error(cause: Exception) -> StartupError:
    return StartupError(
        f"{cause}: check the kubeconfig's server (or, in a pod, the cluster's DNS and the "
        "network policy between the operator and the API server)"
    )
