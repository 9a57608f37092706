"""env, secrets and imagePullSecrets: what the pods are given, by value or by reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ftjob.api import contract
from ftjob.api import kubevalidation as kv
from ftjob.api.jobspec.fields import DNS_SUBDOMAIN_HINT, SecretKeyRef
from ftjob.api.schema import Rule, api_field

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# Variables ftjob sets itself for torchrun and the trainer; a user value would break wiring.
RESERVED_ENV_PREFIXES = ("PET_", "FTJOB_", "TORCHELASTIC_")
RESERVED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "HF_TOKEN")
# ftjob's own variables that are the user's to set: knobs, not wiring (a profile's window, which
# `ftjob run --profile-steps` sets and a cluster job sets in spec.env).
USER_ENV = (contract.PROFILE_STEPS_ENV,)


@dataclass(kw_only=True)
class SecretsSpec:
    """secrets: credentials, passed to pods only as secretKeyRefs."""

    hugging_face_token: SecretKeyRef | None = api_field(
        "huggingFaceToken for gated or private hf:// models and datasets, and for output.push "
        "(becomes HF_TOKEN).",
        None,
    )


@dataclass(kw_only=True)
class PullSecret:
    """A Secret of the job's namespace with registry credentials (a dockerconfigjson)."""

    name: str = api_field(
        "name of the Secret.",
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )


@dataclass(kw_only=True)
class EnvSource:
    """valueFrom: where a variable's value is kept, so that it is never written in the job."""

    secret_key_ref: SecretKeyRef = api_field(
        "secretKeyRef: a key of a Secret in the job's namespace. On a cluster the pods read it "
        "(the job, its ConfigMap and its pods hold only the reference); `ftjob run` takes the "
        "variable from its own environment."
    )


@dataclass(kw_only=True)
class EnvVar:
    """An environment variable set on every training process: a value, or a Secret's key.
    The values of variables reach no tracker, status, Event or log (a value from a Secret is
    masked in what the trainer prints and records)."""

    name: str = api_field(
        "name of the variable.", pattern=ENV_NAME, pattern_hint="be an identifier", max_length=128
    )
    value: str = api_field(
        "value of the variable, written in the job as it is: a credential goes in valueFrom.",
        "",
        max_length=4096,
    )
    value_from: EnvSource | None = api_field(
        "valueFrom: the variable's value from a Secret (valueFrom.secretKeyRef.name and .key).",
        None,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.valueFrom) || !has(self.value) || self.value == ''",
            "set value or valueFrom, not both",
            ".valueFrom",
        ),
    )
