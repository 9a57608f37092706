"""PURE but for listing a folder: which safetensors files hold a model's weights.

The trainer maps these files on every rank and reads each tensor's rows in place
(:mod:`ftjob.trainer.model.weights`); ``ftjob run``, ``ftjob validate`` and the trainer's first
check call :func:`folder_problem` to refuse, before torch starts, a model folder the trainer
could not read. Sources as users have them: a sharded checkpoint with its
``model.safetensors.index.json``, or one ``model.safetensors``. A checkpoint only in PyTorch's
pickle format (``pytorch_model*.bin``) is refused with the command that converts it once:
reading a pickle means unpickling it whole in memory on every rank, what the parallel loading
exists to avoid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("pytorch_model*.bin", "*.pt", "*.pth")
# What to change when a local model folder is missing (``ftjob run``, validate and the trainer).
MODEL_FIX = (
    "set spec.model.source to a Hugging Face model folder (with config.json; a relative path "
    "is read beside the job file, or from the volume on a cluster), or hf://org/name"
)


def convert_fix(folder: str) -> str:
    """The one-off conversion a pickled checkpoint needs (save_pretrained writes safetensors)."""
    return (
        'convert it to safetensors once, e.g. python -c "from transformers import '
        f"AutoModelForCausalLM as M; M.from_pretrained('{folder}', dtype='auto')"
        ".save_pretrained('OUT')\" (copy the tokenizer files too), and set spec.model.source "
        "to OUT"
    )


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the model in ``folder``, index first; [] when it has none.
    A malformed index raises ValueError (:func:`problem` says what to do about it)."""
    found = layout(folder)
    return found.files if found else []


@dataclass
class Layout:
    """Where a model folder's weights are: its safetensors files, and for a sharded checkpoint
    the file of each checkpoint key (the index's ``weight_map``; None for one file, whose
    header lists its keys)."""

    files: list[Path]
    where: dict[str, Path] | None


def layout(folder: Path) -> Layout | None:
    """The weights of the model in ``folder`` as its index (or single file) names them, None
    when it has neither; ValueError when the index is not the JSON ``save_pretrained`` writes
    (a truncated download)."""
    index = folder / INDEX
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"]
            where = {str(key): folder / name for key, name in names.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{INDEX} cannot be read ({type(err).__name__}: {err})") from err
        return Layout(sorted(set(where.values())), where)
    return Layout([folder / SINGLE], None) if (folder / SINGLE).is_file() else None


def folder_problem(folder: Path, source: str) -> tuple[str, str] | None:
    """Why ``folder`` (named ``source`` in the spec) is not a model folder the trainer can
    read (no such folder, no config.json, or no readable weights), and the fix; None when it
    is. What ``ftjob run``, ``ftjob validate`` and the trainer's first check all ask."""
    if not (folder / "config.json").is_file():
        what = "no such folder" if not folder.exists() else "no config.json in that folder"
        return f"{source}: {what} (looked at {folder})", MODEL_FIX
    return problem(folder, source)


def problem(folder: Path, source: str) -> tuple[str, str] | None:
    """Why the model in ``folder`` (named ``source`` in the spec) has no readable weights, and
    the fix; None when it has them. Index files that name missing shards count as missing."""
    return checked(folder, source)[1]


def checked(folder: Path, source: str) -> tuple[Layout | None, tuple[str, str] | None]:
    """(the weights' layout, None) when ``folder`` has readable weights, else (None, why and
    the fix), reading the index once."""
    try:
        found = layout(folder)
    except ValueError as err:
        return None, (
            f"model.source {source}: {err}",
            "download or copy the checkpoint again (its index is truncated or damaged)",
        )
    if found:
        absent = [f.name for f in found.files if not f.is_file()]
        if not absent:
            return found, None
        return None, (
            f"model.source {source}: {INDEX} names {len(absent)} file(s) that are not there "
            f"({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''})",
            "copy or download the whole checkpoint (every file its index names)",
        )
    pickled = sorted(p.name for pattern in PICKLED for p in folder.glob(pattern))
    if pickled:
        return None, (
            f"model.source {source}: the weights are in PyTorch's pickle format only "
            f"({', '.join(pickled[:3])}); ftjob reads safetensors, which every rank maps and "
            "reads its own part of",
            convert_fix(str(folder)),
        )
    return None, (
        f"model.source {source}: no weights ({SINGLE} or {INDEX}) in {folder}",
        "point spec.model.source at a model folder written by save_pretrained (a Hub "
        "repository with safetensors weights for hf://)",
    )
