"""Tokenizer and model: read once on rank 0, built empty elsewhere, adapters applied.

The order follows torchtune's ``_setup_model``: :func:`build` gives every rank the
architecture on the meta device (no memory) and rank 0 also the weights, read in the
checkpoint's dtype; the caller shards the model (:mod:`ftjob.trainer.parallel`);
:func:`materialize` then gives every rank its fp32 shards of rank 0's weights by broadcast. A
70B model is thus read from disk once for the whole gang, not once per GPU.

QLoRA is the exception: 4-bit weights are made while loading, on every rank, and stay whole
(FSDP2 does not shard bitsandbytes' packed 4-bit tensors reliably, FINDINGS.md); only the
adapters and the other trainable or full-precision tensors are sharded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ftjob import contract
from ftjob.spec import FineTuneJobSpec
from ftjob.trainer.parallel import Dist

# Benchmark switch only: every rank reads the weights itself (to measure what rank-0 loading
# saves). Off in every real run.
LOAD_ON_ALL_RANKS = "FTJOB_LOAD_ON_ALL_RANKS"


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


@dataclass
class Built:
    """A model before sharding, with what :func:`materialize` needs afterwards."""

    model: nn.Module
    # Rank 0's full state in the checkpoint's dtype, and the non-persistent buffers (rotary
    # inv_freq) outside it, to broadcast; empty on the other ranks.
    full_state: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    on_meta: bool = True  # False: this rank built real weights itself (QLoRA, benchmark)
    read_weights: bool = False  # this rank read the weight files
    # Parameters FSDP leaves whole on every rank (QLoRA's 4-bit base weights).
    ignored: set[nn.Parameter] = field(default_factory=set)


def build(spec: FineTuneJobSpec, d: Dist, tokenizer: PreTrainedTokenizerBase) -> Built:
    """The model with adapters applied, on the meta device; rank 0 also reads the weights."""
    path, hub = resolve(spec.model.source), hub_kwargs(spec)
    common = dict(attn_implementation=spec.model.attention, **hub)
    if spec.method.type == "qlora":
        return _build_qlora(spec, d, tokenizer, path, common)
    if os.environ.get(LOAD_ON_ALL_RANKS) == "1":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **common)
        _prepare(model, tokenizer)
        return Built(_adapters(model, spec), on_meta=False, read_weights=True)
    config = AutoConfig.from_pretrained(path, **hub)
    with torch.device("meta"):  # fp32 master weights; costs no memory until sharded
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=torch.float32,
            attn_implementation=spec.model.attention,
            trust_remote_code=spec.model.trust_remote_code,
        )
    _prepare(model, tokenizer)
    model = _adapters(model, spec)
    if not d.is_main:
        return Built(model)
    # Rank 0 reads the weights in the checkpoint's own dtype (bf16 for most LLMs: half the
    # memory of fp32); they are copied into the fp32 shards. Adapters get rank 0's init.
    source = AutoModelForCausalLM.from_pretrained(path, dtype="auto", **common)
    _prepare(source, tokenizer)
    source = _adapters(source, spec)
    state = source.state_dict()
    buffers = {n: b for n, b in source.named_buffers() if n not in state}
    return Built(model, full_state=state, buffers=buffers, read_weights=True)


def _build_qlora(
    spec: FineTuneJobSpec, d: Dist, tokenizer: PreTrainedTokenizerBase, path: str, common: dict
) -> Built:
    from transformers import BitsAndBytesConfig

    q = spec.method.quantization
    compute = torch.bfloat16 if spec.compute_precision() == "bf16" else torch.float32
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=torch.uint8,
    )
    device_map = {"": d.device.index if d.device.type == "cuda" else "cpu"}
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb, dtype=torch.float32, device_map=device_map, **common
    )
    _prepare(model, tokenizer)
    for module in model.modules():
        # bitsandbytes repacks 4-bit weights in place for fast CPU inference under no_grad
        # (our eval); that needs out_features % 32 == 0 and changes what training then reads.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model = _adapters(model, spec)
    ignored = {p for p in model.parameters() if type(p).__name__ == "Params4bit"}
    return Built(model, on_meta=False, read_weights=True, ignored=ignored)


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
    # Adapter init draws random numbers: the same seed everywhere gives QLoRA (built on every
    # rank) identical adapters; other methods take rank 0's by broadcast anyway.
    torch.manual_seed(spec.training.seed)
    return get_peft_model(model, config)


def materialize(built: Built, d: Dist, cpu_offload: bool = False) -> None:
    """After sharding: give every rank its shards of rank 0's weights (collective)."""
    model = built.model
    if not built.on_meta:
        return  # every rank loaded real weights itself (QLoRA, or the benchmark switch)
    # Offloaded shards live in CPU memory; FSDP moves them to the GPU one layer at a time.
    model.to_empty(device="cpu" if cpu_offload else d.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, built.full_state, options=options)
    # Buffers outside the state dict (rotary inv_freq) are garbage after to_empty: copy rank 0's.
    buffers = dict(model.named_buffers())
    state_keys = set(model.state_dict().keys())
    for name in sorted(n for n in buffers if n not in state_keys):
        if d.is_main:
            buffers[name].copy_(built.buffers[name].to(buffers[name].device))
        dist.broadcast(buffers[name], src=0)
    built.full_state.clear()
    built.buffers.clear()


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters, counted on the unsharded shapes."""
    total = trainable = 0
    for p in model.parameters():
        n = p.numel() * (2 if type(p).__name__ == "Params4bit" else 1)  # two 4-bit per byte
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable
