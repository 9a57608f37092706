"""One writer per job folder: ``<job folder>/owner`` names the run that writes there.

``ftjob run`` takes the folder before it writes anything there and holds it until it ends;
on a cluster rank 0 of the gang takes it (the trainer's :func:`ftjob.trainer.gang.owner.
take_folder`, a collective: every rank gets rank 0's answer, so a run that may not write
stops on all ranks at once). A holder refreshes the
file every ``HEARTBEAT_SECONDS``. The folder is free when the file is absent, names this run
(an ``ftjob run`` whose trainer takes it, a gang whose workers restarted in place), or names a
run that is over:

* it ran on this machine (same host, kernel boot and PID namespace) and its processes are
  gone: the one that took the folder and the one that carries it on (each recorded as the
  process that lives as long as the run there: ``ftjob run``, or the node's agent, which
  outlives workers restarted in place). Both, because either may die alone: an ``ftjob
  run`` killed outright leaves its gang's agents running, and their rank 0 still writes.
  A process is its pid and its start time: on a real kubelet the pod that replaces a
  SIGKILLed one has the same hostname (the pod's name), often the same PID namespace
  inode (the kernel reuses it), and its agent is PID 1 again, as the dead owner's was;
* it ran elsewhere and its heartbeat is older than ``LEASE_SECONDS`` (killed, or its node
  lost).

A live owner on this machine is another ``ftjob run``: refused at once. A live owner
elsewhere is, on a cluster, the previous attempt's gang still terminating: a newer attempt
of the same job waits for it to stop (at most two leases), an older or foreign run is
refused. Before each commit and before the export, rank 0 checks that the file still names
this run (:meth:`Lease.check`), so a run that lost the folder never commits into it.

Taking is exclusive: the file appears by a hard link of a complete temporary file, which
fails if it exists (atomic on local and network file systems alike), so of two runs started
at the same instant exactly one owns the folder. A stale file is moved aside before it is
replaced, and put back if what was moved turns out to be a fresh owner's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from ftjob.api.contract import OWNED_ELSEWHERE, TrainerError
from ftjob.job import atomic, processes
from ftjob.job.folder import OWNER, JobFolder

HEARTBEAT_SECONDS = 5.0
LEASE_SECONDS = 30.0
RUN_ENV = "TORCHELASTIC_RUN_ID"  # the rendezvous id: unique per ftjob run and per attempt


@dataclass
class Owner:
    run: str  # the rendezvous id: unique per ftjob run and per operator attempt
    machine: str  # where ``pid`` means something (host, boot, PID namespace)
    host: str
    pid: int  # the process that took the folder for the run
    since: str
    heartbeat: float  # Unix time of the last refresh
    # The process that carries the lease on (a trainer's agent, once rank 0 took the folder
    # its `ftjob run` holds) and refreshes it from then on; 0 in files from before it was kept.
    carrier: int = 0
    # When each started (processes.started); 0 in files from before they were kept.
    pid_started: int = 0
    carrier_started: int = 0

    @classmethod
    def me(cls, run: str | None = None) -> Owner:
        holder = _holder_pid()
        started = processes.started(holder)
        return cls(
            run=run or os.environ.get(RUN_ENV, f"pid-{os.getpid()}"),
            machine=_machine(),
            host=socket.gethostname(),
            pid=holder,
            since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            heartbeat=time.time(),
            carrier=holder,
            pid_started=started,
            carrier_started=started,
        )

    def alive(self, now: float) -> bool:
        if self.machine == _machine():  # its processes tell, however old the heartbeat
            held = ((self.pid, self.pid_started), (self.carrier, self.carrier_started))
            return any(processes.alive(pid, since) for pid, since in held if pid > 0)
        return now - self.heartbeat <= LEASE_SECONDS

    def carried_by_another(self, me: Owner) -> bool:
        """Whether a live process other than ``me``'s carries this run's lease on here."""
        return (
            self.run == me.run
            and self.machine == me.machine
            and self.carrier not in (0, me.carrier)
            and processes.alive(self.carrier, self.carrier_started)
        )

    def describe(self, now: float) -> str:
        return (
            f"run {self.run} (host {self.host}, pid {self.pid}) since {self.since}, "
            f"last seen {max(0.0, now - self.heartbeat):.0f} s ago"
            + (f", carried on by pid {self.carrier}" if self.carrier not in (0, self.pid) else "")
        )


def attempt_of(run: str) -> tuple[str, int] | None:
    """(job, attempt) of a rendezvous id ``<job>-<uid8>-<attempt>``, else None."""
    found = re.match(r"^(.*)-(\d+)$", run)
    return (found.group(1), int(found.group(2))) if found else None


def newer_attempt(mine: str, theirs: str) -> bool:
    a, b = attempt_of(mine), attempt_of(theirs)
    return bool(a and b and a[0] == b[0] and a[1] > b[1])


class Lease:
    """This run's hold on the job folder."""

    def __init__(self, job_dir: Path, run: str | None = None):
        self.path = JobFolder(job_dir).owner
        self.me = Owner.me(run)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, wait_seconds: float = 2 * LEASE_SECONDS) -> None:
        """Own the folder, or raise TrainerError(OWNED_ELSEWHERE)."""
        deadline = time.monotonic() + wait_seconds
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._create():
            current, now = self.read(), time.time()
            if current is None:
                if self.path.exists():  # unreadable (not one of ours): it holds nothing
                    self._remove_stale(None)
                continue  # else removed meanwhile (released, or moved aside by a contender)
            if current.run == self.me.run:
                # Already this run's: taken by its `ftjob run`, or by this gang before its
                # workers restarted in place. The holder recorded there lives longer than us.
                holder = _holder_pid()
                started = processes.started(holder)
                self.me = dataclasses.replace(
                    current, heartbeat=now, carrier=holder, carrier_started=started
                )
                self._write()
                break
            if not current.alive(now):
                self._remove_stale(current)
                continue
            may_wait = current.machine != self.me.machine and newer_attempt(
                self.me.run, current.run
            )
            if not may_wait or time.monotonic() > deadline:
                raise self._refusal(current, now)
            time.sleep(1.0)
        self._thread = threading.Thread(target=self._beat, name="ftjob-owner", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise TrainerError(OWNED_ELSEWHERE) if the folder is no longer this run's."""
        current = self.read()
        if current is None:  # a contender's moment between moving a file aside and back
            time.sleep(0.5)
            current = self.read()
        if current is None or current.run != self.me.run:
            who = current.describe(time.time()) if current else "nobody (the file is gone)"
            raise TrainerError(
                f"job folder {self.path.parent} was taken over by {who}; this run stops "
                "without writing there",
                reason=OWNED_ELSEWHERE,
                where=str(self.path),
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # A refresh already under way would write the file back after it is removed.
            self._thread.join()
        release(self.path.parent, self.me.run)

    def read(self) -> Owner | None:
        """The owner, or None: no file, or one a crash left unreadable (nobody holds it)."""
        return _read(self.path)

    def _create(self) -> bool:
        """Make the file ours if there is none: True if it is."""
        self.me.heartbeat = time.time()
        return atomic.create_json(self.path, asdict(self.me))  # only one run gets True

    def _remove_stale(self, stale: Owner | None) -> None:
        """Remove the file of a run that is over (None: an unreadable file); if a contender
        replaced it meanwhile, put the contender's back (the link fails if yet another run
        owns it by then)."""
        aside = self.path.with_name(f".{OWNER}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another contender moved it first
        moved = _read(aside)
        judged = None if stale is None else (stale.run, stale.heartbeat)
        if moved is not None and (moved.run, moved.heartbeat) != judged:
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        aside.unlink(missing_ok=True)

    def _write(self) -> None:
        self.me.heartbeat = time.time()
        atomic.write_json(self.path, asdict(self.me))

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            current = self.read()
            if current is not None and current.run != self.me.run:
                return  # taken over: stop refreshing; check() refuses the next write
            if current is not None and current.carried_by_another(self.me):
                # This run's trainer carries it on: had `ftjob run` written itself back as
                # the carrier, its death alone would free a folder its gang still writes.
                continue
            with contextlib.suppress(OSError):  # a full disk: the lease just ages
                self._write()

    def _refusal(self, current: Owner, now: float) -> TrainerError:
        return TrainerError(_in_use(self.path, current, now), reason=OWNED_ELSEWHERE,
                            where=str(self.path))  # fmt: skip


def in_use(job_dir: Path) -> str | None:
    """Why ``job_dir`` may not be written now (a live owner), or None: asked before moving a
    folder aside (``ftjob run --restart``); :meth:`Lease.take` is what guarantees it."""
    current, now = _read(JobFolder(job_dir).owner), time.time()
    if current is None or not current.alive(now):
        return None
    return _in_use(JobFolder(job_dir).owner, current, now)


def release(job_dir: Path, run: str) -> None:
    """Give the folder up if ``run`` holds it (a newer owner's file is left alone)."""
    path = JobFolder(job_dir).owner
    with contextlib.suppress(OSError):
        current = _read(path)
        if current is not None and current.run == run:
            path.unlink()


def _in_use(path: Path, current: Owner, now: float) -> str:
    return (
        f"job folder {path.parent} is in use by {current.describe(now)}. Wait for it to "
        f"finish, or stop it; if it is gone for good, delete {path} (a lease also expires "
        f"{LEASE_SECONDS:.0f} s after its last heartbeat)."
    )


def _read(path: Path) -> Owner | None:
    try:
        return Owner(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _holder_pid() -> int:
    """The process whose life is this run's on this machine: under torchrun the node's agent
    (workers restarted in place come and go under it), else this process."""
    return os.getppid() if RUN_ENV in os.environ else os.getpid()


def _machine() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = pidns = "?"
    return f"{socket.gethostname()}/{boot}/{pidns}"
