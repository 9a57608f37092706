"""Tokenizer and model: built empty everywhere, then every rank reads what it keeps.

The order follows torchtune's ``_setup_model``: :func:`build` gives every rank the
architecture with its adapters on the meta device (no memory, no weights read); the caller
shards it (:mod:`ftjob.trainer.model.parallel`); :func:`materialize` then has every rank copy the
rows of each tensor it keeps out of the memory-mapped safetensors files
(:mod:`ftjob.trainer.model.weights`), all ranks at once and with no collective. A rank holds its
shards plus at most one tensor being read (a whole weight under QLoRA, whose scales come
from all of it), and a 70B model is read from the volume by all the gang's readers in parallel.

Dtypes: full fine-tuning keeps fp32 master weights. LoRA and QLoRA keep the frozen base in the
compute precision (bf16 on GPUs) and only what trains (the adapters, hence their gradients and
AdamW moments) in fp32. QLoRA stores the decoder layers' frozen linear weights in torchao's
NF4, which FSDP2 shards like any other parameter (``Shard(0)``: each rank holds 1/world of the
4-bit bytes), as long as every weight splits into whole quantization blocks
(:func:`check_shardable`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ftjob.api.contract import BAD_SPEC, TrainerError
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.source import Hub, parse
from ftjob.job import installed, modelfiles
from ftjob.job.inputs import resolve  # here too: the trainer's modules call model.resolve
from ftjob.plan.modelshape import NF4_BLOCK, NF4_SCALE_BLOCK
from ftjob.trainer.model import attention, float8, gemm, norms, rotary, weights
from ftjob.trainer.model.lora import fuse
from ftjob.trainer.model.parallel import Dist, is_sharded

if TYPE_CHECKING:  # imported by the phase that uses it: see ftjob/trainer/report/startup.py
    from transformers import PreTrainedTokenizerBase

# The model cannot be read: one error for the folder, the weights and the tensors.
SourceError = weights.SourceError


def source_options(spec: FineTuneJobSpec) -> dict:
    """What every ``from_pretrained`` of spec.model.source takes: trust_remote_code, and for an
    hf:// source the pinned revision and the token."""
    m = spec.model
    kwargs = {"trust_remote_code": m.trust_remote_code}
    if isinstance(parse(m.source), Hub):
        kwargs.update(revision=m.revision, token=os.environ.get("HF_TOKEN"))
    return kwargs


def load_tokenizer(spec: FineTuneJobSpec) -> PreTrainedTokenizerBase:
    path = resolve(spec.model.source)
    # Checked before the data is prepared, as the weights are read only after it. An hf://
    # source is a local folder by now (sources.fetch), pickled weights left undownloaded.
    if not isinstance(parse(spec.model.source), Hub):
        found = modelfiles.folder_problem(Path(path), spec.model.source)
        if found:
            raise SourceError(found[0], where="spec.model.source", fix=found[1])
    from transformers import AutoTokenizer  # the data phase's (start-up: imported when used)

    tok = AutoTokenizer.from_pretrained(path, **source_options(spec))
    if tok.pad_token is None:
        # Padding positions never reach the loss (labels -100), so any known token will do;
        # eos is what Llama-family recipes use.
        tok.pad_token = tok.eos_token or tok.unk_token
    if tok.pad_token is None:
        raise SourceError(f"{spec.model.source}: the tokenizer has no pad, eos or unk token")
    return tok


def frozen_dtype(spec: FineTuneJobSpec) -> torch.dtype:
    """The dtype of weights that do not train: the compute precision (full: fp32 masters)."""
    return compute_dtype(spec) if spec.method.type != "full" else torch.float32


def compute_dtype(spec: FineTuneJobSpec) -> torch.dtype:
    """The dtype a forward computes in: bf16 where the job computes in it, else fp32."""
    return torch.bfloat16 if spec.bf16_compute() else torch.float32


@dataclass
class Built:
    """A model on the meta device, with what :func:`materialize` needs after sharding."""

    model: nn.Module
    spec: FineTuneJobSpec
    # Names of the frozen linear weights that QLoRA stores in NF4 (empty otherwise).
    quantized: dict[str, tuple[int, int]] = field(default_factory=dict)
    read_bytes: int = 0  # what this rank read from the weight files (set by materialize)
    converted: list[str] = field(default_factory=list)  # linear layers in float8 (fp8)


def build(spec: FineTuneJobSpec, tokenizer: PreTrainedTokenizerBase, frozen: bool = False) -> Built:
    """The model with adapters applied, on the meta device: no weight is read yet.
    ``frozen``: a copy that never trains (GRPO's reference of a full fine-tune), every weight
    in the compute precision (a forward's casts give the policy's own) and none trained."""
    # transformers' model classes (and through them torchao, where installed): seconds, paid
    # here, once the data is known to be good, not before every rank's first line.
    from transformers import AutoConfig, AutoModelForCausalLM

    path, options = resolve(spec.model.source), source_options(spec)
    config = AutoConfig.from_pretrained(path, **options)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=compute_dtype(spec) if frozen else frozen_dtype(spec),
            attn_implementation=attention.implementation(spec.model.attention),
            trust_remote_code=spec.model.trust_remote_code,
        )
    _prepare(model, tokenizer)
    norms.fuse(model)  # their backward written out: fewer passes over the activations
    rotary.fuse(model)  # the same for the rotary embedding of q and k
    model = _adapters(model, spec)
    # precision fp8: before sharding, so FSDP sees Float8Linear (and gathers float8 weights).
    converted = float8.convert(model, spec)
    if not spec.resources.on_gpu:
        gemm.fuse(model)  # float32 products through oneDNN where MKL runs at half speed
    if frozen:
        model.requires_grad_(False)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # what trains keeps fp32 weights, gradients and moments
    quantized = {}
    if spec.method.type == "qlora":
        from ftjob.trainer.model.parallel import decoder_layers

        prefix = {id(m): n for n, m in model.named_modules()}
        for layer in decoder_layers(model):
            for name, module in layer.named_modules():
                if isinstance(module, nn.Linear) and not module.weight.requires_grad:
                    full = f"{prefix[id(layer)]}.{name}.weight"
                    quantized[full] = tuple(module.weight.shape)
    return Built(model, spec, quantized, converted=converted)


def check_shardable(built: Built, shards: int) -> None:
    """Refuse, before any weight is read, a QLoRA job whose 4-bit weights cannot be split, or
    that this Python cannot store in 4 bits (the qlora extra missing: ftjob run refuses that at
    its door; a trainer started otherwise says it here, not as an import error halfway through
    the weights)."""
    from ftjob.plan.limits import qlora_problem  # the rule validate, plan and the operator apply

    problem = qlora_problem(built.spec, built.quantized, shards)
    problem = problem or next(iter(installed.missing(built.spec)), None)
    if problem:
        where = problem.path.removeprefix("spec")  # the termination record's field, e.g. .resources
        # The fix travels on its own, so the failure summary's fix line is this cause's.
        raise TrainerError(problem.message, reason=BAD_SPEC, where=where, fix=problem.fix)


def _prepare(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = False  # training never reuses a KV cache


def _adapters(model: nn.Module, spec: FineTuneJobSpec) -> nn.Module:
    lora = spec.method.lora_settings()
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    targets = lora.target_modules
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        task_type="CAUSAL_LM",
    )
    # On the meta device: materialize draws the adapters' values, the same on every rank.
    adapted = get_peft_model(model, config)
    fuse(adapted)  # the adapters' output added inside their second matmul
    return adapted


def left_whole(built: Built, shards: int) -> set[nn.Parameter]:
    """The frozen weights (the base under LoRA and QLoRA) when the shard group is one
    process: there is nothing to split them over, and FSDP would still copy each layer in and
    out of a gather buffer every forward and backward (and skips the NF4 hooks for a group of
    one, so its all-gather of 4-bit weights fails). Left whole, they cost no collective; only
    what trains is replicated by FSDP and its gradients all-reduced."""
    if shards > 1:
        return set()
    return {p for p in built.model.parameters() if not p.requires_grad}


@dataclass(eq=False)
class _Slot:
    """One parameter of the sharded model, under all its names (tied weights have two)."""

    like: nn.Parameter  # the sharded meta parameter: shape, dtype, placements
    names: list[str]  # the model's (peft's, with adapters)
    owners: list[tuple[nn.Module, str]]

    @property
    def base_names(self) -> list[str]:
        """Its names in the base model, as the checkpoint has them."""
        return [weights.base_name(n) for n in self.names]

    def fill(self, value: torch.Tensor) -> None:
        new = nn.Parameter(value, self.like.requires_grad)
        for module, attr in self.owners:
            module._parameters[attr] = new  # one object under every name keeps them tied


def materialize(built: Built, d: Dist, cpu_offload: bool = False) -> None:
    """After sharding: every rank reads the rows of each tensor it keeps from the mapped
    safetensors files, in the training dtype, with no collective (:mod:`weights`).

    A QLoRA weight is read whole on every rank: the NF4 scales of its blocks are normalised by
    a mean over the whole weight. Each rank then quantizes only its own rows against those
    scales (:func:`_nf4_shard`), and holds the shard the unsharded model would have, bit for bit.
    Adapters are drawn by peft's own initialisation with the job's seed, the same on every
    rank; non-persistent buffers (rotary ``inv_freq``) are computed by transformers' own init.
    """
    model = built.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source = resolve(built.spec.model.source)
    ckpt = weights.Checkpoint(Path(source), built.spec.model.source, base)
    slots = _slots(model)
    found = {name: s for s in slots if (name := ckpt.find(s.base_names))}
    read = {id(s) for s in found.values()}
    drawn = _adapter_ids(model)
    adapters = [s for s in slots if id(s) not in read and id(s.like) in drawn]
    missing = [s.base_names[0] for s in slots if id(s) not in read and id(s.like) not in drawn]
    buffers = _buffer_plan(model, ckpt)
    missing += [name for name, _, _, in_file in buffers if in_file is None]
    if missing:
        # Before any read: every rank would read its share only to fail on what is not there.
        raise SourceError(
            f"model.source {built.spec.model.source}: the checkpoint has no tensor for "
            f"{len(missing)} of the model's ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''})",
            where="spec.model.source",
            fix="download or copy the checkpoint again, or point spec.model.source at the "
            "checkpoint saved with this config.json",
        )
    for name, part in ckpt.tensors(found):
        slot = found[name]
        at = home(slot.like, d.device, cpu_offload)
        if any(n in built.quantized for n in slot.names):
            whole = ckpt.read(part, (), slot.like.dtype, d.device)
            slot.fill(_nf4_shard(whole, slot.like, at))
        else:
            own = ckpt.read(part, _rows(slot.like), slot.like.dtype, at)
            slot.fill(_placed(own, slot.like))
    _init_adapters(model, adapters, built.spec.training.seed, d.device, cpu_offload)
    _buffers(buffers, base, ckpt, d.device)  # FSDP offloads parameters, never buffers
    built.read_bytes = ckpt.read_bytes  # the weights' and the buffers' bytes


def home(like: torch.Tensor, device: torch.device, cpu_offload: bool) -> torch.device:
    """Where the parameter ``like`` (sharded, on meta) lives: with cpuOffload, FSDP's shards
    (DTensors) in CPU memory, moved to the GPU a layer at a time; a weight FSDP leaves whole
    (:func:`left_whole`) is never moved by it, so it stays on the device (left in CPU memory,
    an H200 found the embedding's lookup on the wrong device: bench/RESULTS.md)."""
    offloaded = cpu_offload and is_sharded(like)
    return torch.device("cpu") if offloaded else device


def _slots(model: nn.Module) -> list[_Slot]:
    """Every parameter once, in module order, with all the names it goes by."""
    slots: dict[int, _Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            slot = slots.setdefault(id(param), _Slot(param, [], []))
            name = f"{prefix}.{attr}" if prefix else attr
            if (module, attr) not in slot.owners:
                slot.owners.append((module, attr))
                slot.names.append(name)
    return list(slots.values())


def _rows(like: torch.Tensor) -> tuple[slice, ...]:
    """The part of the whole tensor this rank keeps of the sharded parameter ``like``, as
    torch's DTensor computes it (DCP's reads use the same function): FSDP2's ``torch.chunk``
    split, a shorter last chunk, and nothing for a rank past the last."""
    if not is_sharded(like):
        return tuple(slice(0, n) for n in like.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        like.shape, like.device_mesh, like.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _placed(own: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows as the sharded parameter ``like`` (a plain tensor where FSDP left it
    whole), on the device they were read to.

    Built from ``like``'s own spec, as FSDP2 builds its sharded parameters: ``DTensor.from_local``
    moves a tensor to the mesh's device, and with cpuOffload that put every offloaded shard on
    the GPU, which FSDP then refused (first seen on an H200: bench/RESULTS.md)."""
    if not is_sharded(like):
        return own
    own = float8.like(own, like._local_tensor)  # fp8: FSDP gathers it in float8
    from torch.distributed.tensor import DTensor

    return DTensor(own, like._spec, requires_grad=False)


def _init_adapters(
    model: nn.Module, adapters: list[_Slot], seed: int, device: torch.device, cpu_offload: bool
) -> None:
    """The adapters' initial values, the same on every rank with no collective: peft's own
    initialisation of each LoRA layer, in module order, from one generator seeded with the
    job's seed, on CPU copies of the whole adapter; each rank keeps its shard."""
    if not adapters:
        return
    from peft.tuners.lora import LoraLayer

    pending = {id(s.like): s for s in adapters}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in model.modules():
            if not isinstance(layer, LoraLayer):
                continue
            own = [pending.pop(id(p)) for n, p in layer.named_parameters()
                   if not n.startswith("base_layer.") and id(p) in pending]  # fmt: skip
            for slot in own:  # whole CPU tensors for peft to fill in place
                slot.fill(torch.empty(slot.like.shape, dtype=slot.like.dtype))
            for name in layer.lora_A.keys() | layer.lora_embedding_A.keys():
                layer.reset_lora_parameters(name, model.peft_config[name].init_lora_weights)
            for slot in own:
                whole = slot.owners[0][0]._parameters[slot.owners[0][1]].detach()
                slot.fill(_own_shard(whole, slot.like, home(slot.like, device, cpu_offload)))
    if pending:  # an adapter kind whose values peft's reset_lora_parameters does not draw
        names = [s.names[0] for s in pending.values()]
        raise SourceError(f"peft drew no initial value for the adapters {names[:3]}")


def _adapter_ids(model: nn.Module) -> set[int]:
    """The ids of peft's adapter parameters (a LoRA layer's own, not its ``base_layer``'s):
    what :func:`_init_adapters` draws. Under a full fine-tune everything trains, so
    ``requires_grad`` does not tell an adapter from a weight the checkpoint lacks."""
    if not hasattr(model, "peft_config"):
        return set()
    from peft.tuners.lora import LoraLayer

    return {
        id(p)
        for layer in model.modules()
        if isinstance(layer, LoraLayer)
        for n, p in layer.named_parameters()
        if not n.startswith("base_layer.")
    }


def _buffer_plan(model: nn.Module, ckpt: weights.Checkpoint) -> list[tuple]:
    """(name, module, attribute, checkpoint name or "" to compute it) for every buffer still
    on the meta device; checkpoint name None where it can be neither read nor computed."""
    plan = []
    for prefix, module in model.named_modules():
        for attr, old in module._buffers.items():
            if old is None or not old.is_meta:
                continue
            name = weights.base_name(f"{prefix}.{attr}" if prefix else attr)
            in_file = ckpt.find([name]) or ""
            # _init_weights would draw this module's loaded parameters afresh.
            if not in_file and any(True for _ in module.parameters(recurse=False)):
                in_file = None
            plan.append((name, module, attr, in_file))
    return plan


def _buffers(plan: list[tuple], base: nn.Module, ckpt: weights.Checkpoint, home) -> None:
    """Buffers: read whole where the checkpoint has them; the others (non-persistent, e.g.
    rotary ``inv_freq``) computed by transformers' own ``_init_weights`` of their module."""
    computed = []
    for _, module, attr, in_file in plan:
        old = module._buffers[attr]
        if in_file:
            for _, part in ckpt.tensors([in_file]):  # read while its file is open
                module._buffers[attr] = ckpt.read(part, (), old.dtype, home)
            continue
        module._buffers[attr] = torch.empty(old.shape, dtype=old.dtype)
        computed.append(module)
    for module in dict.fromkeys(computed):
        base._init_weights(module)
        for attr, value in module._buffers.items():
            module._buffers[attr] = value.to(home) if value is not None else None


def _nf4_shard(whole: torch.Tensor, like: torch.Tensor, home: torch.device) -> torch.Tensor:
    """This rank's shard of a QLoRA weight in NF4, bit for bit the slice of torchao's
    ``to_nf4`` of the whole weight, for 1/world of its cost.

    The block scales are quantized again around their mean over the whole weight, so they are
    taken from all of it (one absmax per block of 64: cheap); the 4-bit codes, a nearest-of-16
    search per value and nearly all of the work, depend on their own block only and are
    computed for this rank's rows alone (whole scale blocks: :func:`check_shardable`)."""
    from torchao.quantization import NF4Tensor, to_nf4  # QLoRA's only

    if not is_sharded(like):
        return to_nf4(whole, NF4_BLOCK, NF4_SCALE_BLOCK)  # left whole by FSDP
    rows = _rows(like)[0]
    # A copy of its rows: an NF4 tensor records its storage offset, a shard's is 0.
    own = to_nf4(whole[rows].clone(), NF4_BLOCK, NF4_SCALE_BLOCK)
    scalers, factors, mean = NF4Tensor.double_quantize_scalers(
        whole.flatten(), NF4_BLOCK, NF4_SCALE_BLOCK
    )
    first = rows.start * whole.shape[1] // NF4_BLOCK  # its first block in the whole weight
    own.quantized_scalers = scalers[first : first + own.n_blocks]
    own.quantization_factor = factors[
        first // NF4_SCALE_BLOCK : (first + own.n_blocks) // NF4_SCALE_BLOCK
    ]
    own.scaler_mean = mean
    return _kept(own, like, home)


def _own_shard(full: torch.Tensor, like: torch.Tensor, home: torch.device) -> torch.Tensor:
    """This rank's piece of ``full`` laid out as the sharded (meta) parameter ``like``, on
    ``home``: a parameter left whole (one process, DDP, a group of one) goes there whole, as
    FSDP moves no parameter it does not manage (an H100 found LoRA's adapters, drawn on CPU,
    left there by one GPU's plain module)."""
    if not is_sharded(like):
        return full.to(home)
    return _kept(full[_rows(like)], like, home)


def _kept(local: torch.Tensor, like: torch.Tensor, home: torch.device) -> torch.Tensor:
    """This rank's piece, on ``home`` in memory of its own, as the sharded parameter ``like``."""
    # torchao is the qlora extra's: an NF4 tensor exists only once _nf4_shard imported it,
    # and a LoRA or full job runs where torchao is not installed.
    nf4 = sys.modules.get("torchao.quantization")
    local = local.to(home)
    if nf4 is not None and isinstance(local, nf4.NF4Tensor):
        # NF4's clone() quantizes again (and a slice's own scale mean differs from the whole
        # weight's): copy its parts instead. Fresh unit strides also matter, as FSDP2 views
        # each all-gather input as bytes (a one-element slice keeps its parent's stride).
        for attr in ("quantized_scalers", "quantization_factor", "quantized_data"):
            part = getattr(local, attr)
            setattr(local, attr, part.clone(memory_format=torch.contiguous_format))
    else:
        local = local.clone()  # a slice would keep the whole tensor alive
    return _placed(local, like)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters, counted on the unsharded shapes."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable
