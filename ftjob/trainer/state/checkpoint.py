"""Sharded checkpoints on the shared volume: complete or invisible, newest one resumed.

Layout under ``FTJOB_JOB_DIR/checkpoints/``::

    step-00000200/          committed: DCP shards + .metadata, rng-rank*.pt, COMMITTED
    .tmp-step-00000300/     being written (or left by a crash): never read

``rng-rank<r>.pt`` is what rank r alone holds: its RNG streams, and what its objective keeps
between steps (GRPO's generation batch inside numIterations).

Every rank writes its shards into the temporary folder (``torch.distributed.checkpoint``)
and takes their checksums; rank 0 writes the manifest of all of them as ``COMMITTED``
(:mod:`ftjob.trainer.state.integrity`) and renames the folder, an atomic step on POSIX file
systems. Resume takes the newest ``step-*`` folder whose files match its manifest; a damaged
one is moved to ``damaged/`` and the one before it is used. A save that fails (a full
volume) fails the same way on every rank, with its temporary folder removed: the committed
checkpoints stay as they were.

With ``asyncSave`` training pauses only to start a save. A copy of the state ("staging") is
taken on a background thread into buffers kept from one save to the next, while the next
step's forward and backward run; the step waits for it only before its optimizer update, the
first thing that changes the state being copied (``before_update``). The copy is then written
and committed on another thread, which the next save (or the end of training) waits for.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from ftjob.api.contract import CHECKPOINT_UNREADABLE, INTERNAL, TrainerError
from ftjob.job.folder import BEING_WRITTEN, STEP, step_folder, writing
from ftjob.trainer.state import integrity, volume
from ftjob.trainer.state.integrity import COMMITTED

# torch.distributed.checkpoint (DCP: FSDP, DTensor and sympy come with it, a second of CPU)
# is imported where a checkpoint is made, saved or loaded, not at the trainer's start; the
# folders' listing and checks below need none of it.

STEP_DIR = STEP  # the job folder names its checkpoints (ftjob.job.folder)


def folder(root: Path, step: int) -> Path:
    return step_folder(root, step)


def committed(root: Path) -> list[Path]:
    """Committed checkpoints (holding a manifest), newest first; not yet verified."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / COMMITTED).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint, or None (not verified: see :func:`choose`)."""
    return next(iter(committed(root)), None)


def choose(root: Path, rank: int, world: int) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint (or None) and what was found wrong on the way.

    A collective: every rank checks its share of each candidate and all ranks agree on the
    result. Damaged folders are moved to ``damaged/`` by rank 0.
    """
    notes = []
    candidates = [committed(root)]
    dist.broadcast_object_list(candidates, src=0)  # rank 0's listing: one list for all ranks
    for path in candidates[0]:
        mine = integrity.problems(path, rank, world)
        found = [None] * world
        dist.all_gather_object(found, mine)
        wrong = [p for per_rank in found for p in per_rank]
        if not wrong:
            return path, notes
        if rank == 0:
            try:
                where = f"moved to {integrity.move_aside(path)}"
            except OSError as e:  # checked again next time; never deleted
                where = f"left in place ({e.strerror})"
            notes.append(f"checkpoint {path} is damaged ({'; '.join(wrong[:3])}); {where}")
        dist.barrier()  # the next candidate is read only once this one is out of the way
    return None, notes


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def options():
    """The state-dict options of every save and load.

    Frozen weights (the base under LoRA/QLoRA) are re-read from model.source on every start:
    checkpoints hold only what training changes, a few MB of adapters instead of the base.
    strict=False lets those frozen keys be absent; dcp.load still fails on any missing key of
    the state requested, which is every trainable one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _state(model, optimizer, scheduler, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=options())
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step}


def _rng() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class Checkpointer:
    """Saves every ``checkpoint.every`` steps, keeps ``keep``, optionally in the background.

    ``fence`` is called on rank 0 just before a checkpoint is committed; it raises a
    TrainerError when this run may no longer write the job folder (:mod:`ftjob.job.lease`).
    """

    def __init__(self, root: Path, rank: int, keep: int, async_save: bool, fence=None):
        self.root, self.rank, self.keep, self.async_save = root, rank, keep, async_save
        self.world = dist.get_world_size()
        self.fence = fence or (lambda: None)
        self._pending: tuple[Future, Path, Path] | None = None
        self._staging: Future | None = None
        self._group = self._stager = self._hasher = None
        self._size: int | None = None  # bytes of the last checkpoint: what the next needs
        # How long the last save took to be written, start to files on the volume; None
        # before the first (a SIGTERM's save must fit the grace period: expected_seconds).
        self.seconds: float | None = None
        self._began = 0.0
        self._gpu = torch.cuda.is_available()
        if async_save:
            # Background saves run their collectives on their own gloo group, so they never
            # interleave with training's collectives (and work with NCCL training too).
            self._group = dist.new_group(backend="gloo")
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ftjob-checksums")
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Pinned buffers and non-blocking copies on a side stream where there is a GPU.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=self._gpu,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=self._gpu,
                )
            )

    def save(self, model, optimizer, scheduler, step: int, own: dict | None = None) -> None:
        """``own``: what this rank holds that no other does and the next run needs (the
        objective's, e.g. GRPO's generation batch), kept beside its RNG streams."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self.wait()
        self._began = time.monotonic()
        final = folder(self.root, step)
        tmp = writing(final)
        error = None
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # a crash's leftovers
                tmp.mkdir(parents=True)
            except OSError as e:
                error = e
        self._agree(error, tmp)  # also the barrier before anyone writes into tmp
        try:
            # RNG is per rank; DCP would keep one copy of a plain tensor: its own file.
            torch.save({**_rng(), "own": own}, tmp / f"rng-rank{self.rank}.pt")
        except OSError as e:
            error = e
        self._agree(error, tmp)
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
            # The checksums are taken in the background too, once the files are written.
            upload = response.upload_completion
            sums = self._hasher.submit(lambda: (upload.result(), self._written(tmp))[1])
            self._pending = (sums, tmp, final)
        else:
            sums = {}
            try:
                dcp.save(state, checkpoint_id=str(tmp))
                sums = self._written(tmp)
            except (OSError, CheckpointException) as e:  # DCP fails on every rank alike
                error = e
            self._agree(error, tmp)
            self._commit(tmp, final, sums)

    def _written(self, tmp: Path) -> dict[str, dict]:
        """This rank's checksums once its files are written, and the save's time so far."""
        sums = self._checksums(tmp)
        self.seconds = time.monotonic() - self._began
        return sums

    def expected_seconds(self, planned: float) -> float:
        """How long a save now would take: the last one's measured time (``planned``, the
        planner's, before any), twice while a background save must still be finished first."""
        each = self.seconds if self.seconds is not None else planned
        return 2 * each if self._pending is not None else each

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
        from torch.distributed.checkpoint.api import CheckpointException

        future, tmp, final = self._pending
        self._pending = None
        error, sums = None, {}
        try:
            sums = future.result()
        except (OSError, CheckpointException) as e:
            error = e
        self._agree(error, tmp)
        self._commit(tmp, final, sums)

    def close(self) -> None:
        """Finish any background save and free the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    def _checksums(self, tmp: Path) -> dict[str, dict]:
        """Sizes and CRC-32 of this rank's share of a written checkpoint (DCP's save ends
        with a collective: every rank's files are there; this rank's are in its page cache)."""
        names = [p.name for p in tmp.iterdir()]
        return integrity.checksums(tmp, integrity.share(names, self.rank, self.world))

    def _commit(self, tmp: Path, final: Path, sums: dict[str, dict]) -> None:
        error = None
        gathered = [None] * self.world
        dist.all_gather_object(gathered, sums)
        if self.rank == 0:
            files = {name: entry for part in gathered for name, entry in part.items()}
            try:
                self.fence()
                (tmp / COMMITTED).write_text(integrity.manifest(step_of(final), files))
                _fsync_dir(tmp)
                shutil.rmtree(final, ignore_errors=True)  # a same-step leftover from a crash
                os.rename(tmp, final)
                _fsync_dir(self.root)
            except (OSError, TrainerError) as e:
                error = e
            else:
                self._size = sum(entry["size"] for entry in files.values())
                self._prune()
        self._agree(error, tmp)

    def _agree(self, error: BaseException | None, tmp: Path) -> None:
        """A collective: raise the same TrainerError on every rank when any rank's write
        failed, once the temporary folder is removed (it holds space the next save needs)."""
        mine = None
        if error is not None:
            named = error if isinstance(error, TrainerError) else self._named(error, tmp)
            mine = (str(named), named.reason, named.where)
        found = [None] * self.world
        dist.all_gather_object(found, mine)
        failed = next((f for f in found if f is not None), None)
        if failed is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        message, reason, where = mine or failed
        raise TrainerError(message, reason=reason, where=where) from error

    def _named(self, error: BaseException, tmp: Path) -> TrainerError:
        what = f"checkpoint {tmp.name.removeprefix('.tmp-')} (rank {self.rank})"
        needed = self._size or volume.size_of(latest(self.root))
        named = volume.write_failed(error, what, self.root, INTERNAL, needed)
        return named or TrainerError(f"{what} failed: {volume.summary(error)}", reason=INTERNAL)

    def _prune(self) -> None:
        # Any temporary folder left now is a crashed save's (one save is in flight at a time).
        for leftover in self.root.glob(BEING_WRITTEN):
            shutil.rmtree(leftover, ignore_errors=True)
        for old in committed(self.root)[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model, optimizer, scheduler) -> tuple[int, dict | None]:
        """Restore model, optimizer, scheduler and this rank's RNG; return the step and what
        the rank saved as its own (None where it saved none, or the gang grew).

        The files were verified (:func:`choose`); what fails now does not fit this job (a
        changed model or method) and is named as such rather than as a traceback."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _state(model, optimizer, scheduler, 0)
        try:
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=options(),
            )
            scheduler.load_state_dict(state["scheduler"])
        except (Exception, CheckpointException) as e:  # dcp's is a BaseException
            last = (str(e).strip().splitlines() or [""])[-1][:300]
            raise TrainerError(
                f"checkpoint {path} is intact but cannot be loaded into this job "
                f"({type(e).__name__}: {last}). "
                "Is it another model's or method's (checkpoint.resumeFrom)? Name a checkpoint "
                "of this model and method, or start without one.",
                reason=CHECKPOINT_UNREADABLE,
                where=str(path),
            ) from e
        rng_file = path / f"rng-rank{self.rank}.pt"
        if not rng_file.exists():  # resumed with more ranks than saved: fresh RNG streams
            return int(state["step"]), None
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return int(state["step"]), rng.get("own")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
