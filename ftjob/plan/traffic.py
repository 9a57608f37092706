"""What each sharding layout sends per optimizer step, and how long that takes: the part of
the step time that differs between layouts (their compute is the same). Pure.

FSDP2 as ftjob's trainer uses it (trainer/model/parallel.py): one unit per decoder layer and
one for the root (embeddings, final norm, head), which is never resharded after forward.
Per micro-batch, ``full`` gathers each layer for forward and again for backward (DPO with
adapters: once more for the reference forward), ``grad-op`` once (the layers stay gathered
until backward, so the reference forward shares the policy's gather), and both
reduce-scatter the trained weights' fp32 gradients. ``hybrid`` does the same within a node
and all-reduces its gradient shards across nodes once per step; ``none`` (DDP) gathers
nothing (every process holds the model whole) and all-reduces the gradients once per step, in
buckets sent while the last micro-batch's backward still runs (:func:`exposed`). A collective
costs a fixed time (:func:`ftjob.api.hardware.collective_seconds`) plus its bytes over the
link it crosses (ring collectives: each process sends (n-1)/n of the data, twice for an
all-reduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftjob.api.hardware import collective_seconds, intra_node_bandwidth, node_bandwidth
from ftjob.api.jobspec import FineTuneJobSpec

FP32 = 4


@dataclass(frozen=True)
class Traffic:
    """One optimizer step's collectives, for one layout."""

    process_bytes: float  # what each process sends over its node's own links
    node_bytes: float  # what each node sends to the other nodes
    collectives: int  # how many collectives each process takes part in

    def seconds(self, spec: FineTuneJobSpec) -> float:
        """The step's time in collectives if none of it overlapped compute."""
        r, net = spec.resources, spec.network
        within = self.process_bytes / intra_node_bandwidth(r.gpu_type, r.gpus_per_node)
        across = 0.0
        if self.node_bytes:
            bandwidth = node_bandwidth(net.fabric, r.gpus_per_node, net.efa_devices_per_node)
            across = self.node_bytes / bandwidth
        return within + across + self.collectives * collective_seconds(r.gpus_per_node)


def traffic(
    spec: FineTuneJobSpec, layers: int, sharding: str, gathered: float, trainable: int
) -> Traffic:
    """The collectives of one step under ``sharding`` (resolved). ``gathered``: the bytes
    FSDP gathers for one forward (every sharded weight in the dtype it computes in: 0 where
    all of them are left whole); ``trainable``: the parameters that get gradients."""
    r = spec.resources
    micro = spec.accumulation
    units = layers + 1
    grads = trainable * FP32
    if r.world_size == 1:
        return Traffic(0.0, 0.0, 0)
    if sharding == "none":
        # One all-reduce per unit per step, over every process: within a node among its
        # processes, and between the nodes.
        share = (r.nproc_per_node - 1) / r.nproc_per_node
        return Traffic(2 * grads * share, _across(spec) * 2 * grads, units)
    group = r.nproc_per_node if sharding == "hybrid" else r.world_size
    share = (group - 1) / group
    gathers = _gathers(spec, sharding)
    # The root stays gathered from forward to backward: one gather a micro-batch.
    per_micro = layers * gathers + 1 + units  # gathers and reduce-scatters
    process = micro * (gathers * gathered + grads) * share
    if sharding == "hybrid":
        # The shards' all-reduce across nodes, once per step, after the last micro-batch.
        return Traffic(process, _across(spec) * 2 * grads, micro * per_micro + units)
    # full and grad-op span the nodes: every gather and reduce-scatter crosses them.
    node = micro * (gathers * gathered + grads) * _across(spec)
    return Traffic(process, node, micro * per_micro)


def exposed(seconds: float, backward: float, units: int) -> float:
    """The part of DDP's all-reduce (``seconds`` in all) the step waits for: its buckets go out
    as the backward (``backward`` seconds) makes their gradients, so only what outlasts the
    backward waits, and at least the last bucket (the last of ``units`` to get its
    gradients, at the backward's very end)."""
    return max(seconds - backward, seconds / units)


def _gathers(spec: FineTuneJobSpec, sharding: str) -> int:
    """How often a decoder layer is gathered per micro-batch."""
    if sharding == "grad-op":
        return 1
    reference = spec.training.objective == "dpo" and spec.method.type != "full"
    return 3 if reference else 2


def _across(spec: FineTuneJobSpec) -> float:
    """The share of a ring collective's data that crosses between nodes (0 on one node)."""
    n = spec.resources.nodes
    return (n - 1) / n


def context_layer_bytes(
    spec: FineTuneJobSpec, heads: int, kv_heads: int, head_dim: int, act_bytes: int
) -> float:
    """What one process sends in one decoder layer's forward under contextParallel N
    (trainer/model/context.py): four all-to-alls, q, k, v to the sequence and the output
    back, each sending (N-1)/N of its local [S/N tokens, heads] tensor; K/V heads repeated to
    lcm(Hkv, N) first where N does not divide them. The backward sends as much again."""
    n = spec.context_parallel
    if n == 1:
        return 0.0
    tokens = spec.training.micro_batch_size * spec.sequences_per_example
    tokens *= -(-spec.dataset.max_seq_length // n)
    kv = kv_heads * (n // math.gcd(kv_heads, n))
    return (n - 1) / n * tokens * (2 * heads + 2 * kv) * head_dim * act_bytes


def context_traffic(spec: FineTuneJobSpec, layer_bytes: float, passes: int) -> Traffic:
    """A step's all-to-alls: ``passes`` layer passes a micro-batch (forward, backward and the
    recomputed forwards), four collectives each, all inside a node (the group's ranks are
    consecutive, and the spec keeps a group within one)."""
    if not layer_bytes:
        return Traffic(0.0, 0.0, 0)
    micro = spec.accumulation
    return Traffic(micro * passes * layer_bytes, 0.0, micro * passes * 4)
