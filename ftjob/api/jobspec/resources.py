"""resources, parallelism and network: the shape of the gang, how FSDP shards it, and the
fabric between its nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ftjob.api.hardware import GPUS, RETIRED_GPU_TYPES
from ftjob.api.schema import QUANTITY_PATTERN, IntOrString, Rule, api_field

GPU_TYPES = tuple(GPUS)
# parallelism.contextParallel: auto or a number of processes, 1 to 256 (processesPerNode's most).
CONTEXT_PARALLEL = r"^(auto|[1-9][0-9]{0,2})$"


@dataclass(kw_only=True)
class ResourcesSpec:
    """resources: the shape of the gang."""

    nodes: int = api_field("nodes: pods in the gang, one per node.", 1, minimum=1, maximum=1024)
    gpus_per_node: int = api_field(
        "gpusPerNode: GPUs each pod takes, one training process each; 0 trains on CPU.",
        1,
        minimum=0,
        maximum=64,
    )
    processes_per_node: int | None = api_field(
        "processesPerNode: training processes per pod for CPU jobs (default 1). GPU jobs run "
        "one per GPU.",
        None,
        minimum=1,
        maximum=256,
    )
    gpu: str = api_field(
        "gpu: the extended resource name of a GPU.",
        "nvidia.com/gpu",
        pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$",
        pattern_hint="be a resource name like nvidia.com/gpu",
        max_length=253,
    )
    gpu_type: Literal[GPU_TYPES] | None = api_field(  # type: ignore[valid-type]
        "gpuType: the GPU product, for the memory plan and MFU (e.g. H100-SXM-80GB). "
        "H100-80GB (SXM or PCIe board) plans with its 80 GB and the slower board's peak, "
        "stated as assumed; MFU then uses the CUDA device name. Unset skips the fit check, "
        "and MFU uses the CUDA device name.",
        None,
        fixes=RETIRED_GPU_TYPES,
    )
    cpu: IntOrString | None = api_field(
        "cpu request and limit of each pod (a quantity, e.g. 90).",
        None,
        pattern=QUANTITY_PATTERN,
        pattern_hint='be a Kubernetes quantity (e.g. 8, "500m")',
        max_length=32,
    )
    memory: IntOrString | None = api_field(
        "memory request and limit of each pod (a quantity, e.g. 1000Gi).",
        None,
        pattern=QUANTITY_PATTERN,
        pattern_hint='be a Kubernetes quantity (e.g. "64Gi")',
        max_length=32,
    )

    @property
    def on_gpu(self) -> bool:
        """The processes train on GPUs (CUDA, NCCL); gpusPerNode 0 trains on CPU (gloo)."""
        return self.gpus_per_node > 0

    @property
    def nproc_per_node(self) -> int:
        return self.gpus_per_node or self.processes_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


@dataclass(kw_only=True)
class ParallelismSpec:
    """parallelism: how FSDP shards the model states."""

    sharding: Literal["auto", "full", "hybrid", "grad-op", "none"] = api_field(
        "sharding: full shards parameters, gradients and optimizer states across all "
        "processes; hybrid shards within a node and replicates across nodes (less traffic "
        "between nodes); grad-op keeps parameters whole between forward and backward; none "
        "replicates (DDP-like; with adapters the frozen base is left whole, never gathered); "
        "auto picks the fastest of these whose memory fits in 90% of a GPU (CPU: of "
        "resources.memory, or the machine's, per process), as ftjob plan shows.",
        "auto",
    )
    cpu_offload: bool = api_field(
        "cpuOffload keeps parameters, gradients and optimizer states in CPU memory.", False
    )
    context_parallel: IntOrString = api_field(
        "contextParallel: how many processes of a node split each micro-batch's sequence "
        "(context parallelism: DeepSpeed-Ulysses' all-to-all over attention heads, for long "
        "sequences whose activations do not fit one GPU); sharding stays over every process. "
        "It must divide the processes per node and the model's attention heads; model."
        "attention sdpa and training.objective sft only. auto: 1 unless the job fits only "
        "with a split, then the smallest that fits, as ftjob plan shows (docs/long-context.md).",
        "1",
        pattern=CONTEXT_PARALLEL,
        pattern_hint='be a number of processes (1, 2, 4, 8) or "auto"',
        max_length=4,
    )

    def context_split(self) -> int | None:
        """contextParallel as a number of processes; None for auto (the planner decides)."""
        return None if self.context_parallel == "auto" else int(self.context_parallel)


@dataclass(kw_only=True)
class NetworkSpec:
    """network: the fabric between nodes and the NCCL settings for it."""

    fabric: Literal["efa", "infiniband", "tcp"] = api_field(
        "fabric: efa (AWS Elastic Fabric Adapter), infiniband (RDMA), or tcp.", "tcp"
    )
    efa_devices_per_node: int | None = api_field(
        "efaDevicesPerNode: vpc.amazonaws.com/efa devices per pod (p4d: 4, p5: 32); "
        "required with fabric efa.",
        None,
        minimum=1,
        maximum=64,
    )
    socket_interface: str | None = api_field(
        "socketInterface for NCCL's bootstrap traffic (NCCL_SOCKET_IFNAME), e.g. eth0.",
        None,
        min_length=1,
        max_length=64,
    )
    nccl_env: dict[str, str] = api_field(
        "ncclEnv: extra NCCL_*, FI_* or TORCH_NCCL_* variables, set on every pod.",
        factory=dict,
        key_pattern=r"^(NCCL|FI|TORCH_NCCL)_[A-Z0-9_]+$",
        key_hint="start with NCCL_, FI_ or TORCH_NCCL_",
        max_properties=64,
        max_length=1024,
    )
    collective_timeout_seconds: int = api_field(
        "collectiveTimeoutSeconds: a collective that waits this long fails the gang (shorter "
        "than runPolicy.stallTimeoutSeconds).",
        600,
        minimum=30,
    )
    rendezvous_port: int = api_field(
        "rendezvousPort of node 0 for torchrun.", 29500, minimum=1024, maximum=65535
    )
    progress_port: int = api_field(
        "progressPort on which rank 0 serves progress (JSON) and Prometheus metrics.",
        8000,
        minimum=1024,
        maximum=65535,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.progressPort != self.rendezvousPort",
            "progressPort must differ from rendezvousPort (both listen on node 0)",
            ".progressPort",
        ),
    )
