"""A model's safetensors checkpoint, read in place: which file holds each of the model's
tensors, and each tensor's rows copied straight out of the file's memory mapping.

Every rank opens the files itself (``safe_open``: a memory mapping, nothing read yet) and
copies out only the rows it keeps, in the training dtype, onto the device they will live on.
The rows of a tensor are contiguous in the file, so a rank's read touches its own pages and
no others; the page cache is shared by the ranks of a node. One file is mapped at a time and
closed when its tensors are done, so a rank's file-backed memory stays within one file's
share. This is what torch's DCP Hugging Face reader does inside (``get_slice``), without
DCP's planning and closing collectives: no rank waits in a collective for another's read.

Checkpoint names are mapped to the model's with transformers' own key renamings
(``get_model_conversion_mapping``), the ones ``from_pretrained`` applies. Checkpoints that
transformers must convert while loading (e.g. MoE experts stored one tensor per expert and
merged into one on load) are refused: their tensors are not the model's, row for row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ftjob.api import contract
from ftjob.job import modelfiles


class SourceError(contract.TrainerError, ValueError):
    """The model cannot be read (no folder, no weights, or not this model's tensors); the
    message names the source."""

    reason = contract.BAD_MODEL


class Checkpoint:
    """The tensors of ``folder``'s checkpoint under the names of ``model`` (a transformers
    model; a peft-wrapped one's adapters are not in it), and the bytes this process has read.

    Which file holds each key comes from the index's ``weight_map`` (read once); only a
    single-file checkpoint's header is opened to list its keys. At 405B that spares each of
    a gang's ranks opening every one of ~190 headers before it reads a row."""

    def __init__(self, folder: Path, source: str, model: nn.Module):
        layout, found = modelfiles.checked(folder, source)
        if found:
            raise SourceError(found[0], where="spec.model.source", fix=found[1])
        self.files = layout.files
        self.source = source
        self.where: dict[str, tuple[Path, str]] = {}  # model name -> (file, checkpoint key)
        keys = layout.where
        if keys is None:
            with safe_open(layout.files[0], framework="pt") as f:  # reads the header only
                keys = dict.fromkeys(f.keys(), layout.files[0])
        rename = _renamer(model)
        for key, path in keys.items():
            self.where[rename(key)] = (path, key)
        self.read_bytes = 0

    def find(self, names: Iterable[str]) -> str | None:
        """The first of ``names`` (one tensor's names: tied weights have two) it holds."""
        return next((n for n in names if n in self.where), None)

    def tensors(self, names: Iterable[str]) -> Iterator[tuple[str, object]]:
        """(name, lazy slice) for each of ``names``, file by file; :func:`read` copies rows out
        of a slice. Each file's mapping is closed once its tensors are done."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.where[name][0], []).append(name)
        for path in self.files:
            if path not in by_file:
                continue
            with safe_open(path, framework="pt") as f:
                for name in by_file[path]:
                    yield name, f.get_slice(self.where[name][1])

    def read(self, part, rows: tuple[slice, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """``rows`` of a lazy slice, copied into a new tensor of ``dtype`` on ``device``.

        The slice is a view of the mapped file: the copy reads only its pages, and the cast
        happens in the same copy (no second tensor in the file's dtype)."""
        view = part[rows] if rows else part[:]
        out = torch.empty(view.shape, dtype=dtype, device=device)
        out.copy_(view)
        self.read_bytes += view.nbytes
        return out


def _renamer(model: nn.Module):
    """Checkpoint key -> the model's name, as ``from_pretrained`` maps it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    # The base model's names (peft renames each adapted weight to ...base_layer.weight), with
    # their tensors: transformers' prefix rule (add or strip base_model_prefix) looks each key
    # up here with .get() and takes a None value for a name the model does not have.
    names = {base_name(n): t for n, t in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", None)

    def rename(key: str) -> str:
        name, converted = rename_source_key(key, renamings, converters, prefix, names)
        if converted is not None:
            raise SourceError(
                f"{type(model).__name__}: checkpoint tensor {key} is converted by transformers "
                "while loading (several checkpoint tensors make one of the model's); ftjob "
                "reads each tensor of the checkpoint as one of the model's",
                where="spec.model.source",
                fix="fine-tune a model whose checkpoint tensors are its parameters (dense "
                "decoders such as Llama, Mistral, Qwen2)",
            )
        return name

    return rename


def base_name(name: str) -> str:
    """The base model's (the checkpoint's) name of a parameter of the peft-wrapped model."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")
