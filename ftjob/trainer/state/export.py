"""The exported model, written once after the last step, atomically.

* full fine-tune: a consolidated Hugging Face folder (config, tokenizer, safetensors);
* lora / qlora: the peft adapter and tokenizer, plus ``merged/`` (the base model with the
  adapter merged in, full precision) when ``output.mergeAdapter``.

A full fine-tune's shards are gathered to rank 0's CPU memory (``get_model_state_dict(
full_state_dict=True, cpu_offload=True)``); an adapter job gathers only what trained (the
frozen base, bf16 or NF4, is never gathered: the merge re-reads it from the source in its
original precision, so merging does not inherit the 4-bit rounding of QLoRA's base). The
folder is written to ``.tmp-<name>`` beside the target, then swapped into place
(:func:`ftjob.job.folder.swap_in_export`: an older export stays readable until the new one is
complete). Its files follow the process umask like the rest of the job folder (safetensors
writes 0600), so a serving pod running as another user reads them; an adapter names the
job's model source as its base so that it loads from anywhere: ``org/name`` for
``hf://org/name`` (not the download's cache folder), the absolute path for a local source (a
relative one would be read from wherever the loader happens to run); peft's model card
beside it names the same Hub id, or no base for a local one.
Reload it with ``AutoModelForCausalLM.from_pretrained(path)`` or
``PeftModel.from_pretrained(base, path)``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.jobspec.model import ModelSpec
from ftjob.api.source import S3, Hub, parse
from ftjob.job import folder as jobfolder
from ftjob.trainer.model.load import resolve, source_options

if TYPE_CHECKING:  # imported by the phase that uses it: see ftjob/trainer/report/startup.py
    from transformers import PreTrainedTokenizerBase


def export(
    model: nn.Module,
    spec: FineTuneJobSpec,
    tok: PreTrainedTokenizerBase,
    out: Path,
    rank: int,
    asked: FineTuneJobSpec | None = None,
) -> None:
    """Gather the trained weights and write the export (collective; rank 0 writes).
    ``asked`` is the spec as the job gave it (``spec`` may name a downloaded copy): its model
    source is the base an adapter names."""
    if spec.method.type == "full":
        # DCP's gather (FSDP and DTensor come with it): the export's, not start-up's
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

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
            _name_base(tmp, (asked or spec).model)
        tok.save_pretrained(tmp)
        readable_like_the_folder(tmp)
        jobfolder.swap_in_export(tmp, out)
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
    from transformers import AutoConfig, AutoModelForCausalLM  # loaded since the model's build

    config = AutoConfig.from_pretrained(resolve(spec.model.source), **source_options(spec))
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
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve(spec.model.source)
    config = AutoConfig.from_pretrained(path, **source_options(spec))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **source_options(spec))
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    _to_saved_dtype(merged, config)
    merged.save_pretrained(tmp)


def base_name(source: str) -> str:
    """The base an adapter names: the Hub id of ``hf://org/name``, else the absolute path of
    the source (beside the job file under ``ftjob run``, on the volume in a pod)."""
    found = parse(source)
    if isinstance(found, Hub):
        return found.repo
    if isinstance(found, S3):
        return source  # where the base lives for everyone, not this volume's cached copy
    return os.path.abspath(resolve(source))


def _name_base(adapter: Path, model: ModelSpec) -> None:
    # peft records the folder the base was read from: a cache or mount of this machine.
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_name(model.source)
    if isinstance(parse(model.source), Hub) and model.revision:
        config["revision"] = model.revision
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _name_card_base(adapter / "README.md", model)


def _name_card_base(card_file: Path, model: ModelSpec) -> None:
    """peft's card names the folder the base was read from too; a card's base_model is a
    Hub id (the Hub links it), so a local base is left out there."""
    if not card_file.is_file():
        return
    from huggingface_hub import ModelCard

    card = ModelCard.load(card_file)
    hub = isinstance(parse(model.source), Hub)
    card.data.base_model = base_name(model.source) if hub else None
    # ... and tags it "base_model:adapter:<that folder>".
    tags = [t for t in card.data.tags or [] if not str(t).startswith("base_model:")]
    card.data.tags = tags + ([f"base_model:adapter:{base_name(model.source)}"] if hub else [])
    card.save(card_file)


def readable_like_the_folder(folder: Path) -> None:
    """Give every file and folder under ``folder`` the mode the process umask gives new ones
    (safetensors writes its files 0600; a reader with another uid must open them)."""
    probe = folder / ".umask-probe"
    probe.mkdir()  # what mkdir gives is 0o777 less the umask (os.umask() would have to set it)
    umask = ~probe.stat().st_mode & 0o777
    probe.rmdir()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
