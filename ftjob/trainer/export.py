"""The exported model, written once after the last step, atomically.

* full fine-tune: a consolidated Hugging Face folder (config, tokenizer, safetensors);
* lora / qlora: the peft adapter and tokenizer, plus ``merged/`` (the base model with the
  adapter merged in, full precision) when ``output.mergeAdapter``.

A full fine-tune's shards are gathered to rank 0's CPU memory (``get_model_state_dict(
full_state_dict=True, cpu_offload=True)``); an adapter job gathers only what trained (the
frozen base, bf16 or NF4, is never gathered: the merge re-reads it from the source in its
original precision, so merging does not inherit the 4-bit rounding of QLoRA's base). The
folder is written to ``.tmp-<name>`` beside the target, then renamed into place.
Reload it with ``AutoModelForCausalLM.from_pretrained(path)`` or
``PeftModel.from_pretrained(base, path)``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from ftjob.spec import FineTuneJobSpec
from ftjob.trainer.model import hub_kwargs, resolve


def target(spec: FineTuneJobSpec, job_dir: Path) -> Path:
    return job_dir / (spec.output.path or "model")


def export(
    model: nn.Module, spec: FineTuneJobSpec, tok: PreTrainedTokenizerBase, out: Path, rank: int
) -> None:
    """Gather the trained weights and write the export (collective; rank 0 writes)."""
    if spec.method.type == "full":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
    else:
        state = _trained(model)
    if rank == 0:
        tmp = out.with_name(f".tmp-{out.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        if spec.method.type == "full":
            _save_full(state, spec, tmp)
        else:
            _save_adapter(model, state, tmp)
            if spec.output.merge_adapter:
                _save_merged(spec, tmp, tmp / "merged")
                tok.save_pretrained(tmp / "merged")
        tok.save_pretrained(tmp)
        _replace(tmp, out)
    dist.barrier()


def _trained(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full tensors of what trained, on CPU (collective: every rank gathers in turn)."""
    state = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            state[name] = full.detach().cpu()
    return state


def _save_full(state: dict[str, torch.Tensor], spec: FineTuneJobSpec, tmp: Path) -> None:
    config = AutoConfig.from_pretrained(resolve(spec.model.source), **hub_kwargs(spec))
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    # A tied output head shares the embedding's tensor and may be absent from the state.
    tied = set(getattr(fresh, "_tied_weights_keys", None) or [])
    if unexpected or (set(missing) - tied):
        raise RuntimeError(f"export: state does not fit the model: {missing=} {unexpected=}")
    fresh.tie_weights()
    _to_saved_dtype(fresh, config)
    fresh.save_pretrained(tmp)


def _to_saved_dtype(model: nn.Module, config) -> None:
    # Training keeps fp32 masters; the export takes the dtype the base model was published in.
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype != torch.float32:
        model.to(dtype)


def _save_adapter(model: nn.Module, state: dict[str, torch.Tensor], tmp: Path) -> None:
    # peft picks the adapter's tensors out of the state (names without the adapter name).
    state = {k: v.contiguous() for k, v in state.items() if "lora_" in k}
    model.save_pretrained(str(tmp), state_dict=state)


def _save_merged(spec: FineTuneJobSpec, adapter: Path, tmp: Path) -> None:
    from peft import PeftModel

    path = resolve(spec.model.source)
    config = AutoConfig.from_pretrained(path, **hub_kwargs(spec))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **hub_kwargs(spec))
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    _to_saved_dtype(merged, config)
    merged.save_pretrained(tmp)


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an older export is swapped out, then removed."""
    old = out.with_name(f".old-{out.name}")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
