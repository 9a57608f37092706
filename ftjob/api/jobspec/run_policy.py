"""runPolicy, budget, plan and preflight: what a job may spend, when it is retried, stopped
or failed, and the checks made before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ftjob.api.schema import api_field


@dataclass(kw_only=True)
class BudgetSpec:
    """budget: what the job may spend; reached, the gang checkpoints and stops (phase
    Stopped, reason BudgetReached), and raising it resumes from that checkpoint."""

    gpu_hours: float | None = api_field(
        "gpuHours: GPU-hours of the pods' running time, over every attempt (status.cost); "
        "capped by the profile's limits.maxGpuHoursPerJob.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    amount: float | None = api_field(
        "amount: money at the profile's prices (status.cost.amount, in its currency).",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    node_hours: float | None = api_field(
        "nodeHours: hours of the gang's pods' running time, one pod a node, over every attempt "
        "(status.cost.nodeHours): how whole-node instances are billed, and a CPU job's budget.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )


@dataclass(kw_only=True)
class RunPolicySpec:
    """runPolicy: retries, timeouts and suspension."""

    backoff_limit: int = api_field(
        "backoffLimit: gang restarts allowed after failures before the job fails.",
        3,
        minimum=0,
        maximum=100,
    )
    stall_timeout_seconds: int = api_field(
        "stallTimeoutSeconds: no training progress for this long restarts the gang (training "
        "steps only; see startupTimeoutSeconds for what comes before the first).",
        1800,
        minimum=60,
    )
    start_timeout_seconds: int = api_field(
        "startTimeoutSeconds: the job fails if the pods of a gang do not all run this long "
        "after they exist (unschedulable, a missing claim, an image that cannot be pulled, a "
        "container that cannot be created; the reason is in the Pending condition and a "
        "Warning Event). Time gated by Kueue, waiting for quota, does not count.",
        1800,
        minimum=1,
    )
    startup_timeout_seconds: int = api_field(
        "startupTimeoutSeconds: the gang is restarted if its first training step has not "
        "started this long after every pod runs (downloading, preparing data, loading weights; "
        "rank 0 reports the phase it is in).",
        3600,
        minimum=60,
    )
    active_deadline_seconds: int | None = api_field(
        "activeDeadlineSeconds: the job fails once it has been active this long.", None, minimum=1
    )
    ttl_seconds_after_finished: int | None = api_field(
        "ttlSecondsAfterFinished: delete the finished job after this long (the volume keeps "
        "its files).",
        None,
        minimum=0,
    )
    suspend: bool = api_field(
        "suspend: true removes the pods and keeps the checkpoints; false resumes from them.",
        False,
    )
    in_place_restarts: int = api_field(
        "inPlaceRestarts: worker restarts in place per gang before the gang fails (then "
        "backoffLimit decides on a new gang). A worker failure restarts the workers of every "
        "node from the newest checkpoint without re-creating pods; a permanent failure (BadData, "
        "BadModel, BadSpec) never restarts.",
        3,
        minimum=0,
        maximum=100,
    )
    straggler_margin: float = api_field(
        "stragglerMargin: a rank whose step time exceeds (1 + stragglerMargin) x the median of "
        "all ranks on 3 consecutive log steps is named a straggler (log, progress, metric).",
        0.25,
        minimum=0,
        exclusive_minimum=True,
    )


# The bus bandwidth (GB/s, nccl-tests' busbw of an all-reduce) below which a multi-node
# gang's fabric is taken for misconfigured when preflight.minBusBandwidthGBps is unset. Far
# below what the fabric should give (EFA on p4d/p5 and 200-400 Gb/s InfiniBand: tens of GB/s,
# read from vendor figures, not measured here), and above what NCCL's fallback to sockets
# reaches on such hosts (a few GB/s): the check is for a wrong transport, not a slow one.
FABRIC_MIN_BUS_GBPS = {"efa": 10.0, "infiniband": 10.0, "tcp": None}


@dataclass(kw_only=True)
class PreflightSpec:
    """preflight: checks every pod runs before any weight is read (seconds): per GPU a timed
    matmul and a memory check, an all-reduce across the gang (its bus bandwidth and the
    transport NCCL chose), a write/read of the job's volume. A failed check fails the gang
    with NodeUnhealthy, FabricMisconfigured or VolumeUnusable; the node is kept away from the
    next gang where the fault is the node's."""

    mode: Literal["auto", "on", "off"] = api_field(
        "mode: auto runs the preflight when the job requests GPUs, on always (CPU jobs check "
        "the volume and the all-reduce), off never.",
        "auto",
    )
    min_bus_bandwidth_g_bps: float | None = api_field(
        "minBusBandwidthGBps: the all-reduce's bus bandwidth (GB/s, as nccl-tests reports "
        "busbw) below which the gang fails with FabricMisconfigured. Unset: 10 for fabric efa "
        "and infiniband with more than one node, no floor otherwise.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    min_matmul_tflops: float | None = api_field(
        "minMatmulTflops: a GPU whose bf16 matmul runs slower than this (TFLOP/s) fails its "
        "node with NodeUnhealthy. Unset: 40% of the dense bf16 peak of resources.gpuType (or "
        "of the GPU's CUDA name), no floor for an unknown GPU.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    min_free_memory_fraction: float = api_field(
        "minFreeMemoryFraction: a GPU with less of its memory free than this before loading "
        "(another process holds it, or the device reports less than it has) fails its node.",
        0.9,
        minimum=0,
        maximum=1,
    )
    timeout_seconds: int = api_field(
        "timeoutSeconds: the all-reduce must finish within this long, or the gang fails with "
        "FabricMisconfigured.",
        120,
        minimum=5,
        maximum=3600,
    )

    def enabled(self, on_gpu: bool) -> bool:
        return self.mode == "on" or (self.mode == "auto" and on_gpu)

    def bus_floor(self, fabric: str, nodes: int) -> float | None:
        """The bus bandwidth floor in force (GB/s), or None."""
        if self.min_bus_bandwidth_g_bps is not None:
            return self.min_bus_bandwidth_g_bps
        return FABRIC_MIN_BUS_GBPS[fabric] if nodes > 1 else None


@dataclass(kw_only=True)
class PlanSpec:
    """plan: the memory check made before any pod starts (ftjob plan shows it)."""

    enforce: bool = api_field(
        "enforce: a job whose plan says it will not fit never starts pods (condition Planned, "
        "reason WillNotFit, with what to change). false only records the plan.",
        True,
    )
