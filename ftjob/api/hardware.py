"""What ftjob knows about accelerators and fabrics: memory, peak FLOP/s, bandwidth.

Peak numbers are the vendors' dense bf16 tensor-core figures (no sparsity; for the RTX 4090,
bf16 with fp32 accumulate); MFU and the planner's step-time estimates divide by them. Each
entry is one product, except ``H100-80GB``: its memory is certain (80 GB on the SXM and PCIe
boards alike), only its peak is not (the boards differ by 30%), so the trainer takes the peak
from the CUDA device's own name, and the plan assumes the slower board's and says so.
Bandwidth is per node and one direction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 2**30
GB = 10**9


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    peak_bf16_flops: float
    # True: the name covers boards of different peaks; peak_bf16_flops is the slowest one's,
    # assumed by the plan; the trainer's MFU uses the device's own name (gpu_for_device_name).
    peak_assumed: bool = False
    peak_fp8_flops: float | None = None  # dense float8, fp32 accumulate; None: no float8 cores


# The vendors' float8 figures are quoted with 2:4 sparsity; the dense rate is half of it.
# Sources: NVIDIA L4 datasheet (FP8 485 TFLOPS sparse), L40S datasheet (1,466 sparse), Ada
# whitepaper (RTX 4090: FP8 with FP32 accumulate 660.6 sparse), H100 datasheet (SXM 3,958,
# PCIe 3,026, NVL 3,341 sparse), H200 datasheet (3,958 sparse), DGX B200 datasheet (72 PFLOPS
# FP8 training for 8 GPUs, sparse: 9,000 per GPU).
def _fp8(sparse_tflops: float) -> float:
    return sparse_tflops / 2 * 1e12


GPUS = {
    g.name: g
    for g in [
        # NVIDIA publishes no datasheet for the A10G (an AWS part); third-party tables
        # disagree (70 and 125 TFLOP/s). The lower figure is kept until measured.
        Gpu("A10G-24GB", 24 * GIB, 70e12),
        Gpu("L4-24GB", 24 * GIB, 121e12, peak_fp8_flops=_fp8(485)),
        Gpu("RTX4090-24GB", 24 * GIB, 165e12, peak_fp8_flops=_fp8(660.6)),
        Gpu("A100-40GB", 40 * GIB, 312e12),
        Gpu("A100-80GB", 80 * GIB, 312e12),
        Gpu("L40S-48GB", 48 * GIB, 362e12, peak_fp8_flops=_fp8(1466)),
        Gpu("H100-PCIe-80GB", 80 * GIB, 756e12, peak_fp8_flops=_fp8(3026)),
        Gpu("H100-NVL-94GB", 94 * GIB, 835e12, peak_fp8_flops=_fp8(3341)),
        Gpu("H100-SXM-80GB", 80 * GIB, 989e12, peak_fp8_flops=_fp8(3958)),
        # SXM or PCIe: see above (both peaks the slower board's)
        Gpu("H100-80GB", 80 * GIB, 756e12, peak_assumed=True, peak_fp8_flops=_fp8(3026)),
        Gpu("H200-141GB", 141 * GIB, 989e12, peak_fp8_flops=_fp8(3958)),
        Gpu("B200-180GB", 180 * GIB, 2250e12, peak_fp8_flops=_fp8(9000)),
    ]
}

# The boards with float8 tensor cores: training.precision fp8 is refused on the others.
FP8_GPU_TYPES = tuple(name for name, g in GPUS.items() if g.peak_fp8_flops)
# torchao's float8 matmuls (torch._scaled_mm) need this CUDA capability or newer (Ada).
FP8_MIN_CAPABILITY = (8, 9)

# Names the table once had, and why they are gone (resources.gpuType's error says so).
RETIRED_GPU_TYPES: dict[str, str] = {}

# torch.cuda.get_device_name() -> table entry, first match wins. Word boundaries keep GH200
# and GB200 (other products) from matching H200 and B200; a variant the table has no entry
# for (H200 NVL, L40, RTX 4090 D, A10) matches nothing, so no wrong peak is used.
_DEVICE_NAMES = [
    (r"\bH100\b.*\bNVL\b", "H100-NVL-94GB"),
    (r"\bH100\b.*\bPCIe\b", "H100-PCIe-80GB"),
    (r"\bH100\b.*\b(HBM3|SXM)", "H100-SXM-80GB"),  # "NVIDIA H100 80GB HBM3"
    (r"\bH200\b(?!.*\bNVL\b)", "H200-141GB"),
    (r"\bB200\b", "B200-180GB"),
    (r"\bA100\b.*\b40GB\b", "A100-40GB"),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
    (r"\bA100\b.*\b80GB\b", "A100-80GB"),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
    (r"\bL40S\b", "L40S-48GB"),
    (r"\bL4$", "L4-24GB"),
    (r"\bA10G$", "A10G-24GB"),
    (r"\bRTX 4090$", "RTX4090-24GB"),
]


def gpu_for_device_name(device_name: str) -> Gpu | None:
    """The table entry for a CUDA device name, or None for a device the table lacks."""
    name = device_name.strip()
    for pattern, entry in _DEVICE_NAMES:
        if re.search(pattern, name, re.IGNORECASE):
            return GPUS[entry]
    return None


# Per-node bandwidth between nodes, bytes/s, one direction.
EFA_DEVICE_BYTES_PER_S = 100e9 / 8  # 100 Gbit/s per EFA interface (p4d: 4, p5: 32)
INFINIBAND_PER_GPU_BYTES_PER_S = 200e9 / 8  # HDR, one HCA per GPU
TCP_BYTES_PER_S = 25e9 / 8  # a typical 25 GbE node


def node_bandwidth(fabric: str, gpus_per_node: int, efa_devices: int | None) -> float:
    if fabric == "efa":
        return EFA_DEVICE_BYTES_PER_S * (efa_devices or 1)
    if fabric == "infiniband":
        return INFINIBAND_PER_GPU_BYTES_PER_S * max(gpus_per_node, 1)
    return TCP_BYTES_PER_S


# Within a node, per process and one direction: what a collective between the node's own
# processes moves. The planner compares layouts by it (ftjob.plan.traffic), so it matters
# mostly as a ratio to the fabric above and to the collective's fixed cost below.
# NVLink: 4th generation (H100 SXM, H200) gives each GPU 900 GB/s both directions together
# (NVIDIA's H100 datasheet); A100's 3rd generation 600 GB/s. NCCL's all-gather reaches ~80%
# of it in nccl-tests: the lower generation's one direction is kept for every NVLink board.
NVLINK_BYTES_PER_S = 300e9
# Boards without NVLink (L4, A10G, L40S, RTX 4090, H100 PCIe) talk over PCIe 4.0 x16:
# 32 GB/s one direction on paper, ~25 in practice.
PCIE_BYTES_PER_S = 25e9
_NVLINK_BOARDS = ("A100-40GB", "A100-80GB", "H100-SXM-80GB", "H100-NVL-94GB", "H200-141GB",
                  "B200-180GB")  # fmt: skip
# CPU processes (gloo over loopback TCP): measured on the project's 2-core machine, two
# processes, a CI run sharing it: an all-reduce of 4 and 64 MiB at 0.52 and 0.60 GB/s, an
# all-gather of the same at 0.70 and 0.35 GB/s of output (bench/RESULTS.md, 2026-11-27,
# "sharding auto"). 0.5 GB/s is kept.
GLOO_BYTES_PER_S = 0.5e9
# The fixed cost of one collective, whatever its size: gloo measured with a 4-byte all-reduce
# in the same run (0.4-0.9 ms); NCCL's small-message latency within a node is ~10-20 us in
# nccl-tests, across nodes 2-3x that: 30 us for both (an assumption, not measured here).
GLOO_COLLECTIVE_SECONDS = 0.5e-3
NCCL_COLLECTIVE_SECONDS = 30e-6


def intra_node_bandwidth(gpu_type: str | None, gpus_per_node: int) -> float:
    """Bytes/s one process sends to the others of its node: gloo for CPU processes, NVLink or
    PCIe for GPUs (an unknown gpuType: PCIe, the slower)."""
    if gpus_per_node == 0:
        return GLOO_BYTES_PER_S
    return NVLINK_BYTES_PER_S if gpu_type in _NVLINK_BOARDS else PCIE_BYTES_PER_S


def collective_seconds(gpus_per_node: int) -> float:
    """The fixed cost of one collective: gloo's on CPU, NCCL's on GPUs."""
    return NCCL_COLLECTIVE_SECONDS if gpus_per_node else GLOO_COLLECTIVE_SECONDS
