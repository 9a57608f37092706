"""The gang takes the job folder: rank 0 takes its owner lease (ftjob.job.lease) for this run,
and every rank gets rank 0's answer in one collective, so a run that may not write there
stops on all ranks at once.

Here, in the trainer, and not in ftjob.job.lease: taking is a torch collective, and ``ftjob
run`` reads the lease without torch.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ftjob.api.contract import INTERNAL, TrainerError
from ftjob.job.folder import OWNER
from ftjob.job.lease import LEASE_SECONDS, Lease
from ftjob.trainer.state import volume

_held: Lease | None = None  # this process's lease (rank 0 of a gang)


def take_folder(job_dir: Path, rank: int, wait_seconds: float = 2 * LEASE_SECONDS) -> Lease | None:
    """A collective: rank 0 takes the job folder for this run; every rank raises the same
    TrainerError if it may not. Returns rank 0's lease (None on the other ranks). The other
    ranks wait in a collective meanwhile: keep ``wait_seconds`` below its timeout."""
    global _held
    lease, refusal = None, None
    if rank == 0:
        job_dir.mkdir(parents=True, exist_ok=True)
        lease = Lease(job_dir)
        try:
            lease.take(wait_seconds)
            _held = lease
        except OSError as e:  # the owner file cannot be written (a full or read-only volume)
            named = volume.write_failed(e, f"taking the job folder ({OWNER})", job_dir, INTERNAL)
            refusal = (str(named), named.reason, named.where)
        except TrainerError as e:
            refusal = (str(e), e.reason, e.where)
    answer = [refusal]
    dist.broadcast_object_list(answer, src=0)
    if answer[0] is not None:
        message, reason, where = answer[0]
        raise TrainerError(message, reason=reason, where=where)
    return lease


def release_held() -> None:
    """Give the folder up from this process (a gang that will not restart in place)."""
    if _held is not None:
        _held.release()
