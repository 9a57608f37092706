"""Checkpoint manifests, the job folder's owner file and named write errors, without torch
processes (tests/e2e/test_faults.py runs them for real)."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from ftjob.api.contract import DISK_FULL, EXPORT_FAILED, OWNED_ELSEWHERE, TrainerError
from ftjob.job import lease as owner
from ftjob.job.folder import JobFolder
from ftjob.trainer.state import integrity, volume

# ------------------------------------------------------------------------------ integrity


def committed_folder(root: Path) -> Path:
    folder = root / "step-00000004"
    folder.mkdir(parents=True)
    for name, size in [(".metadata", 10), ("__0_0.distcp", 300), ("__1_0.distcp", 200),
                       ("rng-rank0.pt", 5), ("rng-rank1.pt", 5)]:  # fmt: skip
        (folder / name).write_bytes(os.urandom(size))
    names = [p.name for p in folder.iterdir()]
    files = {}
    for rank in (0, 1):
        files |= integrity.checksums(folder, integrity.share(names, rank, 2))
    (folder / integrity.COMMITTED).write_text(integrity.manifest(4, files))
    return folder


def all_problems(folder: Path, world: int = 2) -> list[str]:
    return [p for rank in range(world) for p in integrity.problems(folder, rank, world)]


def test_each_rank_checks_the_files_it_wrote_and_rank0_the_rest():
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__3_0.distcp", "rng-rank1.pt"]
    assert integrity.share(names, 0, 2) == [".metadata", "__0_0.distcp"]
    # Resumed with fewer ranks than wrote it: the files still get checked, by someone.
    assert integrity.share(names, 1, 2) == ["__1_0.distcp", "__3_0.distcp", "rng-rank1.pt"]


def test_an_intact_folder_has_no_problems_and_each_damage_is_named(tmp_path):
    folder = committed_folder(tmp_path)
    assert all_problems(folder) == []
    # One byte flipped, the size unchanged: only the checksum sees it.
    data = bytearray((folder / "__1_0.distcp").read_bytes())
    data[100] ^= 0xFF
    (folder / "__1_0.distcp").write_bytes(bytes(data))
    (folder / "rng-rank0.pt").write_bytes(b"")
    (folder / ".metadata").unlink()
    assert sorted(all_problems(folder)) == [
        ".metadata is missing",
        "__1_0.distcp does not match its checksum",
        "rng-rank0.pt has 0 bytes, 5 were written",
    ]


def test_a_manifest_without_files_or_metadata_is_damage(tmp_path):
    folder = committed_folder(tmp_path)
    (folder / integrity.COMMITTED).write_text("4\n")  # the marker of older versions
    assert all_problems(folder) == [f"its manifest {integrity.COMMITTED} has no list of files"]
    (folder / integrity.COMMITTED).write_text(json.dumps({"step": 4, "files": {}}))
    assert all_problems(folder) == [f"its manifest {integrity.COMMITTED} lists no .metadata"]


def test_damaged_folders_are_moved_aside_not_deleted(tmp_path):
    folder = committed_folder(tmp_path)
    aside = integrity.move_aside(folder)
    assert not folder.exists() and (aside / "__0_0.distcp").is_file()
    assert aside.parent == tmp_path / integrity.DAMAGED
    assert aside.name.startswith("step-00000004-")


# ------------------------------------------------------------------------------ volume


def test_enospc_anywhere_in_the_chain_is_disk_full(tmp_path):
    inner = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = inner
    named = volume.write_failed(wrapped, "checkpoint step-8", tmp_path, "Internal", needed=3 << 20)
    assert named.reason == DISK_FULL and named.where == str(tmp_path)
    assert "no space left on the volume holding" in str(named) and "3.0 MiB" in str(named)


def test_other_write_errors_keep_their_reason_and_non_write_errors_are_not_named(tmp_path):
    named = volume.write_failed(OSError(errno.EROFS, "Read-only file system"), "export",
                                tmp_path, EXPORT_FAILED)  # fmt: skip
    assert named.reason == EXPORT_FAILED and "Read-only file system" in str(named)
    assert volume.write_failed(ValueError("shape mismatch"), "export", tmp_path, "x") is None


def test_a_lost_errno_with_no_room_left_is_still_disk_full(tmp_path):
    # torch's zip writer reports ENOSPC as "unexpected pos"; the free space tells instead.
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    named = volume.write_failed(error, "checkpoint", tmp_path, "Internal", needed=free + 1)
    assert named.reason == DISK_FULL


# ------------------------------------------------------------------------------ owner


def held_by(tmp_path: Path, run: str, machine: str = "elsewhere", age: float = 0.0, pid=1):
    record = {"run": run, "machine": machine, "host": "node-a", "pid": pid,
              "since": "2026-01-01T00:00:00+00:00", "heartbeat": time.time() - age}  # fmt: skip
    JobFolder(tmp_path).owner.write_text(json.dumps(record))


@pytest.fixture
def run_id(monkeypatch):
    def set_id(value: str) -> None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", value)

    return set_id


def test_a_free_folder_is_taken_checked_and_released(tmp_path, run_id):
    run_id("job-abcdef12-0")
    lease = owner.Lease(tmp_path)
    lease.take()
    lease.check()
    assert json.loads(JobFolder(tmp_path).owner.read_text())["run"] == "job-abcdef12-0"
    lease.release()
    assert not JobFolder(tmp_path).owner.exists()


def test_a_live_owner_elsewhere_is_refused_with_who_and_how_to_take_over(tmp_path, run_id):
    held_by(tmp_path, "other-job-1", age=2)
    run_id("job-abcdef12-3")
    with pytest.raises(TrainerError) as refused:
        owner.Lease(tmp_path).take(wait_seconds=0)
    assert refused.value.reason == OWNED_ELSEWHERE
    message = str(refused.value)
    assert "in use by run other-job-1 (host node-a, pid 1)" in message
    assert f"delete {JobFolder(tmp_path).owner}" in message


def test_a_live_owner_on_this_machine_is_refused_at_once(tmp_path, run_id):
    held_by(tmp_path, "job-1", machine=owner._machine(), pid=os.getpid())
    run_id("job-2")  # a newer ftjob run on the same machine does not wait: it refuses
    started = time.monotonic()
    with pytest.raises(TrainerError):
        owner.Lease(tmp_path).take(wait_seconds=30)
    # not a hang guard: refused at once, not after its 30 s wait (~0.1 s; 20 s on a busy machine)
    assert time.monotonic() - started < 20


def test_an_owner_whose_process_is_gone_or_whose_lease_expired_is_replaced(tmp_path, run_id):
    run_id("job-abcdef12-2")
    held_by(tmp_path, "job-abcdef12-1", machine=owner._machine(), pid=2**22 + 1)  # no such pid
    owner.Lease(tmp_path).take(wait_seconds=0)
    held_by(tmp_path, "job-abcdef12-1", age=owner.LEASE_SECONDS + 1)
    owner.Lease(tmp_path).take(wait_seconds=0)
    assert json.loads(JobFolder(tmp_path).owner.read_text())["run"] == "job-abcdef12-2"


def test_a_newer_attempt_waits_for_the_old_gang_to_stop(tmp_path, run_id, monkeypatch):
    # The previous attempt's rank 0, on another node, refreshed its lease until just now.
    monkeypatch.setattr(owner, "LEASE_SECONDS", 2.0)
    held_by(tmp_path, "job-abcdef12-1", age=0.5)
    run_id("job-abcdef12-2")
    started = time.monotonic()
    owner.Lease(tmp_path).take(wait_seconds=10)
    waited = time.monotonic() - started
    assert 1.0 <= waited < 5, waited
    # An older attempt never waits for a newer one.
    held_by(tmp_path, "job-abcdef12-3", age=0)
    with pytest.raises(TrainerError):
        owner.Lease(tmp_path).take(wait_seconds=10)


def test_a_run_that_lost_the_folder_stops_before_writing(tmp_path, run_id):
    run_id("job-abcdef12-1")
    old = owner.Lease(tmp_path)
    old.take()
    held_by(tmp_path, "job-abcdef12-2")  # taken over (its lease had expired)
    with pytest.raises(TrainerError) as lost:
        old.check()
    assert lost.value.reason == OWNED_ELSEWHERE and "taken over by run job-abcdef12-2" in str(
        lost.value
    )
    old.release()  # releasing leaves the new owner's file alone
    assert json.loads(JobFolder(tmp_path).owner.read_text())["run"] == "job-abcdef12-2"


def test_two_runs_taking_a_free_folder_at_once_leave_one_owner(tmp_path, monkeypatch):
    import threading

    leases = []
    for run in ("job-a-1", "job-b-1"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run)
        leases.append(owner.Lease(tmp_path))
    outcomes, start = {}, threading.Barrier(2)

    def take(lease):
        start.wait()
        try:
            lease.take(wait_seconds=0)
            outcomes[lease.me.run] = "owner"
        except TrainerError as e:
            outcomes[lease.me.run] = e.reason

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes.values()) == [OWNED_ELSEWHERE, "owner"]
    winner = next(run for run, outcome in outcomes.items() if outcome == "owner")
    assert json.loads(JobFolder(tmp_path).owner.read_text())["run"] == winner
