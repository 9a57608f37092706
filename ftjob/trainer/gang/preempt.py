"""A signal is a checkpoint: SIGTERM stops the gang at one step boundary, saved there.

The cluster stops a pod (an eviction, a drain, a spot reclaim, Kueue preemption) by sending
SIGTERM to its main process -- the node agent, which passes it on to its workers -- and
SIGKILL after terminationGracePeriodSeconds. In each worker the handler only notes the
request (:class:`Request`); the ranks learn of it through the step's first collective, which
carries one more number (:class:`Vote`), so every rank sees the same answer at the same step
and all stop at one boundary, however many of them were signalled. The trainer then saves a
complete checkpoint there and ends with a "preempted" record (ftjob.api.contract), unless the
time left cannot hold the save (:func:`save_fits`): then it saves nothing, and the previous
checkpoint stays the newest complete one (a save cut short by SIGKILL is invisible anyway).

Outside the training loop the handler is not installed: a SIGTERM while loading or exporting
ends the process as before (there is nothing new to save before the first step).
"""

from __future__ import annotations

import os
import signal
import time

from ftjob.api.contract import GRACE_ENV

# Kubernetes' own default terminationGracePeriodSeconds: what a process is given when nobody
# said (plain torchrun, an old pod spec).
DEFAULT_GRACE_SECONDS = 30.0
# The part of the time left a save may take: the rest covers the exit, the record and a
# measurement that was a little optimistic.
SAVE_SHARE = 0.8


def grace_seconds(environ=os.environ) -> float:
    """The seconds between SIGTERM and SIGKILL (GRACE_ENV, else Kubernetes' default)."""
    try:
        return max(0.0, float(environ.get(GRACE_ENV, DEFAULT_GRACE_SECONDS)))
    except ValueError:
        return DEFAULT_GRACE_SECONDS


def save_fits(time_left: float, save_seconds: float) -> bool:
    """PURE: whether a save that takes about ``save_seconds`` fits in ``time_left``."""
    return save_seconds <= SAVE_SHARE * time_left


class Request:
    """This process's SIGTERM, noted by the handler while armed (the training loop)."""

    def __init__(self, grace: float):
        self.grace = grace
        self.at: float | None = None  # monotonic time of the first SIGTERM

    def arm(self) -> None:
        signal.signal(signal.SIGTERM, self._note)

    def disarm(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _note(self, signum, frame) -> None:
        # Only a note: the loop acts on it at the next step boundary, with every rank.
        if self.at is None:
            self.at = time.monotonic()

    @property
    def asked(self) -> bool:
        return self.at is not None

    def time_left(self) -> float:
        """Seconds until SIGKILL (infinite for a rank that was not signalled: its pod stays)."""
        if self.at is None:
            return float("inf")
        return self.grace - (time.monotonic() - self.at)


class Vote:
    """The gang's agreement to stop, carried by the step's first all-reduce (one number more).

    That all-reduce sums host numbers in host memory (ftjob.trainer.step.train_step: gloo, the
    CPU backend, beside NCCL on GPUs), so every rank has the same sum when it returns, at the
    same step, and reading it never waits for the device's queue."""

    def __init__(self, request: Request):
        self.request = request
        self._stop = False

    def ballot(self) -> float:
        """This rank's ballot: 1 if it was signalled."""
        return float(self.request.asked)

    def cast(self, reduced: float) -> None:
        """Keep the gang's sum of the ballots."""
        self._stop = self._stop or reduced > 0

    def agreed(self) -> bool:
        """Whether the gang stops at this boundary (the same answer on every rank)."""
        return self._stop
