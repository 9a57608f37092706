"""What ftjob knows about accelerators and fabrics: memory, peak FLOP/s, bandwidth.

Peak numbers are the vendors' dense bf16 tensor-core figures (no sparsity); MFU and the planner's
step-time estimates divide by them. Bandwidth is per node and one direction.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
GB = 10**9


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    peak_bf16_flops: float


GPUS = {
    g.name: g
    for g in [
        Gpu("A10G-24GB", 24 * GIB, 70e12),
        Gpu("L4-24GB", 24 * GIB, 121e12),
        Gpu("RTX4090-24GB", 24 * GIB, 165e12),
        Gpu("A100-40GB", 40 * GIB, 312e12),
        Gpu("A100-80GB", 80 * GIB, 312e12),
        Gpu("L40S-48GB", 48 * GIB, 362e12),
        Gpu("H100-80GB", 80 * GIB, 989e12),
        Gpu("H200-141GB", 141 * GIB, 989e12),
        Gpu("B200-180GB", 180 * GIB, 2250e12),
    ]
}

# Substrings of torch.cuda.get_device_name() -> table entry, most specific first.
_DEVICE_NAMES = [
    ("H200", "H200-141GB"),
    ("H100", "H100-80GB"),
    ("B200", "B200-180GB"),
    ("A100-SXM4-40GB", "A100-40GB"),
    ("A100-PCIE-40GB", "A100-40GB"),
    ("A100", "A100-80GB"),
    ("L40S", "L40S-48GB"),
    ("L4", "L4-24GB"),
    ("A10G", "A10G-24GB"),
    ("4090", "RTX4090-24GB"),
]


def gpu_for_device_name(device_name: str) -> Gpu | None:
    """The table entry for a CUDA device name, or None for an unknown device."""
    for needle, name in _DEVICE_NAMES:
        if needle in device_name:
            return GPUS[name]
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
