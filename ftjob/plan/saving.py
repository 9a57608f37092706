"""PURE: what saving a checkpoint costs: its bytes, about how long a save to the shared volume
takes, and the pods' grace period that leaves a SIGTERM time for it (the operator's
terminationGracePeriodSeconds; the trainer's save on SIGTERM, trainer/gang/preempt.py)."""

from __future__ import annotations

import math

from ftjob.plan.modelshape import DTYPE_BYTES

# A save to the shared volume, for the grace period a SIGTERM leaves (ftjob.trainer.gang.preempt,
# the operator's terminationGracePeriodSeconds): what a node's client of a network file system
# (NFS, EFS, FSx for Lustre at its smaller sizes) writes at least, and the fixed part (the
# collectives, the checksums' manifest, fsync and the commit's rename). The trainer prefers
# the time it measured on its own last save. An assumption, not a measurement of a network
# volume (none here): a local disk took 884 MiB from 2 ranks in 1.28 s, ~690 MB/s
# (bench/RESULTS.md, the checkpoint suite), so this errs towards a longer grace period.
SAVE_BYTES_PER_SECOND_PER_NODE = 200e6
SAVE_FIXED_SECONDS = 2.0


def checkpoint_bytes(trainable: int) -> float:
    """What a checkpoint holds: the trained weights and their two AdamW moments, fp32."""
    return 3 * trainable * DTYPE_BYTES["float32"]


# terminationGracePeriodSeconds: Kubernetes' default of 30 s twice over at least, as before the
# save on SIGTERM existed; otherwise the planner's save time with a margin of GRACE_MARGIN (a
# busy volume, a slow step still to finish: the gang stops at a step boundary first).
MIN_GRACE_SECONDS = 60
GRACE_MARGIN = 2.0


def grace_period_seconds(saved_bytes: float, nodes: int, given: int | None = None) -> int:
    """PURE: the pods' grace period: ``given`` (spec.checkpoint.gracePeriodSeconds) when set,
    else the planner's save time of a ``saved_bytes`` checkpoint, with the margin."""
    return grace_period(saved_bytes, nodes, given)[0]


def grace_period(saved_bytes: float, nodes: int, given: int | None = None) -> tuple[int, str]:
    """PURE: the grace period (:func:`grace_period_seconds`) and why, in words: the time a
    SIGTERM in the training loop needs for its save (start-up and export end at once)."""
    save = save_seconds(saved_bytes, nodes)
    if given is not None:
        return given, f"checkpoint.gracePeriodSeconds (the planned save takes ~{save:.0f} s)"
    planned = math.ceil(GRACE_MARGIN * save)
    if planned <= MIN_GRACE_SECONDS:
        return MIN_GRACE_SECONDS, (
            f"the floor: a save takes ~{save:.0f} s, x{GRACE_MARGIN:g} margin = {planned} s"
        )
    return planned, f"a save takes ~{save:.0f} s, x{GRACE_MARGIN:g} margin"


def save_seconds(saved_bytes: float, nodes: int) -> float:
    """About how long a checkpoint of ``saved_bytes`` takes to write: every node writes its
    ranks' shares at once."""
    return SAVE_FIXED_SECONDS + saved_bytes / (max(nodes, 1) * SAVE_BYTES_PER_SECOND_PER_NODE)
