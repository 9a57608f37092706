"""Sharded checkpoints on the shared volume: complete or invisible, newest one resumed.

Layout under ``FTJOB_JOB_DIR/checkpoints/``::

    step-00000200/          committed: DCP shards + .metadata, rng-rank*.pt, COMMITTED
    .tmp-step-00000300/     being written (or left by a crash): never read

Every rank writes its shards into the temporary folder (``torch.distributed.checkpoint``);
after a barrier rank 0 writes ``COMMITTED`` and renames the folder, an atomic step on POSIX
file systems. Resume takes the newest ``step-*`` folder holding ``COMMITTED``.

With ``asyncSave`` training pauses only to start a save. A copy of the state ("staging") is
taken on a background thread into buffers kept from one save to the next, while the next
step's forward and backward run; the step waits for it only before its optimizer update, the
first thing that changes the state being copied (``before_update``). The copy is then written
and committed on another thread, which the next save (or the end of training) waits for.
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ftjob.contract import CHECKPOINT_UNREADABLE, TrainerError

STEP_DIR = re.compile(r"^step-(\d{8})$")
COMMITTED = "COMMITTED"


def folder(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint, or None."""
    if not root.is_dir():
        return None
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / COMMITTED).is_file()]
    return max(found, key=lambda p: p.name, default=None)


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


# Frozen weights (the base under LoRA/QLoRA) are re-read from model.source on every start:
# checkpoints hold only what training changes, a few MB of adapters instead of the base.
# strict=False lets those frozen keys be absent; dcp.load still fails on any missing key of
# the state requested, which is every trainable one.
OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _state(model, optimizer, scheduler, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step}


def _rng() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class Checkpointer:
    """Saves every ``checkpoint.every`` steps, keeps ``keep``, optionally in the background."""

    def __init__(self, root: Path, rank: int, keep: int, async_save: bool):
        self.root, self.rank, self.keep, self.async_save = root, rank, keep, async_save
        self._pending: tuple[Future, Path, Path] | None = None
        self._staging: Future | None = None
        self._group = self._stager = None
        self._gpu = torch.cuda.is_available()
        if async_save:
            # Background saves run their collectives on their own gloo group, so they never
            # interleave with training's collectives (and work with NCCL training too).
            self._group = dist.new_group(backend="gloo")
            # Pinned buffers and non-blocking copies on a side stream where there is a GPU.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=self._gpu,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=self._gpu,
                )
            )

    def save(self, model, optimizer, scheduler, step: int) -> None:
        self.wait()
        final = folder(self.root, step)
        tmp = self.root / f".tmp-{final.name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crash's leftovers
            tmp.mkdir(parents=True)
        dist.barrier()
        # RNG is per rank; DCP would keep one copy of a plain tensor, so it gets its own file.
        torch.save(_rng(), tmp / f"rng-rank{self.rank}.pt")
        state = _state(model, optimizer, scheduler, step)
        if self.async_save:
            if self._gpu:
                # The copy runs on a side stream that does not wait for this one: let the
                # step's queued updates finish first.
                torch.cuda.current_stream().synchronize()
            response = dcp.async_save(
                state,
                checkpoint_id=str(tmp),
                process_group=self._group,
                async_stager=self._stager,
            )
            self._staging = response.staging_completion
            self._pending = (response.upload_completion, tmp, final)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._commit(tmp, final)

    def before_update(self) -> None:
        """Call before anything changes the weights or the optimizer's state: a background
        save may still be copying them."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def wait(self) -> None:
        """Finish and commit a background save (before the next one, whose copy reuses the
        same buffers, and at the end)."""
        self.before_update()
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        future.result()
        self._commit(tmp, final)

    def close(self) -> None:
        """Finish any background save and free the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _commit(self, tmp: Path, final: Path) -> None:
        dist.barrier()  # every rank's shards and RNG file are on disk
        if self.rank == 0:
            (tmp / COMMITTED).write_text(f"{step_of(final)}\n")
            _fsync_dir(tmp)
            shutil.rmtree(final, ignore_errors=True)  # a same-step leftover from a crash
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()

    def _prune(self) -> None:
        # Any temporary folder left now is a crashed save's (one save is in flight at a time).
        for leftover in self.root.glob(".tmp-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        done = sorted(p for p in self.root.iterdir() if STEP_DIR.match(p.name))
        committed = [p for p in done if (p / COMMITTED).is_file()]
        for old in committed[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model, optimizer, scheduler) -> int:
        """Restore model, optimizer, scheduler and this rank's RNG; return the step."""
        state = _state(model, optimizer, scheduler, 0)
        try:
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=OPTIONS,
            )
            scheduler.load_state_dict(state["scheduler"])
        except (Exception, CheckpointException) as e:  # dcp's is a BaseException
            raise TrainerError(
                f"checkpoint {path} cannot be loaded into this model ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); move it aside "
                "to resume from an older one, or start the job in a new folder",
                reason=CHECKPOINT_UNREADABLE,
                where=str(path),
            ) from e
        rng_file = path / f"rng-rank{self.rank}.pt"
        if not rng_file.exists():  # resumed with more ranks than saved: fresh RNG streams
            return int(state["step"])
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return int(state["step"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
