"""The FineTuneProfile: what a platform team sets once for many jobs, and the one merge.

A profile holds **defaults** (fields a platform owns: image, scheduling, the checkpoint volume,
tracking, env, secrets, the GPU type) and **limits** (most nodes, most GPUs, allowed image
prefixes and methods). :func:`apply` is the only place a profile meets a job; ``ftjob
validate``, ``plan`` and ``run`` (``--profile FILE``) call it as the operator would::

    ftjob validate --profile examples/profile.yaml examples/tiny.yaml

PURE: documents in, a merged document and its limit violations out. What the job sets wins over
a default; a limit is never overridden (a violation names the limit, the profile and the fix).

Which profile: ``spec.profile`` names one; else the namespace's label ``ftjob.dev/profile``;
else the one profile whose ``namespaceSelector`` matches the namespace's labels. The label wins
over a selector because a namespace owner chose it for that namespace, where a selector is a
cluster-wide rule that may match more namespaces than meant (:func:`choose`). A job may name
only a profile that serves its namespace (selects it, is named by its label, or is
``nameableFrom: Anywhere``): else naming a looser profile would widen a team's limits
(:func:`serves`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from ftjob.api import admission
from ftjob.api import kubevalidation as kv
from ftjob.api.jobspec import GROUP, VERSION, FineTuneJobSpec
from ftjob.api.jobspec.checkpoint import VolumeRef
from ftjob.api.jobspec.env import EnvVar, PullSecret, SecretsSpec
from ftjob.api.jobspec.fields import DNS_SUBDOMAIN_HINT, label_map
from ftjob.api.jobspec.method import METHODS
from ftjob.api.jobspec.resources import GPU_TYPES
from ftjob.api.jobspec.scheduling import SchedulingSpec
from ftjob.api.jobspec.tracking import TrackingSpec
from ftjob.api.schema import FieldError, SpecError, api_field, openapi, parse, to_dict

KIND, PLURAL, SINGULAR = "FineTuneProfile", "finetuneprofiles", "finetuneprofile"
API_VERSION = f"{GROUP}/{VERSION}"
# The namespace label naming the profile of the namespace's jobs that name none.
NAMESPACE_LABEL = f"{GROUP}/profile"
# Who may name a profile (spec.nameableFrom): the namespaces it serves, or any.
NAMEABLE = ("Selected", "Anywhere")


@dataclass(kw_only=True)
class ProfileResources:
    """resources: the job's resources a platform knows best."""

    gpu_type: Literal[GPU_TYPES] | None = api_field(  # type: ignore[valid-type]
        "gpuType of the cluster's GPUs (spec.resources.gpuType of a GPU job that names none).",
        None,
    )


@dataclass(kw_only=True)
class ProfileCheckpoint:
    """checkpoint: where the jobs' checkpoints live."""

    volume: VolumeRef | None = api_field(
        "volume: the ReadWriteMany claim of jobs that name none (spec.checkpoint.volume).", None
    )


@dataclass(kw_only=True)
class ProfileDefaults:
    """defaults: job fields a job that leaves them unset takes from the profile. Objects
    merge field by field, maps key by key; lists add up (an env variable the job sets
    replaces the profile's of that name); affinity is taken whole."""

    image: str | None = api_field(
        "image of the trainer (spec.image).",
        None,
        pattern=kv.IMAGE,
        pattern_hint="be an image reference without spaces, e.g. ghcr.io/org/trainer:1.0",
        max_length=512,
    )
    scheduling: SchedulingSpec | None = api_field(
        "scheduling: node selector, tolerations, affinity, priority class, queue, topology.",
        None,
    )
    checkpoint: ProfileCheckpoint | None = api_field("checkpoint: the volume.", None)
    tracking: TrackingSpec | None = api_field("tracking: experiment trackers.", None)
    env: list[EnvVar] = api_field(
        "env: variables of every job's training processes.", factory=list, max_items=64
    )
    secrets: SecretsSpec | None = api_field("secrets: e.g. the Hugging Face token.", None)
    image_pull_secrets: list[PullSecret] = api_field(
        "imagePullSecrets: Secrets (in each job's namespace) to pull the trainer image with.",
        factory=list,
        max_items=16,
    )
    resources: ProfileResources | None = api_field("resources: the GPU type.", None)


@dataclass(kw_only=True)
class ProfileLimits:
    """limits: what no job of the profile may exceed; a job cannot override them."""

    max_nodes: int | None = api_field(
        "maxNodes: most nodes (spec.resources.nodes) of one job.", None, minimum=1, maximum=1024
    )
    max_gpus_per_job: int | None = api_field(
        "maxGpusPerJob: most GPUs of one job (nodes x gpusPerNode).", None, minimum=0
    )
    max_gpu_hours_per_job: float | None = api_field(
        "maxGpuHoursPerJob: most GPU-hours one job may spend: the budget (spec.budget.gpuHours) "
        "of a job that sets none, and the cap of one that does.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    allowed_image_prefixes: list[str] = api_field(
        "allowedImagePrefixes: a job's trainer image must start with one of these, on a "
        "boundary: a prefix ending in / or : matches as written (registry.example.com/ml/); "
        "any other must be the whole image or be followed by /, : or @ (registry.example.com "
        "allows registry.example.com/x and registry.example.com:5000/x, never "
        "registry.example.com.evil.io/x); empty allows any.",
        factory=list,
        max_items=32,
        min_length=1,
        max_length=512,
    )
    allowed_methods: list[Literal[METHODS]] = api_field(  # type: ignore[valid-type]
        "allowedMethods: method.type values a job may use; empty allows any.",
        factory=list,
        max_items=3,
    )
    allowed_service_accounts: list[str] = api_field(
        "allowedServiceAccounts: the ServiceAccounts (of the job's namespace) a job may run as "
        "(spec.serviceAccountName); empty allows none: the pods run as the namespace's default. "
        "A ServiceAccount is an identity (a cloud role, by workload identity), so unlike the "
        "other limits an empty list allows nothing.",
        factory=list,
        max_items=32,
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )


@dataclass(kw_only=True)
class NamespaceSelector:
    """namespaceSelector: the namespaces whose jobs take this profile when they name none."""

    match_labels: dict[str, str] = label_map(
        "matchLabels: namespace labels and the values they must have (all of them).", 16
    )


@dataclass(kw_only=True)
class GpuPrice:
    """A GPU-hour's price on one GPU type."""

    gpu_type: Literal[GPU_TYPES] = api_field("gpuType the price is for.")  # type: ignore[valid-type]
    per_gpu_hour: float = api_field("perGpuHour: the price of one GPU for one hour.", minimum=0)


@dataclass(kw_only=True)
class FineTuneProfileSpec:
    """FineTuneProfile holds a platform's defaults and limits for FineTuneJobs (cluster-wide)."""

    defaults: ProfileDefaults = api_field(
        "defaults of fields a job leaves unset.", factory=ProfileDefaults
    )
    limits: ProfileLimits = api_field("limits no job may exceed.", factory=ProfileLimits)
    prices: list[GpuPrice] = api_field(
        "prices of a GPU-hour per GPU type: a job's status.cost says what it spent (GPU-hours "
        "of its pods' running time, over every attempt) and its projection to the end.",
        factory=list,
        max_items=32,
    )
    currency: str = api_field(
        "currency of the prices (ISO 4217).", "USD", pattern=r"^[A-Z]{3}$", max_length=3
    )
    namespace_selector: NamespaceSelector | None = api_field(
        "namespaceSelector: this is the default profile of the matching namespaces (a "
        f"namespace's label {NAMESPACE_LABEL} wins over any selector).",
        None,
    )
    nameable_from: Literal[NAMEABLE] = api_field(  # type: ignore[valid-type]
        "nameableFrom: which namespaces' jobs may name this profile in spec.profile: Selected "
        f"(those its namespaceSelector matches or whose label {NAMESPACE_LABEL} names it) or "
        "Anywhere (every namespace: for a profile as strict as the tightest it could replace).",
        "Selected",
    )


@dataclass(frozen=True)
class Profile:
    """A parsed FineTuneProfile: its name, generation (1 for a file) and spec."""

    name: str
    generation: int
    spec: FineTuneProfileSpec


def parse_profile(doc: Any) -> Profile:
    """A FineTuneProfile document checked; :class:`SpecError` naming every bad field."""
    if not isinstance(doc, dict):
        raise SpecError([FieldError("(document)", "must be a FineTuneProfile object")])
    errors = []
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        got = f"{doc.get('apiVersion')}/{doc.get('kind')}"
        errors.append(FieldError("kind", f"must be {API_VERSION} {KIND}, got {got}"))
    meta = doc.get("metadata") or {}
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not kv.is_dns_subdomain(name):
        errors.append(FieldError("metadata.name", f"must {DNS_SUBDOMAIN_HINT}, got {name!r}"))
    try:
        spec = parse(FineTuneProfileSpec, doc.get("spec") or {})
    except SpecError as e:
        errors.extend(e.errors)
    if errors:
        raise SpecError(errors)
    return Profile(name, int(meta.get("generation") or 1), spec)


# ----------------------------------------------------------------------------- choosing


class NoProfile(ValueError):
    """The profile a job should take cannot be told: its message says which and what to do."""


class NotServed(NoProfile):
    """The job names a profile that does not serve its namespace: a team could otherwise take
    any profile's (looser) limits by naming it. Its message names both and the fix."""


class InvalidProfile(NoProfile):
    """The job's profile exists but cannot be read: its message names the profile, each bad
    field and the fix. Never skipped: the job would silently run without its limits."""


@dataclass(frozen=True)
class Unreadable:
    """A FineTuneProfile document that does not parse (another ftjob version's, say): its
    name, what is wrong, and its namespaceSelector as written (so a job it selects is told)."""

    name: str
    errors: list[FieldError]
    match_labels: dict[str, Any]

    @classmethod
    def of(cls, doc: dict[str, Any], error: SpecError) -> Unreadable:
        spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
        selector = spec.get("namespaceSelector") if isinstance(spec, dict) else None
        labels = selector.get("matchLabels") if isinstance(selector, dict) else None
        name = str((doc.get("metadata") or {}).get("name"))
        return cls(name, error.errors, labels if isinstance(labels, dict) else {})

    def refusal(self, where: str) -> InvalidProfile:
        said = "; ".join(str(e) for e in self.errors)
        return InvalidProfile(
            f"{where} FineTuneProfile {self.name}, which cannot be read: {said}; fix the "
            f"profile (kubectl edit ftp {self.name}) or name another"
        )


def choose(
    named: str | None,
    namespace: str,
    labels: dict[str, str],
    profiles: list[Profile],
    unreadable: list[Unreadable] = (),  # type: ignore[assignment]
) -> Profile | None:
    """The profile of a job in ``namespace`` (with ``labels``): ``spec.profile`` when named,
    else the namespace label's, else the one whose selector matches; None when none applies.
    One of ``unreadable`` that would be the job's refuses it (:class:`InvalidProfile`)."""
    by_name = {p.name: p for p in profiles}
    broken = {u.name: u for u in unreadable}
    wanted, where = named, "spec.profile"
    if wanted is None and labels.get(NAMESPACE_LABEL):
        wanted, where = labels[NAMESPACE_LABEL], f"namespace {namespace}'s label {NAMESPACE_LABEL}"
    if wanted in broken:
        raise broken[wanted].refusal(f"{where} names")
    if wanted is not None:
        if wanted not in by_name:
            raise NoProfile(
                f"{where} names FineTuneProfile {wanted}, which does not exist; create it, or "
                f"name one of: {', '.join(sorted(by_name)) or '(none exist)'}"
            )
        if named is not None and not serves(by_name[wanted], namespace, labels):
            raise NotServed(not_served(wanted, namespace))
        return by_name[wanted]
    for u in sorted(broken.values(), key=lambda u: u.name):
        if u.match_labels and all(labels.get(k) == v for k, v in u.match_labels.items()):
            raise u.refusal(f"namespace {namespace} matches the namespaceSelector of")
    matching = sorted(
        (p for p in profiles if _selects(p.spec.namespace_selector, labels)), key=lambda p: p.name
    )
    if len(matching) > 1:
        names = ", ".join(p.name for p in matching)
        raise NoProfile(
            f"namespace {namespace} matches the namespaceSelector of several FineTuneProfiles "
            f"({names}); label the namespace {NAMESPACE_LABEL}=<name> to choose one"
        )
    return matching[0] if matching else None


def serves(profile: Profile, namespace: str, labels: dict[str, str]) -> bool:
    """Whether a job in ``namespace`` (with ``labels``) may name ``profile``: its selector
    matches the namespace, the namespace's label names it, or it is nameable from anywhere.
    Who may label namespaces and edit profiles is the platform team's RBAC, not a team's."""
    return (
        profile.spec.nameable_from == "Anywhere"
        or labels.get(NAMESPACE_LABEL) == profile.name
        or _selects(profile.spec.namespace_selector, labels)
    )


def not_served(name: str, namespace: str) -> str:
    """The refusal of a job naming a profile that does not serve its namespace (policy.py's
    CEL says the same words at the door)."""
    return (
        f"spec.profile: FineTuneProfile {name} does not serve namespace {namespace} (neither "
        f"its namespaceSelector nor the namespace's label {NAMESPACE_LABEL} selects it); fix: "
        f"name the namespace's own profile or none, or ask the platform team to label "
        f"namespace {namespace} {NAMESPACE_LABEL}={name} or to set nameableFrom: Anywhere on "
        f"FineTuneProfile {name}"
    )


def _selects(selector: NamespaceSelector | None, labels: dict[str, str]) -> bool:
    # An empty selector would match every namespace: a cluster-wide default must say so with
    # a label every namespace has (kubernetes.io/metadata.name exists, for example).
    if selector is None or not selector.match_labels:
        return False
    return all(labels.get(k) == v for k, v in selector.match_labels.items())


# ----------------------------------------------------------------------------- the merge


@dataclass(frozen=True)
class Applied:
    """A job with its profile applied: the merged document and what it breaks."""

    doc: dict[str, Any]
    profile: str
    generation: int
    violations: list[FieldError]
    pinned: dict[str, Any]  # the defaults of immutable sections, as applied (see PINNED)

    price: float | None = None  # of a GPU-hour of the merged job's gpuType, if priced
    currency: str = "USD"

    @property
    def record(self) -> dict[str, Any]:
        """What the job's status keeps of the profile it was given."""
        out = {"name": self.profile, "generation": self.generation}
        return out | ({"pinned": self.pinned} if self.pinned else {})


# Sections of a job that never change once it exists (the CRD's immutable fields: the
# checkpoint volume its checkpoints live on, its resources): the profile's defaults for them
# are kept with the job as first applied, so a profile edited later never moves a job's
# checkpoints to another volume.
PINNED = ("checkpoint", "resources")
# Taken whole from whichever side sets it: merging two affinities would OR their node
# selector terms, widening where the job may run.
ATOMIC = frozenset({"affinity"})


def merge(default: Any, job: Any, key: str = "") -> Any:
    """``job`` over ``default``: unset (None, {}, []) takes the default; objects merge key by
    key; lists add up, a named item of the job's replacing the default's of that name."""
    if job is None or job == {} or job == []:
        return default
    if default is None or key in ATOMIC:
        return job
    if isinstance(job, dict) and isinstance(default, dict):
        keys = list(job) + [k for k in default if k not in job]
        return {k: merge(default.get(k), job.get(k), k) for k in keys}
    if isinstance(job, list) and isinstance(default, list):
        named = {item.get("name") for item in job if isinstance(item, dict)} - {None}
        kept = [
            item
            for item in default
            if item not in job and not (isinstance(item, dict) and item.get("name") in named)
        ]
        return kept + job
    return job


@cache
def _job_schema() -> dict[str, Any]:
    return openapi(FineTuneJobSpec)  # the CRD's spec schema (api/crd.py)


def as_stored(job: dict[str, Any]) -> dict[str, Any]:
    """A job's spec as the API server stores it: the CRD schema's defaults filled in. The
    operator only ever sees a job so; a job file is taken so too before a profile merges
    under it, or a field the schema defaults inside an object both set (a secret ref's key,
    tracking.mlflow.experiment) would take the profile's value in ``ftjob validate`` and the
    schema's on the cluster. Idempotent: a stored job is unchanged."""
    schema = _job_schema()
    return admission.apply_defaults(schema, admission.prune_nulls(schema, copy.deepcopy(job)))


def apply(
    doc: dict[str, Any],
    profile: Profile,
    default_image: str | None = None,
    pinned: dict[str, Any] | None = None,
) -> Applied:
    """``doc`` (a FineTuneJob document) with ``profile``'s defaults under what it sets, and the
    limits the merged job breaks. ``default_image``: the image of a job that names none after
    the merge (the operator's), which the image limit holds too. ``pinned``: the
    :data:`PINNED` defaults as first applied to this job (its status keeps them). The job is
    taken as stored (:func:`as_stored`): what its CRD defaults, the job has set."""
    spec = doc.get("spec")
    job = as_stored(spec) if isinstance(spec, dict) else {}
    defaults = _pruned(to_dict(profile.spec.defaults))
    if not _gpus(job):  # a GPU type is a GPU job's: a CPU job naming one is refused
        defaults.pop("resources", None)
    if pinned is not None:
        defaults = {k: v for k, v in defaults.items() if k not in PINNED} | pinned
    cap = profile.spec.limits.max_gpu_hours_per_job
    if cap is not None and _gpus(job):  # the budget of a GPU job that sets none
        defaults["budget"] = {"gpuHours": cap}
    merged = dict(doc)
    merged["spec"] = merge(defaults, job)
    violations: list[FieldError] = []
    try:
        spec = parse(FineTuneJobSpec, merged["spec"])
    except SpecError:
        spec = None  # the job's own errors are reported by its own check; no limit is read
    if spec is not None:
        violations = limit_violations(spec, profile, default_image)
    kept = {k: defaults[k] for k in PINNED if k in defaults}
    gpu_type = (merged["spec"].get("resources") or {}).get("gpuType")
    prices = {p.gpu_type: p.per_gpu_hour for p in profile.spec.prices}
    price = prices.get(gpu_type)
    currency = profile.spec.currency
    return Applied(merged, profile.name, profile.generation, violations, kept, price, currency)


def _gpus(job: dict[str, Any]) -> bool:
    resources = job.get("resources")
    per_node = resources.get("gpusPerNode") if isinstance(resources, dict) else None
    return per_node != 0  # unset is the default, 1


def _pruned(value: Any) -> Any:
    """``value`` without empty maps and lists (a profile's unset defaults)."""
    if isinstance(value, dict):
        out = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in ({}, [], None)}
    return value


def limit_violations(
    spec: FineTuneJobSpec, profile: Profile, default_image: str | None = None
) -> list[FieldError]:
    """Each limit of ``profile`` that ``spec`` (merged) breaks, naming the limit, the profile
    and the fix."""
    of = f"of FineTuneProfile {profile.name}"
    return [
        *_size_violations(spec, profile.spec.limits, of),
        *_image_violations(spec.image or default_image, profile.spec.limits, of),
        *_budget_violations(spec, profile, of),
        *_method_violations(spec, profile.spec.limits, of),
        *_identity_violations(spec, profile.spec.limits, of),
    ]


def under_prefix(image: str, prefix: str) -> bool:
    """Whether ``image`` is under ``prefix`` on a registry or path boundary: a prefix ending
    in / or : matches as written; any other must be the whole image or be followed by /, :
    (a port or a tag) or @ (a digest), so registry.example.com never allows
    registry.example.com.evil.io/x. policy.py's CEL says the same."""
    if prefix.endswith(("/", ":")):
        return image.startswith(prefix)
    return image == prefix or image.startswith(tuple(prefix + s for s in "/:@"))


def _size_violations(spec: FineTuneJobSpec, limits: ProfileLimits, of: str) -> list[FieldError]:
    r, out = spec.resources, []
    if r.nodes > 1 and spec.checkpoint.volume is None:  # the CRD let it in for its profile
        out.append(
            FieldError(
                "spec.checkpoint.volume",
                f"more than one node needs a shared volume, and neither the job nor "
                f"defaults.checkpoint.volume {of} gives one",
                fix="set checkpoint.volume.claimName, or give the profile a default volume",
            )
        )
    if limits.max_nodes is not None and r.nodes > limits.max_nodes:
        out.append(
            FieldError(
                "spec.resources.nodes",
                f"{r.nodes} nodes exceed limits.maxNodes {limits.max_nodes} {of}",
                fix=f"set resources.nodes to at most {limits.max_nodes}, or ask the platform "
                "team for a profile that allows more",
            )
        )
    gpus = r.nodes * r.gpus_per_node
    if limits.max_gpus_per_job is not None and gpus > limits.max_gpus_per_job:
        out.append(
            FieldError(
                "spec.resources.gpusPerNode",
                f"{gpus} GPUs ({r.nodes} nodes x {r.gpus_per_node}) exceed limits.maxGpusPerJob "
                f"{limits.max_gpus_per_job} {of}",
                fix=f"ask for at most {limits.max_gpus_per_job} GPUs (nodes x gpusPerNode)",
            )
        )
    return out


def _image_violations(image: str | None, limits: ProfileLimits, of: str) -> list[FieldError]:
    prefixes = limits.allowed_image_prefixes
    if not prefixes or image is None or any(under_prefix(image, p) for p in prefixes):
        return []
    return [
        FieldError(
            "spec.image",
            f"{image} is not under limits.allowedImagePrefixes {of}",
            fix=f"use an image starting with {' or '.join(prefixes)}",
        )
    ]


def _budget_violations(spec: FineTuneJobSpec, profile: Profile, of: str) -> list[FieldError]:
    budget, cap, out = spec.budget, profile.spec.limits.max_gpu_hours_per_job, []
    if cap is not None and budget.gpu_hours is not None and budget.gpu_hours > cap:
        out.append(
            FieldError(
                "spec.budget.gpuHours",
                f"{budget.gpu_hours:g} GPU-hours exceed limits.maxGpuHoursPerJob {cap:g} {of}",
                fix=f"set budget.gpuHours to at most {cap:g}",
            )
        )
    gpu_type = spec.resources.gpu_type or ""
    priced = {p.gpu_type for p in profile.spec.prices}
    # Money is counted only at a price: unpriced, the spend stays 0 and the budget never stops.
    if budget.amount is not None and gpu_type not in priced:
        out.append(
            FieldError(
                "spec.budget.amount",
                f"a budget in money needs a price, and FineTuneProfile {profile.name} has no "
                f"price for gpuType {gpu_type or '(none set)'}",
                fix="set budget.gpuHours instead, or ask the platform team to add that gpuType "
                f"to prices of FineTuneProfile {profile.name}",
            )
        )
    return out


def _method_violations(spec: FineTuneJobSpec, limits: ProfileLimits, of: str) -> list[FieldError]:
    methods = limits.allowed_methods
    if not methods or spec.method.type in methods:
        return []
    return [
        FieldError(
            "spec.method.type",
            f"{spec.method.type} is not in limits.allowedMethods {of}",
            fix=f"use method.type {' or '.join(methods)}",
        )
    ]


def _identity_violations(spec: FineTuneJobSpec, limits: ProfileLimits, of: str) -> list[FieldError]:
    allowed, name = limits.allowed_service_accounts, spec.service_account_name
    if name is None or name in allowed:
        return []
    return [
        FieldError(
            "spec.serviceAccountName",
            f"{name} is not in limits.allowedServiceAccounts {of}",
            fix=(f"use serviceAccountName {' or '.join(allowed)}, or " if allowed else "")
            + "ask the platform team to add it to limits.allowedServiceAccounts",
        )
    ]
