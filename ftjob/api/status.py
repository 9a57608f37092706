"""The FineTuneJob status: what the operator observed, as typed classes.

Only the schema is generated from these (the API server drops status fields the CRD does not
declare), with the objectives' metrics added to progress (:func:`schema`); the operator's pure
``operator/status.py`` fills them in.
"""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass
from typing import Any, Literal

from ftjob.api import contract, objectives
from ftjob.api.schema import FreeForm, api_field, openapi

# Stopped: the budget (spec.budget) is spent; a user suspend is Suspended. Both keep the
# checkpoints and resume: Stopped when the budget is raised, Suspended when resumed.
PHASES = ("Pending", "Running", "Restarting", "Suspended", "Stopped", "Succeeded", "Failed")
# The trainer's own reasons (its termination record), then what the operator sees itself.
FAILURE_REASONS = (
    *contract.REASONS,
    "OOMKilled",
    "BadInput",
    "Evicted",
    "Preempted",
    "Lost",
    "Stalled",
    "StartupTimeout",
    "StartTimeout",
    "DeadlineExceeded",
    "OverLimit",
    "NoProfile",
    "InvalidProfile",
    "Error",
)


@dataclass(kw_only=True)
class Condition:
    """A condition after the Kubernetes API conventions."""

    type: str = api_field("type of the condition, PascalCase (Running, Succeeded, ...).")
    status: Literal["True", "False", "Unknown"] = api_field("status of the condition.")
    reason: str = api_field("reason: one CamelCase word.", max_length=64)
    message: str = api_field("message for humans.", "", max_length=4096)
    last_transition_time: str = api_field(
        "lastTransitionTime: when status last changed.", fmt="date-time"
    )
    observed_generation: int | None = api_field(
        "observedGeneration of the spec this condition was set from.", None
    )


@dataclass(kw_only=True)
class Progress:
    """progress as rank 0 of the trainer reports it."""

    phase: str | None = api_field(
        "phase of the trainer: starting, downloading, preparing-data, loading, training, "
        "checkpointing, evaluating, exporting, pushing, succeeded or failed.",
        None,
    )
    step: int = api_field("step: optimizer steps done.", 0)
    total_steps: int | None = api_field("totalSteps of the run.", None)
    display: str | None = api_field("display: step/total for the printer column.", None)
    loss: float | None = api_field("loss: training loss of the latest logged step.", None)
    eval_loss: float | None = api_field("evalLoss of the latest evaluation.", None)
    # Here the schema has the objectives' own metrics (schema()).
    learning_rate: float | None = api_field("learningRate in force.", None)
    tokens_per_second: float | None = api_field("tokensPerSecond across the gang.", None)
    mfu: float | None = api_field("mfu: model FLOPs utilisation, in percent.", None)
    eta: str | None = api_field("eta: estimated time to finish, e.g. 1h12m.", None)
    replaces_export: str | None = api_field(
        "replacesExport: this run continues a finished job (maxSteps raised) and will replace "
        "the export at this path when it completes; the export stays readable until then.",
        None,
    )
    pushed_to: list[str] | None = api_field(
        "pushedTo: where the export was uploaded (output.push), in its order: each Hub commit "
        "or s3:// prefix.",
        None,
    )
    download: str | None = api_field(
        "download: how much of an s3:// source rank 0 has downloaded, e.g. '1.20 of 5.00 GiB "
        "(24%)'; kept once complete.",
        None,
    )
    promotion: str | None = api_field(
        "promotion: whether output.promoteWhen held of the final evaluation, with the numbers: "
        "'promoted: evalLoss 1.62 < 1.8' or 'not promoted: evalLoss 2.01 < 1.8 does not hold'.",
        None,
    )
    tracking_warnings: list[str] = api_field(
        "trackingWarnings: experiment trackers this run went on without, and why "
        "(spec.tracking); training is not affected.",
        factory=list,
        max_items=8,
    )
    update_time: str | None = api_field(
        "updateTime: when the trainer last reported.", None, fmt="date-time"
    )


@dataclass(kw_only=True)
class CheckpointStatus:
    """lastCheckpoint: the newest complete checkpoint."""

    step: int = api_field("step the checkpoint was taken after.")
    path: str = api_field("path of the checkpoint folder on the volume.")
    time: str | None = api_field("time it was committed.", None, fmt="date-time")


@dataclass(kw_only=True)
class Failure:
    """failure: the diagnosis of the latest failure."""

    reason: Literal[FAILURE_REASONS] = api_field("reason: what kind of failure it was.")  # type: ignore[valid-type]
    message: str = api_field("message: what happened and what to do.", "", max_length=4096)
    pod: str | None = api_field("pod that failed.", None)
    node: str | None = api_field(
        "node of the failure: the one the trainer's record names (its own, or the node a "
        "preflight check failed on), else the node the pod ran on.",
        None,
    )
    rank: int | None = api_field("rank: node rank of the pod.", None)
    exit_code: int | None = api_field("exitCode of the trainer container.", None)
    node_fault: bool | None = api_field(
        "nodeFault: the failure is the node's (a GPU failed the preflight, a hardware error, "
        "the pod evicted for node pressure or its node lost), not the job's; when a next gang "
        "follows, the node goes on badNodes.",
        None,
    )


@dataclass(kw_only=True)
class BadNode:
    """A node a failure was blamed on; the job's next gangs avoid it."""

    node: str = api_field("node: the Kubernetes node name.", max_length=253)
    reason: str = api_field("reason of the latest failure blamed on it.", max_length=64)
    count: int = api_field("count: failures blamed on it.", 1)
    last_seen: str | None = api_field("lastSeen: when the latest was.", None, fmt="date-time")


@dataclass(kw_only=True)
class Straggler:
    """A rank rank 0 names as persistently slower than the median of all ranks."""

    rank: int = api_field("rank of the slow process.")
    node: str | None = api_field("node it runs on.", None, max_length=253)
    step_seconds: float | None = api_field("stepSeconds: its recent step time.", None)
    median_seconds: float | None = api_field("medianSeconds: the median of all ranks.", None)


@dataclass(kw_only=True)
class PreflightStatus:
    """preflight: what the newest gang's checks before loading measured."""

    bus_bandwidth_g_bps: float | None = api_field(
        "busBandwidthGBps: bus bandwidth of the all-reduce across the gang (GB/s, "
        "nccl-tests' busbw).",
        None,
    )
    transport: str | None = api_field(
        "transport NCCL chose between the nodes (efa, ib, socket; gloo on CPU).", None
    )
    matmul_tflops: float | None = api_field(
        "matmulTflops: the slowest GPU's bf16 matmul (TFLOP/s).", None
    )
    volume_write_m_bps: float | None = api_field(
        "volumeWriteMBps: the slowest node's write to the job's volume (MB/s).", None
    )
    seconds: float | None = api_field("seconds the checks took.", None)
    nodes: int | None = api_field("nodes checked.", None)
    note: str | None = api_field("note: what was not checked, and why.", None)


@dataclass(kw_only=True)
class AttemptCost:
    """One gang attempt's node and GPU time."""

    attempt: int = api_field("attempt of the gang.")
    gpu_seconds: float = api_field("gpuSeconds: its pods' running seconds times their GPUs.")
    node_seconds: float = api_field(
        "nodeSeconds: its pods' running seconds (one pod a node; a CPU job's only time).", 0.0
    )
    price_per_gpu_hour: float | None = api_field(
        "pricePerGpuHour its profile named for the job's gpuType, if any.", None
    )


@dataclass(kw_only=True)
class CostStatus:
    """cost: what the job's pods have run, from their containers' real running times."""

    attempts: list[AttemptCost] = api_field(
        "attempts: each gang's node and GPU time (kept once its pods are gone).",
        factory=list,
        max_items=64,
    )
    gpu_hours: float = api_field("gpuHours spent so far, over every attempt.", 0.0)
    node_hours: float = api_field(
        "nodeHours: the gang's pods' running hours so far, over every attempt (GPU jobs and CPU "
        "jobs alike).",
        0.0,
    )
    amount: float | None = api_field(
        "amount spent so far at the profile's prices (FineTuneProfile spec.prices).", None
    )
    currency: str | None = api_field("currency of amount.", None)
    projected_gpu_hours: float | None = api_field(
        "projectedGpuHours at the end: spent plus the trainer's ETA on the gang's GPUs.", None
    )
    projected_amount: float | None = api_field("projectedAmount at the end.", None)
    display: str | None = api_field(
        "display for kubectl get -o wide, e.g. 1.25 GPU-h 4.00 USD (~10.00 USD).", None
    )


@dataclass(kw_only=True)
class ProfileStatus:
    """profile: the FineTuneProfile applied to the newest gang."""

    name: str = api_field("name of the FineTuneProfile.")
    generation: int = api_field("generation of the profile the gang was made from.")
    attempt: int | None = api_field("attempt: the gang that took this generation.", None)
    pinned: FreeForm | None = api_field(
        "pinned: the profile's defaults of the job's immutable sections (checkpoint, "
        "resources) as first applied; later gangs keep them whatever the profile says then.",
        None,
    )


@dataclass(kw_only=True)
class FineTuneJobStatus:
    """FineTuneJobStatus is the observed state of a FineTuneJob."""

    phase: Literal[PHASES] | None = api_field("phase for humans and printer columns.", None)  # type: ignore[valid-type]
    conditions: list[Condition] = api_field(
        "conditions: Planned, Created, Running, Restarting, Suspended, Stopped, Succeeded, Failed.",
        factory=list,
        max_items=16,
    )
    observed_generation: int | None = api_field(
        "observedGeneration: the spec generation this status describes.", None
    )
    attempt: int | None = api_field("attempt: the gang attempt now running (0, 1, ...).", None)
    restarts: int | None = api_field(
        "restarts: gang restarts so far (every pod replaced; runPolicy.backoffLimit bounds them).",
        None,
    )
    restarts_in_place: int | None = api_field(
        "restartsInPlace: worker restarts in place so far, across gangs (torchrun restarted "
        "the training processes inside the pods; runPolicy.inPlaceRestarts bounds them per "
        "gang).",
        None,
    )
    attempt_restarts_in_place: int | None = api_field(
        "attemptRestartsInPlace: the current gang's restarts in place.", None
    )
    bad_nodes: list[BadNode] = api_field(
        "badNodes: nodes failures were blamed on, oldest first (at most 16); the next gangs' "
        "pods avoid them (required node anti-affinity). Patch it away to allow them again "
        "(docs/operator.md).",
        factory=list,
        max_items=16,
    )
    stragglers: list[Straggler] = api_field(
        "stragglers: ranks now persistently slower than the median.", factory=list, max_items=16
    )
    preflight: PreflightStatus | None = api_field(
        "preflight: what the checks before loading measured.", None
    )
    start_time: str | None = api_field("startTime of the first attempt.", None, fmt="date-time")
    waiting_since: str | None = api_field(
        "waitingSince: when the current gang's pods all existed without all running, not "
        "gated by Kueue (runPolicy.startTimeoutSeconds counts from here).",
        None,
        fmt="date-time",
    )
    partly_placed_since: str | None = api_field(
        "partlyPlacedSince: when the current gang, no PodGroup, had some pods bound while "
        "another could not be placed; past a grace period its pods are given back.",
        None,
        fmt="date-time",
    )
    whole_after: str | None = api_field(
        "wholeAfter: when the gang given back (reason PartlyPlaced) is made again, whole.",
        None,
        fmt="date-time",
    )
    completion_time: str | None = api_field(
        "completionTime: when the job succeeded or failed.", None, fmt="date-time"
    )
    progress: Progress | None = api_field("progress of training.", None)
    last_checkpoint: CheckpointStatus | None = api_field("lastCheckpoint committed.", None)
    failure: Failure | None = api_field("failure: why the last attempt failed.", None)
    model_path: str | None = api_field("modelPath: where the exported model is.", None)
    image: str | None = api_field(
        "image: the trainer image of the newest gang's pods (spec.image, else the operator's "
        "default image).",
        None,
    )
    profile: ProfileStatus | None = api_field(
        "profile: the FineTuneProfile (and its generation) the newest gang was made with; a "
        "profile edited later changes no running gang, the next gang says which it took.",
        None,
    )
    cost: CostStatus | None = api_field("cost of a GPU job so far, and projected.", None)
    job_folder: str | None = api_field(
        "jobFolder: the job's folder on the checkpoint volume as the pods see it "
        "(checkpoints, caches, export): /ftjob/<name>-<first 8 characters of the uid> unless "
        "spec.checkpoint.path names one.",
        None,
    )


def schema() -> dict[str, Any]:
    """status's OpenAPI schema: :class:`FineTuneJobStatus`, with the objectives' metrics that
    status reports (api/objectives.py) in progress after evalLoss, typed like its fields."""
    out = openapi(FineTuneJobStatus)
    progress = out["properties"]["progress"]
    declared = objectives.status().items()
    own = [(key, float | None, api_field(doc, None)) for key, doc in declared]
    own_schema = openapi(make_dataclass("ObjectiveMetrics", own))["properties"]
    fields = list(progress["properties"].items())
    at = [key for key, _ in fields].index("evalLoss") + 1
    progress["properties"] = dict(fields[:at]) | own_schema | dict(fields[at:])
    return out
