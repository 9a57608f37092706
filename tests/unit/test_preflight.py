"""The preflight's pure parts, its volume check, and the count of its timed all-reduces in a
real 2-process gloo group (the whole preflight of a gang: tests/e2e/test_preflight_gang.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import hangs
import pytest
import torch

from ftjob.api import contract, manifest
from ftjob.api.jobspec import parse_resource
from ftjob.trainer.gang import preflight, termination


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
    assert not spec().preflight.enabled(False) and spec().preflight.enabled(True)
    assert spec(mode="on").preflight.enabled(False) and not spec(mode="off").preflight.enabled(True)
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


def test_a_full_volume_is_disk_full_naming_the_node_and_leaves_nothing(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(preflight.os, "fsync", full)
    with pytest.raises(contract.TrainerError) as e:
        preflight.check_volume(tmp_path, "gpu-node-2", 0)
    assert e.value.reason == contract.DISK_FULL and e.value.node == "gpu-node-2"
    assert "node gpu-node-2 cannot write and read back" in str(e.value)
    assert "free space" in e.value.fix
    assert list((tmp_path / ".preflight").iterdir()) == []  # the partial file is removed


def test_a_write_error_with_no_room_left_is_disk_full_as_the_trainer_s_own_writes(
    tmp_path, monkeypatch
):
    """volume.write_failed's rule, not one of the preflight's own: an errno other than ENOSPC
    with less room left than the write needed is DiskFull; with room left, VolumeUnusable."""

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(preflight.os, "fsync", eio)
    with pytest.raises(contract.TrainerError) as e:
        preflight.check_volume(tmp_path, "n", 0)
    assert e.value.reason == contract.VOLUME_UNUSABLE and "Input/output error" in str(e.value)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(contract.TrainerError) as e:
        preflight.check_volume(tmp_path, "n", 0)
    assert e.value.reason == contract.DISK_FULL and "free space" in e.value.fix


def test_two_runs_checking_one_volume_at_once_use_files_of_their_own(tmp_path, monkeypatch):
    """The check runs before the run owns the folder: the same node and rank of two runs must
    not write one file (the winner would read the other's bytes back)."""
    written = []
    real_open = open

    def spy(path, *args, **kwargs):
        written.append(Path(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    preflight.check_volume(tmp_path, "n", 0)
    preflight.check_volume(tmp_path, "n", 0)
    assert len(written) == 2 and written[0] != written[1]


def test_nccl_s_log_is_a_file_of_this_process_s_own(tmp_path, monkeypatch):
    doc = manifest.load(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")[0]
    doc["spec"]["resources"]["gpusPerNode"] = 8
    paths = []
    for _ in range(2):  # two attempts on one node
        for name in ("NCCL_DEBUG_FILE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"):
            monkeypatch.delenv(name, raising=False)
        paths.append(preflight.nccl_log(parse_resource(doc)[1], tmp_path, 3))
        assert os.environ["NCCL_DEBUG_FILE"] == str(paths[-1])
    assert all(p.parent == tmp_path / "logs" / "nccl" for p in paths)
    assert paths[0].name.startswith(f"{contract.node_name()}-rank3-{os.getpid()}-")
    assert paths[0] != paths[1]


def test_the_repeats_follow_the_slowest_rank_s_first_all_reduce():
    # The count every rank runs: from the agreed (slowest) first all-reduce, so a rank whose
    # own first was quick runs no more collectives than a slow one.
    assert preflight.repeats_for(0.001, 60) == preflight.ALL_REDUCE_REPEATS
    assert preflight.repeats_for(12.0, 60) == 2
    assert preflight.repeats_for(40.0, 60) == 1


def _time_all_reduce(rank: int, store_path: str, out: str) -> None:
    """One rank of a 2-rank gloo gang whose rank 1 takes 0.6 s longer in its first
    all-reduce: left to its own timing, rank 0 would run 5 repeats and rank 1 only one."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=hangs.FLOOR))  # fmt: skip
    if rank == 1:
        real, calls = dist.all_reduce, [0]

        def slow_first(*args, **kwargs):
            calls[0] += 1
            result = real(*args, **kwargs)
            if calls[0] == 1:
                time.sleep(0.6)
            return result

        dist.all_reduce = slow_first
    result = preflight.time_all_reduce(torch.device("cpu"), budget=2.0)
    Path(f"{out}-{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_every_rank_runs_as_many_all_reduces_whatever_its_own_timing(tmp_path):
    """Ranks either side of the repeats' boundary would match one rank's barrier against
    another's all-reduce and hang; agreed on the slowest first, both finish alike."""
    torch.multiprocessing.spawn(_time_all_reduce, args=(str(tmp_path / "store"),
                                str(tmp_path / "out")), nprocs=2, join=True)  # fmt: skip
    results = [json.loads((tmp_path / f"out-{r}").read_text()) for r in (0, 1)]
    assert results[0] == results[1] and results[0][2] > 0.6  # the slowest first, on both


def test_a_node_whose_nccl_fell_back_to_sockets_is_named_fabric_misconfigured():
    doc = manifest.load(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")[0]
    doc["spec"]["resources"] |= {"nodes": 2, "gpusPerNode": 8}
    doc["spec"]["network"] = {"fabric": "efa", "efaDevicesPerNode": 32}
    efa = parse_resource(doc)[1]
    chosen = [("node-a", "efa"), ("node-b", "socket")]
    figures = {"transport": "efa+socket", "nodes": {"node-a": {}, "node-b": {}}}
    with pytest.raises(contract.TrainerError) as e:
        preflight._judge(efa, figures, 2, chosen)
    assert e.value.reason == contract.FABRIC_MISCONFIGURED and e.value.node == "node-b"
    assert "NCCL chose socket on node-b" in str(e.value)
    assert "aws-ofi-nccl" in e.value.fix
    preflight._judge(efa, figures, 2, [("node-a", "efa"), ("node-b", "efa")])  # both right
    with pytest.raises(contract.TrainerError) as e:  # both off the fabric: no one node at fault
        preflight._judge(efa, figures, 2, [("node-a", "socket"), ("node-b", "socket")])
    assert e.value.reason == contract.FABRIC_MISCONFIGURED and e.value.node is None


def test_the_bus_bandwidth_verdict_is_against_the_fabric_s_floor():
    doc = manifest.load(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")[0]
    doc["spec"]["resources"] |= {"nodes": 2, "gpusPerNode": 8}
    doc["spec"]["network"] = {"fabric": "efa", "efaDevicesPerNode": 32}
    efa = parse_resource(doc)[1]
    chosen = [("a", "efa"), ("b", "efa")]
    slow = {"transport": "efa", "busBandwidthGBps": 1.2, "nodes": {"a": {}, "b": {}}}
    with pytest.raises(contract.TrainerError) as e:
        preflight._judge(efa, slow, 16, chosen)
    assert e.value.reason == contract.FABRIC_MISCONFIGURED
    assert "bus bandwidth of 1.2 GB/s, under the floor of 10 GB/s" in str(e.value)
    assert "(a, b)" in str(e.value) and "transport efa" in str(e.value)
    preflight._judge(efa, slow | {"busBandwidthGBps": 10.5}, 16, chosen)
    # One node: NVLink or shared memory inside it, whatever network NCCL loaded; no floor.
    doc["spec"]["resources"]["nodes"] = 1
    preflight._judge(parse_resource(doc)[1], slow, 8, [("a", "socket")])
