"""The reference model of DPO and of GRPO's KL term. With adapters (LoRA and QLoRA) it is the
same network with its adapters off (:func:`adapters_off`). A full fine-tune's DPO reference is
the initial model's response log-probabilities, once (:func:`attach`): a full fine-tune changes
every weight, so the reference is what the model computed *before* training:
every rank runs its share of the pairs through the sharded network it has just loaded (no
second copy of the model, ever), rank 0 writes the chosen and rejected log-probability of each
pair (2 x fp32: 8 bytes a pair) into the prepared data's folder on the volume, atomically, and
every rank memory-maps them. The folder's name hashes the model (its source and its weight
files' names, sizes and modification times, as the data key does for data files), the compute
precision and the pairs, so a restarted gang, or another job with the same model and data,
reuses them instead of running the pass again.

    python -m pytest tests/e2e/test_dpo_full.py -q
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ftjob.api.contract import BAD_SPEC, TrainerError
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.job import atomic
from ftjob.trainer.data import batches as data
from ftjob.trainer.model import load as model
from ftjob.trainer.model import parallel

LAYOUT = 1  # bump when what is stored, or how it is computed, changes
FILES = ("*.safetensors", "*.bin", "*.json")  # what names a model's version


@contextlib.contextmanager
def adapters_off(net):
    """The network without its adapters, for the reference forward.

    Not peft's ``disable_adapter``: it also sets requires_grad off and on again, on whatever
    parameter objects the modules hold at that moment. Under FSDP2 the root group's (the
    adapted output head's) are the unsharded ones after the reference forward, so the sharded
    adapters of the head were left marked frozen: they still trained, but checkpoints, which
    leave frozen parameters out, lacked them and resuming failed on a missing key (seen with
    the tiny model; tests/e2e/test_dpo_run.py resumes). Only the flag peft's layers read in
    their forward is set here.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in net.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise TrainerError(
            "the reference model (DPO's, GRPO's KL term) is the network without its "
            "adapters, and this one has none",
            reason=BAD_SPEC,
            fix="set spec.method.type: lora (or qlora)",
            where="spec.method.type",
        )
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield net
    finally:
        for layer in layers:
            layer._disable_adapters = False


def key(spec: FineTuneJobSpec, data_folder: Path, counts: dict[str, int]) -> str:
    """A hash of what changes the reference log-probabilities: the model, the compute
    precision, the prepared pairs (their data key) and how many of each split are used."""
    folder = Path(model.resolve(spec.model.source))
    files = []
    for pattern in FILES:
        for f in sorted(folder.glob(pattern)):
            st = f.stat()
            files.append([f.name, st.st_size, st.st_mtime_ns])
    settings = {
        "layout": LAYOUT,
        "model": [spec.model.source, spec.model.revision, str(folder.resolve()), files],
        "precision": spec.compute_precision(),
        "data": data_folder.name,
        "pairs": counts,
    }
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def attach(
    spec: FineTuneJobSpec,
    net: torch.nn.Module,
    ds: data.Data,
    d: parallel.Dist,
    goal,
    log: Callable[[str], None] = print,
) -> Path:
    """Give ``ds`` the reference log-probabilities of its pairs (``ds.reference``): reused
    from the volume, or computed by ``net`` (the initial model, before any step or resume)
    and stored there. Every rank calls it; returns the folder they are in."""
    splits = {"train": ds.train, **({"eval": ds.eval} if ds.eval is not None else {})}
    counts = {name: len(rows) for name, rows in splits.items()}
    folder = ds.folder / f"reference-{key(spec, ds.folder, counts)}"
    found = [(folder / "info.json").exists()]
    dist.broadcast_object_list(found, src=0)  # rank 0 decides: the ranks agree
    if found[0]:
        log(f"reference log-probs: reused from {folder}")
    else:
        began = time.monotonic()
        values = {name: _compute(net, ds, name, d, spec.training.micro_batch_size, goal)
                  for name in splits}  # fmt: skip
        if d.is_main:
            _write(folder, values, began)
        dist.barrier()  # written: every rank may map it
        pairs = sum(counts.values())
        seconds = time.monotonic() - began
        log(f"reference log-probs: computed for {pairs:,} pairs in {seconds:.1f} s into {folder}")
    ds.reference = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in splits}
    return folder


@torch.no_grad()
def _compute(net, ds: data.Data, split: str, d: parallel.Dist, micro_batch: int, goal):
    """[n, 2] fp32: each pair's chosen and rejected response log-probability under ``net``,
    every rank computing pairs rank, rank + world, ...; rank 0 gets all of them (None
    elsewhere). Every rank runs the same number of forwards (FSDP needs all of them)."""
    n = len(ds.train if split == "train" else ds.eval)
    mine = list(range(d.rank, n, d.world_size))
    forwards = math.ceil(n / d.world_size / micro_batch)
    width = forwards * micro_batch
    got = torch.full((width, 3), -1.0, dtype=torch.float64, device=d.device)
    was_training = net.training
    net.eval()
    for b in range(forwards):
        indices = mine[b * micro_batch : (b + 1) * micro_batch]
        rows = ds.rows(indices or [0], split)
        logps = goal.policy_logps(net, goal.collate(rows, ds.pad_id), d.device)
        chosen, rejected = logps.double().chunk(2)
        for j, i in enumerate(indices):
            got[b * micro_batch + j, 0] = i
            got[b * micro_batch + j, 1:] = torch.stack([chosen[j], rejected[j]])
    net.train(was_training)
    every = [torch.empty_like(got) for _ in range(d.world_size)]
    dist.all_gather(every, got)
    if not d.is_main:
        return None
    table = np.full((n, 2), np.nan, dtype=np.float32)
    for part in every:
        part = part.cpu().numpy()
        part = part[part[:, 0] >= 0]
        table[part[:, 0].astype(np.int64)] = part[:, 1:]
    return table


def _write(folder: Path, values: dict[str, np.ndarray], began: float) -> None:
    """The arrays and an info.json, renamed into place at once (a crash leaves no half)."""
    with atomic.new_folder(folder) as tmp:
        for name, table in values.items():
            np.save(tmp / f"{name}.npy", table)
        info = {"pairs": {k: len(v) for k, v in values.items()},
                "seconds": round(time.monotonic() - began, 1)}  # fmt: skip
        (tmp / "info.json").write_text(json.dumps(info, indent=1))
