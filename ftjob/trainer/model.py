"""Tokenizer and model: built empty everywhere, read once on rank 0, adapters applied.

The order follows torchtune's ``_setup_model``: :func:`build` gives every rank the
architecture with its adapters on the meta device (no memory, no weights read); the caller
shards it (:mod:`ftjob.trainer.parallel`); :func:`materialize` then reads the weights on rank
0 and hands every rank its shard of each tensor, one tensor at a time. A 70B model is read from
disk once for the whole gang, and no rank ever holds more than its shards plus one tensor.

Dtypes: full fine-tuning keeps fp32 master weights. LoRA and QLoRA keep the frozen base in the
compute precision (bf16 on GPUs) and only what trains (the adapters, hence their gradients and
AdamW moments) in fp32. QLoRA stores the decoder layers' frozen linear weights in torchao's
NF4, which FSDP2 shards like any other parameter (``Shard(0)``: each rank holds 1/world of the
4-bit bytes), as long as every weight splits into whole quantization blocks
(:func:`check_shardable`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.quantization import NF4Tensor, to_nf4
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ftjob import contract
from ftjob.contract import BAD_SPEC, TrainerError
from ftjob.modelshape import NF4_BLOCK, NF4_SCALE_BLOCK
from ftjob.spec import FineTuneJobSpec
from ftjob.trainer import attention
from ftjob.trainer.parallel import Dist


class SourceError(contract.TrainerError, ValueError):
    """The model cannot be read; the message names the source."""

    reason = contract.BAD_MODEL


def resolve(source: str) -> str:
    """hf://org/name -> org/name for the Hub; a relative path -> beside the job file/volume."""
    if source.startswith("hf://"):
        return source[len("hf://") :]
    path = Path(source)
    if not path.is_absolute():
        path = Path(os.environ.get("FTJOB_SOURCE_ROOT", ".")) / path
    return str(path)


def hub_kwargs(spec: FineTuneJobSpec) -> dict:
    m = spec.model
    kwargs = {"trust_remote_code": m.trust_remote_code}
    if m.source.startswith("hf://"):
        kwargs.update(revision=m.revision, token=os.environ.get("HF_TOKEN"))
    return kwargs


def load_tokenizer(spec: FineTuneJobSpec) -> PreTrainedTokenizerBase:
    path = resolve(spec.model.source)
    if not spec.model.source.startswith("hf://") and not (Path(path) / "config.json").is_file():
        raise SourceError(
            f"model.source {spec.model.source}: no Hugging Face model folder "
            f"(config.json) at {path}"
        )
    tok = AutoTokenizer.from_pretrained(path, **hub_kwargs(spec))
    if tok.pad_token is None:
        # Padding positions never reach the loss (labels -100), so any known token will do;
        # eos is what Llama-family recipes use.
        tok.pad_token = tok.eos_token or tok.unk_token
    if tok.pad_token is None:
        raise SourceError(f"{spec.model.source}: the tokenizer has no pad, eos or unk token")
    return tok


def frozen_dtype(spec: FineTuneJobSpec) -> torch.dtype:
    """The dtype of weights that do not train: the compute precision (full: fp32 masters)."""
    if spec.method.type != "full" and spec.compute_precision() == "bf16":
        return torch.bfloat16
    return torch.float32


@dataclass
class Built:
    """A model on the meta device, with what :func:`materialize` needs after sharding."""

    model: nn.Module
    spec: FineTuneJobSpec
    # Names of the frozen linear weights that QLoRA stores in NF4 (empty otherwise).
    quantized: dict[str, tuple[int, int]] = field(default_factory=dict)
    read_weights: bool = False  # this rank read the weight files (set by materialize)


def build(spec: FineTuneJobSpec, tokenizer: PreTrainedTokenizerBase) -> Built:
    """The model with adapters applied, on the meta device: no weight is read yet."""
    path, hub = resolve(spec.model.source), hub_kwargs(spec)
    config = AutoConfig.from_pretrained(path, **hub)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=frozen_dtype(spec),
            attn_implementation=attention.implementation(spec.model.attention),
            trust_remote_code=spec.model.trust_remote_code,
        )
    _prepare(model, tokenizer)
    model = _adapters(model, spec)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # what trains keeps fp32 weights, gradients and moments
    quantized = {}
    if spec.method.type == "qlora":
        from ftjob.trainer.parallel import decoder_layers

        prefix = {id(m): n for n, m in model.named_modules()}
        for layer in decoder_layers(model):
            for name, module in layer.named_modules():
                if isinstance(module, nn.Linear) and not module.weight.requires_grad:
                    full = f"{prefix[id(layer)]}.{name}.weight"
                    quantized[full] = tuple(module.weight.shape)
    return Built(model, spec, quantized)


def check_shardable(built: Built, shards: int) -> None:
    """Refuse, before any weight is read, a QLoRA job whose 4-bit weights cannot be split."""
    from ftjob.verdict import qlora_problem  # the rule validate, plan and the operator apply

    problem = qlora_problem(built.spec, built.quantized, shards)
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
    # Adapter init draws random numbers: rank 0 reads the model with the seed's adapters, and
    # every rank receives them by broadcast.
    torch.manual_seed(spec.training.seed)
    return get_peft_model(model, config)


def left_whole(built: Built, shards: int) -> set[nn.Parameter]:
    """QLoRA's 4-bit weights when the shard group is one process: FSDP2 skips the NF4 hooks
    for a group of one (its all-gather fails), and there is nothing to split them over."""
    if shards > 1:
        return set()
    params = dict(built.model.named_parameters())
    return {params[name] for name in built.quantized}


def materialize(built: Built, d: Dist, cpu_offload: bool = False) -> None:
    """After sharding: read the weights on rank 0 and give every rank its shards (collective).

    Each tensor is broadcast whole in its training dtype, one at a time; each rank keeps its
    own slice. A QLoRA weight is quantized whole on every rank before it is sliced: the NF4
    scales of its blocks are normalised by a mean over the whole weight, so only whole-weight
    quantization gives every rank the shard the unsharded model would have.
    """
    model = built.model
    state: dict[str, torch.Tensor] = {}
    if d.is_main:
        state = _read(built.spec, built.model.config)
        built.read_weights = True
    # Offloaded shards live in CPU memory; FSDP moves them to the GPU one layer at a time.
    home = torch.device("cpu") if cpu_offload else d.device
    done: dict[int, nn.Parameter] = {}  # tied weights: one tensor under two names
    for prefix, module in model.named_modules():
        for attr, old in list(module._parameters.items()):
            if old is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if id(old) not in done:
                full = _broadcast(state.pop(name, None), old, d)
                if name in built.quantized:
                    full = to_nf4(full, NF4_BLOCK, NF4_SCALE_BLOCK)
                done[id(old)] = nn.Parameter(_own_shard(full, old, home), old.requires_grad)
            setattr(module, attr, done[id(old)])
        for attr, old in list(module._buffers.items()):
            if old is not None:
                name = f"{prefix}.{attr}" if prefix else attr
                module._buffers[attr] = _broadcast(state.pop(name, None), old, d).to(home)


def _read(spec: FineTuneJobSpec, config) -> dict[str, torch.Tensor]:
    """Rank 0: every tensor of the model with its adapters, buffers too, by name."""
    path = resolve(spec.model.source)
    common = dict(
        attn_implementation=attention.implementation(spec.model.attention), **hub_kwargs(spec)
    )
    # Read in the checkpoint's own dtype (bf16 for most LLMs: half of fp32); cast per tensor.
    source = AutoModelForCausalLM.from_pretrained(path, dtype="auto", **common)
    source.config.pad_token_id = config.pad_token_id
    source = _adapters(source, spec)  # the same seed: the adapters' initial values
    state = dict(source.named_buffers())
    state.update(source.state_dict())
    return state


def _broadcast(value: torch.Tensor | None, like: torch.Tensor, d: Dist) -> torch.Tensor:
    """Rank 0's ``value`` on every rank, whole, in ``like``'s dtype, on the compute device."""
    if d.is_main:
        if value is None:
            raise RuntimeError(f"the model read on rank 0 has no tensor shaped {like.shape}")
        full = value.to(device=d.device, dtype=like.dtype).contiguous()
    else:
        full = torch.empty(like.shape, dtype=like.dtype, device=d.device)
    dist.broadcast(full, src=0)
    return full


def _own_shard(full: torch.Tensor, like: torch.Tensor, home: torch.device) -> torch.Tensor:
    """This rank's piece of ``full`` laid out as the sharded (meta) parameter ``like``."""
    if not isinstance(like, DTensor):
        return full  # left whole by FSDP: it stays on the compute device
    mesh, local = like.device_mesh, full
    for dim, placement in enumerate(like.placements):
        if placement.is_shard():
            # torch.chunk is how FSDP2 splits a parameter (shorter last chunk, then padding).
            chunks = torch.chunk(local, mesh.size(dim), dim=placement.dim)
            index = mesh.get_local_rank(dim)
            # A rank past the last chunk holds nothing (never NF4: check_shardable).
            local = chunks[index] if index < len(chunks) else local[:0]
    local = local.to(home)
    if isinstance(local, NF4Tensor):
        # NF4's clone() quantizes again (and a slice's own scale mean differs from the whole
        # weight's): copy its parts instead. Fresh unit strides also matter, as FSDP2 views
        # each all-gather input as bytes (a one-element slice keeps its parent's stride).
        for attr in ("quantized_scalers", "quantization_factor", "quantized_data"):
            part = getattr(local, attr)
            setattr(local, attr, part.clone(memory_format=torch.contiguous_format))
    else:
        local = local.clone()  # a slice would keep the whole tensor alive
    return DTensor.from_local(
        local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters, counted on the unsharded shapes."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable
