"""Process group, device mesh, FSDP2 sharding and DDP: the only place that knows about
parallelism.

The model code knows nothing of this (torchtitan's rule). :func:`wrap` gives the model as
the gang trains it: :func:`shard` takes a plain Hugging Face model, turns on activation
checkpointing, then applies ``fully_shard`` to every decoder layer and finally to the root;
``none`` (every rank holds the whole model) is torch's DDP (:func:`replicate`); a job of one
rank has nothing to shard or reduce, and :func:`plain` trains it as the module it is (no
DTensor, no hooks), as torchtitan does where the data-parallel degree is 1. The same calls
run on CPU (gloo) and GPUs (NCCL).
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ftjob.api import contract
from ftjob.api.contract import BAD_SPEC, TrainerError
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.job import machine
from ftjob.plan import layout as plan_layout
from ftjob.plan import limits
from ftjob.plan.estimate import checkpoint_stride, checkpointed
from ftjob.plan.modelshape import ModelShape
from ftjob.trainer.model import context

# FSDP (with DTensor and sympy: a second of CPU) is imported when a model is sharded
# (:func:`shard`), not at the trainer's start; a job of one rank (:func:`plain`) needs none.


@dataclass(frozen=True)
class Dist:
    """Where this process stands in the gang (from torchrun's environment)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(spec: FineTuneJobSpec) -> Dist:
    """Join the process group: NCCL on GPUs, gloo on CPU; a lone process runs as world 1."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if spec.resources.on_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("the spec asks for GPUs (resources.gpusPerNode) but none is visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NCCL for GPU tensors, gloo beside it for CPU ones: with cpuOffload the sharded
        # parameters and gradients live in CPU memory, and the collectives on them (gradient
        # norm clipping, the export's gather of the adapters) need a CPU backend.
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(seconds=spec.network.collective_timeout_seconds)
    # `python -m ftjob.trainer` without torchrun: a world of one, no rendezvous needed.
    store = dist.HashStore() if "MASTER_ADDR" not in os.environ else _round_store(world, timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=_device_id(device),
    )
    return Dist(rank, local_rank, world, local_world, device)


def _round_store(world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under ftjob's agent: the agent's store, with keys of this round of the gang only.

    The store outlives restarts in place, and torch does not keep one round's keys from the
    next: a restarted gang could read the addresses its dead predecessors published and wait
    on them until the collective timeout. The agent counts the gang's rounds alike on every
    node (FTJOB_RESTARTS_IN_PLACE); under plain torchrun, torch's own rendezvous (None)."""
    restarts = os.environ.get(contract.RESTARTS_IN_PLACE_ENV)
    if restarts is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=False, timeout=timeout)  # fmt: skip
    return dist.PrefixStore(f"ftjob/round-{restarts}", agent)


def _device_id(device: torch.device) -> torch.device | None:
    # Binding NCCL to the device up front avoids a lazy, hang-prone first collective.
    return device if device.type == "cuda" else None


def mesh(spec: FineTuneJobSpec, d: Dist, sharding: str) -> DeviceMesh:
    """FSDP's mesh: 1-D for full and grad-op; 2-D (replicate, shard) for hybrid."""
    if sharding != "hybrid":
        return init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))
    shape = (spec.resources.nodes, d.world_size // spec.resources.nodes)
    return init_device_mesh(d.device.type, shape, mesh_dim_names=("replicate", "shard"))


def context_group(spec: FineTuneJobSpec, d: Dist) -> context.Group | None:
    """This rank's context-parallel group (parallelism.contextParallel N, auto resolved), or
    None at 1: N consecutive ranks, so a group stays inside a node (the spec's rule: N divides
    the processes per node). FSDP and DDP stay over every rank: the group's ranks hold other
    tokens, as data-parallel ranks do, and the gang's one gradient reduction sums them."""
    n = spec.context_parallel
    if n == 1:
        return None
    mine = None
    for first in range(0, d.world_size, n):
        group = dist.new_group(list(range(first, first + n)))  # every rank makes every group
        if first <= d.rank < first + n:
            mine = group
    return context.Group(mine, d.rank % n, n)


def check_context_heads(spec: FineTuneJobSpec, config) -> None:
    """Refuse, before any weight is read, a contextParallel that does not divide the model's
    attention heads (each rank of a group attends with heads/N of them)."""
    n, heads = spec.context_parallel, config.num_attention_heads
    if heads % n:
        fits = [k for k in range(1, n) if heads % k == 0 and spec.resources.nproc_per_node % k == 0]
        raise TrainerError(
            f"parallelism.contextParallel {n} does not divide the model's {heads} attention "
            "heads: each rank of a group attends with heads/N of them",
            reason=BAD_SPEC,
            where=".parallelism.contextParallel",
            fix=f"set parallelism.contextParallel to a divisor of {heads} (e.g. {fits[-1]})",
        )


def shard_group_size(device_mesh: DeviceMesh) -> int:
    """How many ranks split each parameter (the mesh's shard dimension)."""
    return device_mesh["shard"].size()


def ddp(spec: FineTuneJobSpec, d: Dist, sharding: str) -> bool:
    """Whether the gang trains replicated as DDP: ``none`` over more than one rank (the spec
    refuses none with cpuOffload, which is FSDP's)."""
    return sharding == "none" and not plain_enough(spec, d)


def shard_group(spec: FineTuneJobSpec, d: Dist, sharding: str) -> int:
    """How many ranks split each parameter: the planner's group (:func:`ftjob.plan.limits.
    shard_group`: one for none, which is DDP), and one for a plain module."""
    return 1 if plain_enough(spec, d) else limits.shard_group(spec, sharding)


# How a layout keeps a step's gradient reduction to its last micro-batch (given whether this
# micro-batch is the last); None where nothing waits (one rank; FSDP without replicas, whose
# reduce-scatter every micro-batch is what keeps the gradients sharded).
ReduceLast = Callable[[bool], None] | None


def wrap(
    model: nn.Module,
    spec: FineTuneJobSpec,
    d: Dist,
    sharding: str,
    whole: set[nn.Parameter] | None = None,
    speed: Speed | None = None,
) -> tuple[nn.Module, ReduceLast]:
    """The model as this gang trains it under ``sharding`` (auto resolved), and its
    :data:`ReduceLast`. ``whole`` and ``speed`` as :func:`shard` takes them."""
    if plain_enough(spec, d):
        return plain(model, spec, d.device, speed), None
    if ddp(spec, d, sharding):
        net = replicate(model, spec, d, speed)
        # DDP all-reduces nothing until the last micro-batch, whose backward then overlaps it.
        return net, net.set_requires_gradient_sync
    device_mesh = mesh(spec, d, sharding)
    net = shard(model, spec, device_mesh, sharding, whole, speed)
    if device_mesh.ndim == 2 and device_mesh["replicate"].size() > 1:
        # The reduce-scatter within a node runs every micro-batch; the all-reduce across the
        # replicas (the nodes) waits for the last.
        return net, net.set_requires_all_reduce
    return net, None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, found by the class names transformers marks as not splittable."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"found no decoder layers ({sorted(names)}) in {type(base).__name__}")
    return layers


@dataclass(frozen=True)
class Speed:
    """The speed settings, resolved for this device (checkpoint_stride, spec)."""

    checkpoint_every: int  # recompute every Nth decoder layer in backward; 0: none
    compile: bool  # torch.compile each decoder layer


def layout(spec: FineTuneJobSpec, d: Dist, config) -> plan_layout.Layout:
    """parallelism.sharding (``auto``: the planner's fastest layout that fits) and the
    activation checkpointing that goes with it, for the memory this gang has: one GPU's, or
    a CPU process's share of resources.memory or of the machine's. Every rank takes the
    smallest any rank found, so all choose the same layout."""
    if d.device.type == "cuda":
        found = torch.cuda.get_device_properties(d.device).total_memory
    else:
        found = machine.memory_bytes() or 0.0
    least = torch.tensor([float(found)], dtype=torch.float64, device=d.device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    memory = least.item() or None
    on_gpu = d.device.type == "cuda"
    budget = plan_layout.budget(spec, memory if on_gpu else None, None if on_gpu else memory)
    return plan_layout.choose(spec, ModelShape.from_config(config.to_dict()), budget)


def plain_enough(spec: FineTuneJobSpec, d: Dist) -> bool:
    """Whether the job trains as a plain module: one rank in all, whose states stay on its
    device (cpuOffload is FSDP's: it moves shards between host and device); the rule the
    planner counts by (:func:`ftjob.plan.limits.plain_module`), with the gang's real size."""
    return d.world_size == 1 and limits.plain_module(spec)


def _resolved(model: nn.Module, spec: FineTuneJobSpec, sharding: str, speed: Speed | None):
    """``speed`` as given, else what activationCheckpointing and compile resolve to on a CPU
    (no device memory to fit)."""
    if speed is not None:
        return speed
    shape = ModelShape.from_config(model.config.to_dict())
    return Speed(
        checkpoint_stride(spec, shape, None, sharding), spec.compile_enabled(spec.resources.on_gpu)
    )


def _speed_up(model: nn.Module, speed: Speed) -> list[nn.Module]:
    """Activation checkpointing, then compile, on the decoder layers (returned)."""
    layers = decoder_layers(model)
    if speed.checkpoint_every:
        # Non-reentrant checkpointing recomputes inside FSDP's hooks and needs no input grads.
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
        for i, layer in enumerate(layers):  # the layers ftjob plan counted as recomputed
            layer.gradient_checkpointing = checkpointed(i, speed.checkpoint_every)
    if speed.compile:
        for layer in layers:
            # The layer's forward only: FSDP's hooks (in __call__) stay eager around it, and
            # the layer keeps its name, so checkpoints and the export see the same keys.
            layer.forward = torch.compile(layer.forward)
    return layers


def plain(
    model: nn.Module, spec: FineTuneJobSpec, device: torch.device, speed: Speed | None = None
) -> nn.Module:
    """Activation checkpointing and compile as :func:`shard` applies them, and the precision
    FSDP's policy gives: fp32 weights (the optimizer's masters and moments stay fp32), bf16
    compute where the job asks for it, fp32 gradients. The parameters keep their names, so
    checkpoints and exports are those of the sharded layouts (DCP reshards between them)."""
    _speed_up(model, _resolved(model, spec, "none", speed))
    if spec.bf16_compute():
        # Autocast casts the weights for each op as FSDP casts them for each layer; the
        # gradients land on the fp32 weights in fp32, as FSDP's fp32 reduce gives them.
        model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)
        # An embedding lookup is no autocast op: its fp32 rows would carry the residual
        # stream (and the rotary tables cast to its dtype) in fp32, twice FSDP's bf16 bytes.
        model.get_input_embeddings().register_forward_hook(_to_bf16)
    return model


def _to_bf16(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    return out.to(torch.bfloat16)


def replicate(
    model: nn.Module, spec: FineTuneJobSpec, d: Dist, speed: Speed | None = None
) -> nn.Module:
    """:func:`plain`'s module under torch's DDP (the composable ``replicate``, which keeps the
    parameters' names: checkpoints and exports are those of the sharded layouts, and DCP
    reshards between them). DDP all-reduces the gradients in buckets while the backward is
    still running. Every rank read the same weights and drew the same adapters (from
    training.seed), so nothing is broadcast at the start (QLoRA's 4-bit weights could not
    be), nor are the buffers at each forward (the rotary tables: computed alike)."""
    from torch.distributed._composable.replicate import replicate as ddp_replicate

    net = plain(model, spec, d.device, speed)
    return ddp_replicate(
        net,
        device_id=d.device,
        init_sync=False,
        broadcast_buffers=False,
        # The gradients are views into DDP's buckets: no second copy of them per rank.
        gradient_as_bucket_view=True,
    )


def shard(
    model: nn.Module,
    spec: FineTuneJobSpec,
    device_mesh: DeviceMesh,
    sharding: str,
    whole: set[nn.Parameter] | None = None,
    speed: Speed | None = None,
) -> nn.Module:
    """Activation checkpointing, compile, then ``fully_shard`` per decoder layer, then the root
    (torchtitan's order).

    ``whole``: parameters FSDP leaves alone (each rank holds them whole); ``speed``:
    what activationCheckpointing and compile resolve to on a CPU (no device memory to fit)
    when not given; the trainer passes its :func:`layout`'s."""
    layers = _speed_up(model, _resolved(model, spec, sharding, speed))
    # grad-op keeps each layer's gathered parameters from forward until backward (ZeRO-2).
    reshard = sharding != "grad-op"
    kwargs = dict(mesh=device_mesh, ignored_params=whole, **_policies(spec))
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    # The root (embeddings, final norm, head) is gathered last and used first in backward:
    # keeping it gathered after forward saves one all-gather per step.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def _policies(spec: FineTuneJobSpec) -> dict:
    """FSDP's precision and offload policies for the job."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    if spec.bf16_compute():
        # Gradients are reduced in fp32 so that averaging across ranks loses nothing.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    offload = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if spec.parallelism.cpu_offload
        else OffloadPolicy()
    )
    return dict(mp_policy=mp, offload_policy=offload)


def frozen(model: nn.Module, spec: FineTuneJobSpec, d: Dist, policy: nn.Module) -> nn.Module:
    """A model that never trains (GRPO's reference of a full fine-tune), laid out as the
    trained ``policy`` is: sharded on the policy's own mesh, with its precision and offload,
    where the policy's parameters are sharded; whole on every rank where they are not (a
    plain module, or DDP, which would have no gradient to all-reduce for it). Every layer,
    the root too, is freed again after its forward: no backward ever comes for it. Neither
    recomputed nor compiled: it only runs forwards without gradients."""
    model.requires_grad_(False)
    device_mesh = sharded_on(policy)
    if device_mesh is None:
        return plain(model, spec, d.device, Speed(0, False))
    for module in [*decoder_layers(model), model]:
        fully_shard(module, mesh=device_mesh, reshard_after_forward=True, **_policies(spec))
    return model


def is_sharded(like: torch.Tensor) -> bool:
    """Whether ``like`` is a parameter FSDP sharded (a DTensor). Its module exists once FSDP
    sharded something, so this asks sys.modules instead of importing it at start-up."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(like, tensor.DTensor)


def sharded_on(net: nn.Module) -> DeviceMesh | None:
    """The mesh FSDP sharded ``net``'s parameters on; None where it holds them whole."""
    found = next((p for p in net.parameters() if is_sharded(p)), None)
    return None if found is None else found.device_mesh


def fully_shard(module: nn.Module, **kwargs) -> nn.Module:
    """torch's FSDP2 ``fully_shard``, imported at the first call."""
    from torch.distributed.fsdp import fully_shard as fsdp_shard

    return fsdp_shard(module, **kwargs)
