"""Checks before any weight is read: is this node, this fabric, this volume fit to train?

    FTJOB_JOB_DIR=/tmp/pf torchrun --standalone --nproc-per-node 2 -m ftjob.trainer \\
        --spec examples/tiny.yaml        # with spec.preflight.mode: on

A bad GPU, NCCL falling back to sockets or a volume that cannot be written would otherwise
show up an hour later as a slow or a failed job. Every rank runs :func:`run` right after
joining the process group (seconds):

* per GPU a timed bf16 matmul (TFLOP/s) and the share of its memory that is free;
* on each node's first rank a write, fsync and read-back of a file in the job folder;
* an all-reduce across the gang: its bus bandwidth (nccl-tests' busbw: algbw x 2(n-1)/n)
  and, on GPUs, the transport NCCL chose, read from NCCL's own INIT/NET log lines
  (:func:`nccl_log`, set up before the process group exists).

The figures of every rank are gathered, so every rank reaches the same conclusion: a failed
check raises :class:`ftjob.api.contract.TrainerError` on all ranks with the reason
(NodeUnhealthy, FabricMisconfigured, VolumeUnusable, or DiskFull for a full volume), the
node at fault, the numbers and a fix. The figures go to the log and rank 0's progress
snapshot (``preflight``), which the operator copies into the job's status.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftjob.api import contract
from ftjob.api.contract import (
    DISK_FULL,
    FABRIC_MISCONFIGURED,
    NODE_UNHEALTHY,
    VOLUME_UNUSABLE,
    TrainerError,
)
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.job.folder import JobFolder
from ftjob.trainer.state import volume

MATMUL_N = 8192  # an 8192^3 bf16 matmul: ~1.1 TFLOP, about a millisecond on an H100
MATMUL_REPEATS = 10
MATMUL_FLOOR_SHARE = 0.4  # of the GPU's dense bf16 peak, when minMatmulTflops is unset
VOLUME_BYTES = 8 << 20
ALL_REDUCE_BYTES = {"cuda": 256 << 20, "cpu": 8 << 20}  # large enough to reach busbw on GPUs
ALL_REDUCE_REPEATS = 5
# NCCL's INIT line naming the network plugin ("Using network IB", "... Socket", "... AWS
# Libfabric") and aws-ofi-nccl's provider line ("Selected Provider is efa").
_NETWORK = re.compile(r"NCCL INFO Using network (\S.*?)\s*$", re.M)
_PROVIDER = re.compile(r"Selected [Pp]rovider is (\w+)")
EXPECTED_TRANSPORT = {"efa": "efa", "infiniband": "ib"}
FABRIC_FIX = {
    "efa": "check that the nodes have EFA (vpc.amazonaws.com/efa allocatable), that the image "
    "has the aws-ofi-nccl plugin and libfabric, that the node's container runtime gives "
    "containers an unlimited memlock limit (ulimit -l: unlimited), and network.ncclEnv "
    "(FI_PROVIDER=efa)",
    "infiniband": "check that the pods see the RDMA devices (the RDMA device plugin), that "
    "the node's container runtime gives containers an unlimited memlock limit (ulimit -l: "
    "unlimited), and network.ncclEnv (NCCL_IB_HCA, NCCL_SOCKET_IFNAME)",
    "tcp": "check the nodes' network, or lower spec.preflight.minBusBandwidthGBps",
}


def enabled(spec: FineTuneJobSpec) -> bool:
    return spec.preflight.enabled(spec.resources.on_gpu)


def nccl_log(spec: FineTuneJobSpec, job_dir: Path, rank: int) -> Path | None:
    """Before the process group exists: have NCCL write its INIT and NET lines to a file of
    this rank's, from which :func:`transport` reads what it chose. None when NCCL is not
    used, the preflight is off, or the job already sends NCCL's log somewhere
    (NCCL_DEBUG_FILE in network.ncclEnv). NCCL's warnings then go to that file too."""
    if not enabled(spec) or not spec.resources.on_gpu:
        return None
    if os.environ.get("NCCL_DEBUG_FILE"):
        return None
    path = JobFolder(job_dir).nccl_logs / f"{own_name(contract.node_name(), rank)}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # the volume check says why, with its numbers
    os.environ |= {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": str(path),
    }
    return path


def own_name(node: str, rank: int) -> str:
    """A file name of this process's own. The preflight writes before the run owns the job
    folder: a second run (or the next attempt, in a fresh container whose pids start over)
    must not truncate, read back or remove this one's file. Hence a random part."""
    return f"{node}-rank{rank}-{os.getpid()}-{secrets.token_hex(4)}"


def transport(lines: str) -> str | None:
    """The transport NCCL's log names: efa, ib, socket or the plugin's name; None if none."""
    provider = _PROVIDER.search(lines)
    found = _NETWORK.findall(lines)
    if not found:
        return provider.group(1).lower() if provider else None
    net = found[-1].strip()
    if "Socket" in net:
        return "socket"
    if net.startswith("IB"):
        return "ib"
    if "Libfabric" in net or "OFI" in net:
        return provider.group(1).lower() if provider else "libfabric"
    return net.lower()


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' busbw of an all-reduce, GB/s: algbw x 2(n-1)/n."""
    return nbytes / seconds * 2 * (world - 1) / world / 1e9


def check_volume(job_dir: Path, node: str, rank: int) -> dict[str, Any]:
    """Write, fsync, read back and remove a file in the job folder; MB/s of the write."""
    folder = JobFolder(job_dir).preflight
    path = folder / own_name(node, rank)
    data = os.urandom(VOLUME_BYTES)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - began
        same = path.read_bytes() == data
        path.unlink()
    except OSError as e:
        # volume's rule (an OSError is always named): ENOSPC/EDQUOT, or less room left than
        # the write needed, is DiskFull.
        named = volume.write_failed(
            e,
            f"preflight: node {node} cannot write and read back {path} on the job's volume",
            job_dir,
            VOLUME_UNUSABLE,
            needed=VOLUME_BYTES,
        )
        with contextlib.suppress(OSError):
            path.unlink()  # after write_failed looked at the room left
        full = named.reason == DISK_FULL
        raise TrainerError(
            str(named),
            reason=named.reason,
            where=named.where,
            node=node,
            fix="free space on the volume, or lower checkpoint.keep"
            if full
            else "check the claim in checkpoint.volume (bound, ReadWriteMany for several nodes, "
            "writable by uid 1000 / fsGroup) and the volume's mount on this node",
        ) from e
    if not same:
        raise TrainerError(
            f"preflight: node {node} read back different bytes than it wrote to {path}",
            reason=VOLUME_UNUSABLE,
            where=str(job_dir),
            node=node,
            fix="the volume corrupts data on this node: check its mount and the storage",
        )
    return {"volumeWriteMBps": round(VOLUME_BYTES / seconds / 1e6, 1)}


def check_gpu(spec: FineTuneJobSpec, device: torch.device, node: str) -> dict[str, Any]:
    """Free memory and a timed bf16 matmul on this process's GPU (nothing on CPU)."""
    if device.type != "cuda":
        return {}
    p = spec.preflight
    gpu = f"GPU {device.index} ({torch.cuda.get_device_name(device)}) of node {node}"
    fix = "the node is kept away from the next gang; see docs/operator.md (bad nodes)"
    try:
        free, total = torch.cuda.mem_get_info(device)
        a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
        b = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
        torch.matmul(a, b)  # the first call picks a kernel
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(MATMUL_REPEATS):
            torch.matmul(a, b)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        del a, b
    except RuntimeError as e:  # an ECC error, a GPU fallen off the bus
        raise TrainerError(f"preflight: {gpu} failed a matmul: {e}", reason=NODE_UNHEALTHY,
                           node=node, fix=fix) from e  # fmt: skip
    tflops = 2 * MATMUL_N**3 * MATMUL_REPEATS / seconds / 1e12
    share = free / total
    if share < p.min_free_memory_fraction:
        raise TrainerError(
            f"preflight: {gpu} has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free "
            f"({share:.0%}; preflight.minFreeMemoryFraction {p.min_free_memory_fraction:.0%}): "
            "another process holds it",
            reason=NODE_UNHEALTHY,
            node=node,
            fix=fix,
        )
    floor = matmul_floor(spec, torch.cuda.get_device_name(device))
    if floor is not None and tflops < floor:
        raise TrainerError(
            f"preflight: {gpu} ran a bf16 matmul at {tflops:.0f} TFLOP/s, under the floor of "
            f"{floor:.0f} (preflight.minMatmulTflops): a throttled or faulty GPU",
            reason=NODE_UNHEALTHY,
            node=node,
            fix=fix,
        )
    return {"matmulTflops": round(tflops, 1), "freeMemoryFraction": round(share, 3)}


def matmul_floor(spec: FineTuneJobSpec, device_name: str | None) -> float | None:
    """TFLOP/s a healthy GPU reaches at least: the spec's, else a share of its peak."""
    if spec.preflight.min_matmul_tflops is not None:
        return spec.preflight.min_matmul_tflops
    from ftjob.trainer.report.progress import peak_flops

    peak = peak_flops(device_name, spec.resources.gpu_type)
    return MATMUL_FLOOR_SHARE * peak / 1e12 if peak else None


def time_all_reduce(device: torch.device, budget: float) -> tuple[int, float, float]:
    """(bytes, seconds of one all-reduce, seconds of the first), the slowest rank's, within
    ``budget`` seconds."""
    nbytes = ALL_REDUCE_BYTES["cuda" if device.type == "cuda" else "cpu"]
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def once() -> float:
        dist.barrier()
        began = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - began

    # Connections are set up in the first, which is not measured. Every rank must run as
    # many collectives as the others, so the count comes from the slowest rank's first (one
    # all-reduce more), not from each rank's own timing of it.
    first = _slowest(once(), device)
    repeats = repeats_for(first, budget)
    took = sorted(once() for _ in range(repeats))[repeats // 2]  # the median
    return nbytes, _slowest(took, device), first


def repeats_for(first: float, budget: float) -> int:
    """How many timed all-reduces follow the first (which took ``first`` seconds on the
    slowest rank): as many as half the budget allows, at most ALL_REDUCE_REPEATS. PURE; the
    same on every rank only when ``first`` is (agreed across the gang)."""
    return max(1, min(ALL_REDUCE_REPEATS, int(budget / 2 / max(first, 1e-6))))


def _slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0])


def run(spec: FineTuneJobSpec, d, job_dir: Path, log=print, nccl_file: Path | None = None):
    """Every check on every rank; the gang's figures, or TrainerError on every rank."""
    began = time.perf_counter()
    node, p = contract.node_name(), spec.preflight
    mine: dict[str, Any] = {"node": node, "rank": d.rank}
    problem = None
    try:
        mine |= check_gpu(spec, d.device, node)
        if d.local_rank == 0:
            mine |= check_volume(job_dir, node, d.rank)
    except TrainerError as e:
        problem = (str(e), e.reason, e.where, e.fix, e.node)
    ranks: list[Any] = [None] * d.world_size
    dist.all_gather_object(ranks, (mine, problem))
    problems = [pr for _, pr in ranks if pr is not None]
    if problems:
        message, reason, where, fix, at = min(problems, key=lambda x: contract.rank_of(x[1]))
        raise TrainerError(message, reason=reason, where=where, fix=fix, node=at)

    figures = summary([m for m, _ in ranks])
    if d.world_size > 1:
        nbytes, seconds, first = time_all_reduce(d.device, p.timeout_seconds)
        figures["busBandwidthGBps"] = round(bus_bandwidth(nbytes, seconds, d.world_size), 3)
        figures["allReduceMiB"] = nbytes >> 20
        if first > p.timeout_seconds:
            _fabric(spec, f"one all-reduce of {nbytes >> 20} MiB over {d.world_size} ranks took "
                    f"{first:.1f} s (preflight.timeoutSeconds {p.timeout_seconds})")  # fmt: skip
    # After the all-reduce: NCCL has set up its network by then, and logged which.
    chosen: list[Any] = [None] * d.world_size
    dist.all_gather_object(chosen, (node, _transport(d.device, nccl_file)))
    figures["transport"] = _one(t for _, t in chosen)
    for at, t in chosen:
        figures["nodes"][at]["transport"] = t
    _judge(spec, figures, d.world_size, chosen)
    figures["seconds"] = round(time.perf_counter() - began, 2)
    log("preflight: " + describe(figures))
    if d.device.type == "cuda":
        # The checks' buffers are not the job's: free them and measure peaks from here.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d.device)
    return figures


def summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The gang's figures: the worst of each, and each node's own."""
    nodes: dict[str, dict[str, Any]] = {}
    for m in ranks:
        entry = nodes.setdefault(m["node"], {})
        for key in ("matmulTflops", "freeMemoryFraction"):
            if key in m:
                entry.setdefault(key, []).append(m[key])
        if "volumeWriteMBps" in m:
            entry["volumeWriteMBps"] = m["volumeWriteMBps"]

    def worst(key):
        values = [v for e in nodes.values() for v in (e.get(key) or [])]
        return min(values) if values else None

    writes = [e["volumeWriteMBps"] for e in nodes.values() if "volumeWriteMBps" in e]
    out = {
        "matmulTflops": worst("matmulTflops"),
        "volumeWriteMBps": min(writes) if writes else None,
        "nodes": nodes,
    }
    if out["matmulTflops"] is None:
        out["note"] = "no GPU: the matmul and memory checks were skipped"
    return out


def _transport(device: torch.device, nccl_file: Path | None) -> str | None:
    if device.type != "cuda":
        return "gloo"
    if nccl_file is None or not nccl_file.is_file():
        return None  # NCCL logs elsewhere (the job set NCCL_DEBUG_FILE)
    return transport(nccl_file.read_text(errors="replace"))


def _one(values) -> str | None:
    """One name for the gang's transports: the name, or several joined by '+'."""
    names = sorted({v for v in values if v})
    return "+".join(names) if names else None


def _judge(spec: FineTuneJobSpec, figures: dict[str, Any], world: int, chosen: list) -> None:
    nodes, fabric = spec.resources.nodes, spec.network.fabric
    expected = EXPECTED_TRANSPORT.get(fabric)
    # Within one node NCCL uses NVLink or shared memory, whatever network it loaded.
    wrong = sorted({(n, t) for n, t in chosen if t is not None and t != expected})
    if nodes > 1 and expected and wrong:
        on = ", ".join(f"{t} on {n}" for n, t in wrong)
        at = {n for n, _ in wrong}  # one node off the fabric is the one at fault
        _fabric(spec, f"network.fabric is {fabric} but NCCL chose {on} between the nodes",
                node=at.pop() if len(at) == 1 else None)  # fmt: skip
    chosen = figures.get("transport")
    floor = spec.preflight.bus_floor(fabric, nodes)
    measured = figures.get("busBandwidthGBps")
    if floor is not None and measured is not None and measured < floor:
        _fabric(
            spec,
            f"the all-reduce across {world} ranks on {nodes} node(s) "
            f"({', '.join(figures['nodes'])}) reached a bus bandwidth of {measured:.3g} GB/s, "
            f"under the floor of {floor:g} GB/s "
            f"(preflight.minBusBandwidthGBps; transport {chosen or 'unknown'})",
        )


def _fabric(spec: FineTuneJobSpec, what: str, node: str | None = None) -> None:
    raise TrainerError(
        f"preflight: {what}",
        reason=FABRIC_MISCONFIGURED,
        where="spec.network.fabric",
        fix=FABRIC_FIX[spec.network.fabric],
        node=node,
    )


def describe(f: dict[str, Any]) -> str:
    parts = []
    if f.get("busBandwidthGBps") is not None:
        parts.append(f"all-reduce bus bandwidth {f['busBandwidthGBps']:.3g} GB/s "
                     f"({f['allReduceMiB']} MiB)")  # fmt: skip
    parts.append(f"transport {f.get('transport') or 'unknown'}")
    if f.get("matmulTflops") is not None:
        parts.append(f"slowest GPU matmul {f['matmulTflops']:.0f} TFLOP/s")
    if f.get("volumeWriteMBps") is not None:
        parts.append(f"volume write {f['volumeWriteMBps']:.0f} MB/s")
    if f.get("note"):
        parts.append(f["note"])
    return "; ".join(parts) + (f" ({f['seconds']} s)" if "seconds" in f else "")
