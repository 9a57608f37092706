"""The accelerator table: one entry per exact product, found from the CUDA device name."""

import pytest

from ftjob.api.hardware import GIB, GPUS, gpu_for_device_name


@pytest.mark.parametrize(
    "device_name, entry",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIe-80GB"),
        ("NVIDIA H100 NVL", "H100-NVL-94GB"),
        ("NVIDIA H200", "H200-141GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA L4", "L4-24GB"),
        ("NVIDIA L40S", "L40S-48GB"),
        ("NVIDIA GeForce RTX 4090", "RTX4090-24GB"),
        ("NVIDIA B200", "B200-180GB"),
        ("NVIDIA A10G", "A10G-24GB"),
    ],
)
def test_each_device_name_maps_to_its_exact_product(device_name, entry):
    assert gpu_for_device_name(device_name) is GPUS[entry]


@pytest.mark.parametrize(
    "device_name",
    # Other products whose names contain a table entry's: a wrong peak would misstate MFU.
    [
        "NVIDIA GH200 480GB",
        "NVIDIA GB200",
        "NVIDIA H200 NVL",
        "NVIDIA L40",
        "NVIDIA A10",
        "NVIDIA GeForce RTX 4090 D",
        "Tesla V100-SXM2-16GB",
        "NVIDIA H100",
    ],
)
def test_a_product_the_table_lacks_gets_no_peak(device_name):
    assert gpu_for_device_name(device_name) is None


def test_the_h100_boards_have_their_own_peaks():
    peaks = {name: GPUS[name].peak_bf16_flops / 1e12 for name in GPUS if name.startswith("H1")}
    assert peaks == {
        "H100-SXM-80GB": 989, "H100-PCIe-80GB": 756, "H100-NVL-94GB": 835, "H100-80GB": 756
    }  # fmt: skip
    assert [name for name in GPUS if GPUS[name].peak_assumed] == ["H100-80GB"]
    assert GPUS["H100-NVL-94GB"].memory_bytes == 94 * GIB
