"""PURE but for listing a folder: which safetensors files hold a model's weights.

The trainer maps these files on every rank and reads each tensor's rows in place
(:mod:`ftjob.trainer.weights`); ``ftjob run`` and ``ftjob validate`` call :func:`problem` to
refuse, before torch starts, a model folder the trainer could not read. Sources as users have
them: a sharded checkpoint with its ``model.safetensors.index.json``, or one
``model.safetensors``. A checkpoint only in PyTorch's pickle format (``pytorch_model*.bin``)
is refused with the command that converts it once: reading a pickle means unpickling it whole
in memory on every rank, what the parallel loading exists to avoid.
"""

from __future__ import annotations

import json
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("pytorch_model*.bin", "*.pt", "*.pth")


def convert_fix(folder: str) -> str:
    """The one-off conversion a pickled checkpoint needs (save_pretrained writes safetensors)."""
    return (
        'convert it to safetensors once, e.g. python -c "from transformers import '
        f"AutoModelForCausalLM as M; M.from_pretrained('{folder}', dtype='auto')"
        ".save_pretrained('OUT')\" (copy the tokenizer files too), and set spec.model.source "
        "to OUT"
    )


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the model in ``folder``, index first; [] when it has none."""
    index = folder / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    return [folder / SINGLE] if (folder / SINGLE).is_file() else []


def problem(folder: Path, source: str) -> tuple[str, str] | None:
    """Why the model in ``folder`` (named ``source`` in the spec) has no readable weights, and
    the fix; None when it has them. Index files that name missing shards count as missing."""
    files = weight_files(folder)
    if files:
        absent = [f.name for f in files if not f.is_file()]
        if not absent:
            return None
        return (
            f"model.source {source}: {INDEX} names {len(absent)} file(s) that are not there "
            f"({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''})",
            "copy or download the whole checkpoint (every file its index names)",
        )
    pickled = sorted(p.name for pattern in PICKLED for p in folder.glob(pattern))
    if pickled:
        return (
            f"model.source {source}: the weights are in PyTorch's pickle format only "
            f"({', '.join(pickled[:3])}); ftjob reads safetensors, which every rank maps and "
            "reads its own part of",
            convert_fix(str(folder)),
        )
    return (
        f"model.source {source}: no weights ({SINGLE} or {INDEX}) in {folder}",
        "point spec.model.source at a model folder written by save_pretrained (a Hub "
        "repository with safetensors weights for hf://)",
    )
