"""The profiles' limits at the door: a ValidatingAdmissionPolicy with FineTuneProfile params.

The API server evaluates it at ``kubectl apply`` (create) against every profile (its binding's
paramRef selects them all) and each profile's expressions first ask whether it is the job's:
named by ``spec.profile``, else by the namespace's label, else by its namespaceSelector (the
order of api/profile.py's :func:`~ftjob.api.profile.choose`). The limits are those of
:func:`~ftjob.api.profile.limit_violations`, with the same words; the operator checks them
again on the merged job (it also knows its own default image, and selector ambiguity).

On create every limit; on update only the budget, and only when the edit changes it: a profile
tightened later must not refuse the edits (a suspend, a new image) of jobs it let in, but a
budget raised to resume a stopped job is held to the cap as a new job's is.
charts/ftjob/templates/profile-policy.yaml is :func:`render_yaml`'s output.
"""

from __future__ import annotations

from typing import Any

import yaml

from ftjob.api import profile, spec

NAME = f"{profile.PLURAL}.{spec.GROUP}"
LABEL = profile.NAMESPACE_LABEL

# Whether the param (a profile) is the job's, as profile.choose decides (an ambiguous
# selector is the operator's to refuse).
_NAMED = "has(object.spec.profile)"
_LABELLED = f"has(namespaceObject.metadata.labels) && '{LABEL}' in namespaceObject.metadata.labels"
_SELECTED = (
    "has(params.spec.namespaceSelector) && has(params.spec.namespaceSelector.matchLabels) && "
    "size(params.spec.namespaceSelector.matchLabels) > 0 && "
    "params.spec.namespaceSelector.matchLabels.all(k, has(namespaceObject.metadata.labels) && "
    "k in namespaceObject.metadata.labels && "
    "namespaceObject.metadata.labels[k] == params.spec.namespaceSelector.matchLabels[k])"
)
APPLIES = (
    f"{_NAMED} ? object.spec.profile == params.metadata.name : "
    f"({_LABELLED} ? namespaceObject.metadata.labels['{LABEL}'] == params.metadata.name : "
    f"({_SELECTED}))"
)
_LIMITS = "has(params.spec.limits)"
_NODES = "(has(object.spec.resources) && has(object.spec.resources.nodes) ? object.spec.resources.nodes : 1)"  # noqa: E501
_PER_NODE = (
    "(has(object.spec.resources) && has(object.spec.resources.gpusPerNode) ? "
    "object.spec.resources.gpusPerNode : 1)"
)
_IMAGE = (
    "has(object.spec.image) ? object.spec.image : (has(params.spec.defaults) && "
    "has(params.spec.defaults.image) ? params.spec.defaults.image : '')"
)
_METHOD = (
    "has(object.spec.method) && has(object.spec.method.type) ? object.spec.method.type : 'lora'"
)
_OF = "' of FineTuneProfile ' + params.metadata.name"
_CREATE = "request.operation == 'CREATE'"
# An update that leaves the budget as it was is not held to the cap (lowered since, perhaps).
_BUDGET_EDITED = (
    f"{_CREATE} || !has(oldObject.spec.budget) || !has(object.spec.budget) || "
    "oldObject.spec.budget != object.spec.budget"
)


def _check(limit: str, ok: str, message: str, when: str = _CREATE) -> dict[str, Any]:
    """One limit: passes when the profile is not the job's, has no such limit, or holds;
    checked only ``when`` (on create, unless said)."""
    has = f"{_LIMITS} && has(params.spec.limits.{limit})"
    return {
        "expression": f"!({when}) || !variables.applies || !({has}) || ({ok})",
        "messageExpression": message,
        "reason": "Forbidden",
    }


def validations() -> list[dict[str, Any]]:
    lim = "params.spec.limits"
    return [
        _check(
            "maxNodes",
            f"variables.nodes <= {lim}.maxNodes",
            f"'spec.resources.nodes: ' + string(variables.nodes) + ' nodes exceed "
            f"limits.maxNodes ' + string({lim}.maxNodes) + {_OF} + '; fix: set "
            f"resources.nodes to at most ' + string({lim}.maxNodes) + ', or ask the platform "
            "team for a profile that allows more'",
        ),
        _check(
            "maxGpusPerJob",
            f"variables.nodes * variables.perNode <= {lim}.maxGpusPerJob",
            f"'spec.resources.gpusPerNode: ' + string(variables.nodes * variables.perNode) + "
            f"' GPUs (' + string(variables.nodes) + ' nodes x ' + string(variables.perNode) + "
            f"') exceed limits.maxGpusPerJob ' + string({lim}.maxGpusPerJob) + {_OF} + "
            f"'; fix: ask for at most ' + string({lim}.maxGpusPerJob) + ' GPUs (nodes x "
            "gpusPerNode)'",
        ),
        _check(
            "allowedImagePrefixes",
            f"size({lim}.allowedImagePrefixes) == 0 || variables.image == '' || "
            f"{lim}.allowedImagePrefixes.exists(p, variables.image.startsWith(p))",
            f"'spec.image: ' + variables.image + ' is not under limits.allowedImagePrefixes'"
            f" + {_OF} + '; fix: use an image starting with ' + "
            f"{lim}.allowedImagePrefixes.join(' or ')",
        ),
        _check(
            "maxGpuHoursPerJob",
            "!has(object.spec.budget) || !has(object.spec.budget.gpuHours) || "
            f"object.spec.budget.gpuHours <= {lim}.maxGpuHoursPerJob",
            "'spec.budget.gpuHours: ' + string(object.spec.budget.gpuHours) + ' GPU-hours "
            f"exceed limits.maxGpuHoursPerJob ' + string({lim}.maxGpuHoursPerJob) + {_OF} + "
            f"'; fix: set budget.gpuHours to at most ' + string({lim}.maxGpuHoursPerJob)",
            _BUDGET_EDITED,
        ),
        _check(
            "allowedMethods",
            f"size({lim}.allowedMethods) == 0 || variables.method in {lim}.allowedMethods",
            f"'spec.method.type: ' + variables.method + ' is not in limits.allowedMethods'"
            f" + {_OF} + '; fix: use method.type ' + {lim}.allowedMethods.join(' or ')",
        ),
    ]


def policy() -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": NAME},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": profile.API_VERSION, "kind": profile.KIND},
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [spec.GROUP],
                        "apiVersions": [spec.VERSION],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": [spec.PLURAL],
                    }
                ]
            },
            "variables": [
                {"name": "applies", "expression": APPLIES},
                {"name": "nodes", "expression": _NODES},
                {"name": "perNode", "expression": _PER_NODE},
                {"name": "image", "expression": _IMAGE},
                {"name": "method", "expression": _METHOD},
            ],
            "validations": validations(),
        },
    }


def binding() -> dict[str, Any]:
    """Every profile is a param; a job that none applies to is let in (Allow)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": NAME},
        "spec": {
            "policyName": NAME,
            "validationActions": ["Deny"],
            "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
        },
    }


def render_yaml() -> str:
    header = "# Generated by scripts/manifests.py from ftjob/api/policy.py -- do not edit.\n"
    docs = [yaml.safe_dump(d, sort_keys=False, width=100) for d in (policy(), binding())]
    return header + "---\n".join(docs)
