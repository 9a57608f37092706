"""tracking: the experiment trackers rank 0 reports to (MLflow, Weights & Biases,
TensorBoard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ftjob.api.jobspec.fields import SecretKeyRef
from ftjob.api.schema import Rule, api_field

# An MLflow tracking server over HTTP(S), or Databricks' (databricks, databricks://profile).
MLFLOW_URI = r"^(https?://[^\s/]+(/[^\s]*)?|databricks(://[^\s]*)?)$"
# What W&B accepts as a project or entity name.
WANDB_NAME = r"^[^/\\#?%:\s]+$"


@dataclass(kw_only=True)
class MlflowSpec:
    """mlflow: an MLflow tracking server records the job as one run, kept across restarts."""

    tracking_uri: str = api_field(
        "trackingUri of the MLflow tracking server, e.g. http://mlflow.mlflow:5000 (http, "
        "https, or databricks).",
        pattern=MLFLOW_URI,
        pattern_hint="be an http(s):// address of an MLflow tracking server, or databricks",
        max_length=512,
        example="http://mlflow.mlflow:5000",
    )
    experiment: str = api_field(
        "experiment the run is recorded in; created if missing.",
        "ftjob",
        min_length=1,
        max_length=256,
    )
    username: SecretKeyRef | None = api_field(
        "username for HTTP basic auth (becomes MLFLOW_TRACKING_USERNAME); needs password.",
        None,
    )
    password: SecretKeyRef | None = api_field(
        "password for HTTP basic auth (becomes MLFLOW_TRACKING_PASSWORD); needs username.",
        None,
    )
    token: SecretKeyRef | None = api_field(
        "token: a bearer token instead of username and password (becomes MLFLOW_TRACKING_TOKEN).",
        None,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.username) == has(self.password)",
            "username and password go together: set both (basic auth), or neither",
            ".password",
        ),
        Rule(
            "!has(self.token) || !has(self.username)",
            "set token or username and password, not both",
            ".token",
        ),
    )


@dataclass(kw_only=True)
class WandbSpec:
    """wandb: Weights & Biases records the job as one run, kept across restarts."""

    project: str = api_field(
        "project the run is recorded in.",
        pattern=WANDB_NAME,
        pattern_hint="be a W&B project name (no '/', '\\', '#', '?', '%', ':' or spaces)",
        max_length=128,
    )
    entity: str | None = api_field(
        "entity (team or user) owning the project (default: the API key's default entity).",
        None,
        pattern=WANDB_NAME,
        pattern_hint="be a W&B entity name (no '/', '\\', '#', '?', '%', ':' or spaces)",
        max_length=128,
    )
    api_key: SecretKeyRef | None = api_field(
        "apiKey: the W&B API key (becomes WANDB_API_KEY); required in online mode.", None
    )
    mode: Literal["online", "offline"] = api_field(
        "mode: online sends the run to W&B as it trains; offline writes it to the job's "
        "folder (wandb/) for a later `wandb sync`.",
        "online",
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.mode == 'offline' || has(self.apiKey)",
            "online mode needs apiKey, a Secret key holding the W&B API key; add it, or set "
            "mode: offline",
            ".apiKey",
        ),
    )


@dataclass(kw_only=True)
class TensorboardSpec:
    """tensorboard: TensorBoard event files in the job's folder (tensorboard/)."""

    enabled: bool = api_field("enabled writes the event files.", True)


@dataclass(kw_only=True)
class TrackingSpec:
    """tracking: experiment trackers rank 0 reports the run to (the spec as parameters, step
    and eval metrics, the export's location). A tracker that is down never fails training."""

    mlflow: MlflowSpec | None = api_field("mlflow: an MLflow tracking server.", None)
    wandb: WandbSpec | None = api_field("wandb: Weights & Biases.", None)
    tensorboard: TensorboardSpec | None = api_field(
        "tensorboard: event files in the job's folder.", None
    )
