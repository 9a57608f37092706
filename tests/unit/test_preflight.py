"""The preflight's pure parts and its volume check (one process; the gang's all-reduce runs
with 2 real processes in tests/e2e/test_preflight_gang.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftjob import contract, manifest
from ftjob.spec import parse_resource
from ftjob.trainer import preflight, termination


def spec(**preflight_spec):
    doc = manifest.load(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")[0]
    doc["spec"]["preflight"] = preflight_spec
    return parse_resource(doc)[1]


def test_bus_bandwidth_is_nccl_tests_busbw():
    # nccl-tests (doc/PERFORMANCE.md): all-reduce busbw = algbw * 2(n-1)/n.
    assert preflight.bus_bandwidth(10**9, 1.0, 2) == pytest.approx(1.0)
    assert preflight.bus_bandwidth(10**9, 1.0, 8) == pytest.approx(1.75)
    assert preflight.bus_bandwidth(10**9, 0.5, 16) == pytest.approx(2 * 2 * 15 / 16)


@pytest.mark.parametrize(
    "lines, chosen",
    [
        ("host:1:1 [0] NCCL INFO Using network IB\n", "ib"),
        ("host:1:1 [0] NCCL INFO Using network Socket\n", "socket"),
        ("NCCL INFO NET/OFI Selected provider is efa\nNCCL INFO Using network Libfabric\n", "efa"),
        (
            "NCCL INFO NET/OFI Selected provider is tcp\nNCCL INFO Using network AWS Libfabric\n",
            "tcp",
        ),  # fmt: skip
        ("NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>\n", None),
        ("NCCL INFO Using non-device net plugin version 0\nNCCL INFO Using network IB\n", "ib"),
    ],
)
def test_the_transport_is_read_from_nccl_s_init_lines(lines, chosen):
    # The INIT line is NCCL's own: INFO(NCCL_INIT, "Using network %s", ...) in src/init.cc.
    assert preflight.transport(lines) == chosen


def test_mode_auto_is_on_for_gpu_jobs_only_and_the_floor_follows_the_fabric():
    assert not spec().preflight.enabled(0) and spec().preflight.enabled(8)
    assert spec(mode="on").preflight.enabled(0) and not spec(mode="off").preflight.enabled(8)
    p = spec().preflight
    assert p.bus_floor("efa", 2) == 10 and p.bus_floor("efa", 1) is None
    assert p.bus_floor("tcp", 4) is None
    assert spec(minBusBandwidthGBps=3).preflight.bus_floor("tcp", 1) == 3


def test_a_volume_that_cannot_be_written_is_volume_unusable_naming_the_node(tmp_path, monkeypatch):
    monkeypatch.setenv(contract.NODE_NAME_ENV, "gpu-node-7")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(contract.TrainerError) as e:
        preflight.check_volume(blocker / "job", contract.node_name(), 3)
    assert e.value.reason == contract.VOLUME_UNUSABLE and e.value.node == "gpu-node-7"
    assert "node gpu-node-7 cannot write and read back" in str(e.value)
    assert "checkpoint.volume" in e.value.fix
    record = termination.failure(e.value)
    assert record["node"] == "gpu-node-7" and record["reason"] == contract.VOLUME_UNUSABLE


def test_a_writable_volume_measures_its_write_and_leaves_nothing(tmp_path):
    figures = preflight.check_volume(tmp_path, "n", 0)
    assert figures["volumeWriteMBps"] > 0
    assert list((tmp_path / ".preflight").iterdir()) == []


def test_the_node_at_fault_is_named_in_every_rank_s_record(monkeypatch):
    """A rank whose check passed fails too (the gang cannot train without the bad node), and
    its record names the node at fault, not its own."""
    monkeypatch.setenv(contract.NODE_NAME_ENV, "healthy-node")
    error = contract.TrainerError("GPU 3 of bad-node ...", reason=contract.NODE_UNHEALTHY,
                                  node="bad-node")  # fmt: skip
    assert termination.failure(error)["node"] == "bad-node"
    plain = contract.TrainerError("x", reason=contract.BAD_DATA)
    assert termination.failure(plain)["node"] == "healthy-node"
