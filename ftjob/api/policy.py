"""The profiles' limits at the door: a ValidatingAdmissionPolicy with FineTuneProfile params.

The API server evaluates it at ``kubectl apply`` (create) against every profile (its binding's
paramRef selects them all) and each profile's expressions first ask whether it is the job's:
named by ``spec.profile``, else by the namespace's label, else by its namespaceSelector (the
order of api/profile.py's :func:`~ftjob.api.profile.choose`). The limits are those of
:func:`~ftjob.api.profile.limit_violations`, with the same words; the operator checks them
again on the merged job (it also knows its own default image, and selector ambiguity).

A job may name (``spec.profile``) only a profile that serves its namespace (selects it, is
named by its label, or is ``nameableFrom: Anywhere``): else a team could take any profile's
limits by naming it.

Each check runs on create, and on an update that changes a field it reads (the one rule,
:func:`_edited`): every check reads ``spec.profile`` (which profile applies), and each its
own fields besides (an image check the image, a budget check the budget). An edit that would
break a limit is so refused with the words of a create; a limit tightened later refuses no
edit that leaves its fields alone (a suspend, of a job it let in). The operator checks again
before each gang (operator/profiles.py).
charts/ftjob/templates/profile-policy.yaml is :func:`render_yaml`'s output.
"""

from __future__ import annotations

from typing import Any

import yaml

from ftjob.api import jobspec, profile

NAME = f"{profile.PLURAL}.{jobspec.GROUP}"
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
_GPU_TYPE = (
    "has(object.spec.resources) && has(object.spec.resources.gpuType) ? "
    "object.spec.resources.gpuType : (has(params.spec.defaults) && "
    "has(params.spec.defaults.resources) && has(params.spec.defaults.resources.gpuType) ? "
    "params.spec.defaults.resources.gpuType : '')"
)
_CREATE = "request.operation == 'CREATE'"
_SERVES = (
    "has(params.spec.nameableFrom) && params.spec.nameableFrom == 'Anywhere' || "
    f"{_LABELLED} && namespaceObject.metadata.labels['{LABEL}'] == params.metadata.name || "
    f"{_SELECTED}"
)
# profile.under_prefix in CEL: a prefix ending in / or : as written, any other on a boundary.
_UNDER = (
    "variables.image == p || ((p.endsWith('/') || p.endsWith(':')) ? "
    "variables.image.startsWith(p) : ['/', ':', '@'].exists(s, variables.image.startsWith(p + s)))"
)


def _changed(field: str) -> str:
    """Whether an update sets, unsets or changes ``spec.<field>``."""
    old, new = f"oldObject.spec.{field}", f"object.spec.{field}"
    return f"has({old}) != has({new}) || has({new}) && {old} != {new}"


def _edited(*fields: str) -> str:
    """When a check reading ``fields`` runs: on create, or an update changing one of them or
    ``spec.profile`` (which profile applies is read by every check)."""
    return " || ".join([_CREATE, *(f"({_changed(f)})" for f in ("profile", *fields))])


def _check(ok: str, message: str, fields: tuple[str, ...], limit: str | None = None) -> dict:
    """One check: passes when the profile is not the job's, has no such ``limit``, or holds;
    run only when :func:`_edited` says ``fields`` changed."""
    has = f"{_LIMITS} && has(params.spec.limits.{limit})" if limit else "true"
    return {
        "expression": f"!({_edited(*fields)}) || !variables.applies || !({has}) || ({ok})",
        "messageExpression": message,
        "reason": "Forbidden",
    }


def validations() -> list[dict[str, Any]]:
    lim = "params.spec.limits"
    return [
        _check(
            f"!has(object.spec.profile) || {_SERVES}",
            "'spec.profile: FineTuneProfile ' + params.metadata.name + ' does not serve "
            "namespace ' + namespaceObject.metadata.name + ' (neither its namespaceSelector "
            f"nor the namespace\\'s label {LABEL} selects it); fix: name the namespace\\'s own "
            "profile or none, or ask the platform team to label namespace ' + "
            f"namespaceObject.metadata.name + ' {LABEL}=' + params.metadata.name + ' or to set "
            "nameableFrom: Anywhere on FineTuneProfile ' + params.metadata.name",
            (),
        ),
        _check(
            f"variables.nodes <= {lim}.maxNodes",
            f"'spec.resources.nodes: ' + string(variables.nodes) + ' nodes exceed "
            f"limits.maxNodes ' + string({lim}.maxNodes) + {_OF} + '; fix: set "
            f"resources.nodes to at most ' + string({lim}.maxNodes) + ', or ask the platform "
            "team for a profile that allows more'",
            ("resources",),
            "maxNodes",
        ),
        _check(
            f"variables.nodes * variables.perNode <= {lim}.maxGpusPerJob",
            f"'spec.resources.gpusPerNode: ' + string(variables.nodes * variables.perNode) + "
            f"' GPUs (' + string(variables.nodes) + ' nodes x ' + string(variables.perNode) + "
            f"') exceed limits.maxGpusPerJob ' + string({lim}.maxGpusPerJob) + {_OF} + "
            f"'; fix: ask for at most ' + string({lim}.maxGpusPerJob) + ' GPUs (nodes x "
            "gpusPerNode)'",
            ("resources",),
            "maxGpusPerJob",
        ),
        _check(
            f"size({lim}.allowedImagePrefixes) == 0 || variables.image == '' || "
            f"{lim}.allowedImagePrefixes.exists(p, {_UNDER})",
            f"'spec.image: ' + variables.image + ' is not under limits.allowedImagePrefixes'"
            f" + {_OF} + '; fix: use an image starting with ' + "
            f"{lim}.allowedImagePrefixes.join(' or ')",
            ("image",),
            "allowedImagePrefixes",
        ),
        *_budget_checks(lim),
        _check(
            f"size({lim}.allowedMethods) == 0 || variables.method in {lim}.allowedMethods",
            f"'spec.method.type: ' + variables.method + ' is not in limits.allowedMethods'"
            f" + {_OF} + '; fix: use method.type ' + {lim}.allowedMethods.join(' or ')",
            ("method",),
            "allowedMethods",
        ),
        _check(  # an identity: an empty (or no) list allows none
            "!has(object.spec.serviceAccountName) || "
            f"{_LIMITS} && has({lim}.allowedServiceAccounts) && "
            f"object.spec.serviceAccountName in {lim}.allowedServiceAccounts",
            "'spec.serviceAccountName: ' + object.spec.serviceAccountName + ' is not in "
            f"limits.allowedServiceAccounts' + {_OF} + '; fix: ' + ({_LIMITS} && "
            f"has({lim}.allowedServiceAccounts) && size({lim}.allowedServiceAccounts) > 0 ? "
            f"'use serviceAccountName ' + {lim}.allowedServiceAccounts.join(' or ') + ', or ' "
            ": '') + 'ask the platform team to add it to limits.allowedServiceAccounts'",
            ("serviceAccountName",),
        ),
    ]


def _budget_checks(lim: str) -> list[dict[str, Any]]:
    """The cap on GPU-hours, and a price for a budget in money (unpriced, it never stops)."""
    priced = (
        "has(params.spec.prices) && params.spec.prices.exists(p, p.gpuType == variables.gpuType)"
    )
    return [
        _check(
            "!has(object.spec.budget) || !has(object.spec.budget.gpuHours) || "
            f"object.spec.budget.gpuHours <= {lim}.maxGpuHoursPerJob",
            "'spec.budget.gpuHours: ' + string(object.spec.budget.gpuHours) + ' GPU-hours "
            f"exceed limits.maxGpuHoursPerJob ' + string({lim}.maxGpuHoursPerJob) + {_OF} + "
            f"'; fix: set budget.gpuHours to at most ' + string({lim}.maxGpuHoursPerJob)",
            ("budget",),
            "maxGpuHoursPerJob",
        ),
        _check(
            f"!has(object.spec.budget) || !has(object.spec.budget.amount) || {priced}",
            "'spec.budget.amount: a budget in money needs a price, and FineTuneProfile ' + "
            "params.metadata.name + ' has no price for gpuType ' + (variables.gpuType == '' ? "
            "'(none set)' : variables.gpuType) + '; fix: set budget.gpuHours instead, or ask "
            "the platform team to add that gpuType to prices of FineTuneProfile ' + "
            "params.metadata.name",
            ("budget", "resources"),
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
                        "apiGroups": [jobspec.GROUP],
                        "apiVersions": [jobspec.VERSION],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": [jobspec.PLURAL],
                    }
                ]
            },
            "variables": [
                {"name": "applies", "expression": APPLIES},
                {"name": "nodes", "expression": _NODES},
                {"name": "perNode", "expression": _PER_NODE},
                {"name": "image", "expression": _IMAGE},
                {"name": "method", "expression": _METHOD},
                {"name": "gpuType", "expression": _GPU_TYPE},
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
