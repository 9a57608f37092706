"""PURE: what the operator keeps of each job between events: the job as its watch last
brought it (:class:`Watch`, compressed), what the workers remember from one reconcile to the
next (:class:`JobState`), and one reconcile's observation (:class:`Seen`). operator/handlers.py
holds them by job and acts on them."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from ftjob.api.jobspec import GROUP, KIND, VERSION

if TYPE_CHECKING:
    from ftjob.operator import profiles


@dataclass
class JobState:
    """What the operator remembers of one job from one reconcile to the next."""

    # (the job's resourceVersions our status writes went over since the watch's copy, the
    # status last written, the resourceVersion that write made: the next write's precondition).
    # Each write was conditional on the one before, so a watch copy at any of the first is older
    # than our last write, and what we wrote is the truth until the watch brings a newer job.
    written: tuple[frozenset[str | None], dict, str | None] | None = None
    # A status write met a newer job (kube.Conflict): the next look reads it from the API
    # server first, not from the watch's copy, which may still be the one that lost.
    reread: bool = False
    snapshot: tuple[int | None, dict] | None = None  # rank 0's progress, with its gang's attempt
    port: int | None = None  # where rank 0 serves progress, once the spec parsed
    attempt: int | None = None  # the current gang's
    cost: dict | None = None  # status.cost as last counted (written at most every so often)
    admitted: str | None = None  # admit.digest of the last document whose children passed
    # The last copy of each pod that ended with a termination record, by name: a pod the
    # operator (or anyone) deleted is gone from the index a moment after its record is written,
    # often before the next reconcile runs, and its record says where the gang stopped (the
    # checkpoint a SIGTERM saved). Only the current gang's are kept.
    ended: dict[str, dict] = field(default_factory=dict)


@dataclass
class Watch:
    """One job object as the watch last brought it, and what the workers remember of it."""

    uid: str
    namespace: str
    name: str
    # The job as the last watch event brought it (no managedFields), as compressed compact
    # JSON: parsed, a job is several times larger (a dict and a str per field), and every
    # reconcile parses a copy of its own anyway (its decision changes that copy, never the
    # watch's). The fleet suite's jobs: 3.4 KB of JSON, 1.4 KB compressed (90 us a round trip).
    packed: bytes
    generation: int | None
    state: JobState = field(default_factory=JobState)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def doc(self) -> dict:
        """A new copy of the job as the watch last brought it."""
        return json.loads(zlib.decompress(self.packed))

    @property
    def ref(self) -> dict:
        """What an Event needs of the job (kopf.event's involvedObject)."""
        meta = {"name": self.name, "namespace": self.namespace, "uid": self.uid}
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": meta}


def pack(body) -> bytes:
    """The job as Watch.packed keeps it."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}  # never read
    text = json.dumps({**body, "metadata": meta}, default=dict, separators=(",", ":"))
    return zlib.compress(text.encode(), 1)  # the fastest level: a job is packed per event


@dataclass
class Seen:
    """One reconcile's observation of the job: its document, the status to decide from, its
    own pods, and the time."""

    doc: dict
    old_status: dict
    pods: list[dict]
    now: datetime
    workload: tuple[str, dict | None] | None = None  # Kueue's, for a gang in a queue
    taken: profiles.Taken | None = None  # its FineTuneProfile applied (doc is then merged)

    @property
    def meta(self) -> dict:
        return self.doc["metadata"]
