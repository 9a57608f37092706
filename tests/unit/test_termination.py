"""The trainer's termination record: naming failures, and one record per shared file.

    python -m pytest tests/unit/test_termination.py -q

What the operator makes of real records is tested with the real trainer (test_status.py).
"""

from __future__ import annotations

import errno
import json
import multiprocessing

import hangs
import pytest
import torch
import torch.distributed as dist

from ftjob.api import contract
from ftjob.trainer.gang import termination


def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    """``exc`` as it arrives at the entry point: raised, with its traceback and cause."""
    try:
        raise exc from cause
    except BaseException as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize(
    "exc, reason",
    [
        (MemoryError(), contract.HOST_OOM),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
         contract.CUDA_OOM),
        (dist.DistBackendError("[Rank 1] Watchdog caught collective operation timeout"),
         contract.COLLECTIVE_TIMEOUT),
        # gloo's words when a peer stopped answering (a plain RuntimeError from its transport)
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed "
                      "out waiting 30000ms for send operation to complete"),
         contract.COLLECTIVE_TIMEOUT),
        (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"),
         contract.NCCL_ERROR),
        # The store's wait for a key a peer never set, at the process group's start.
        (dist.DistStoreError("wait timeout after 30000ms, keys: /default_pg/0//cuda//0"),
         contract.COLLECTIVE_TIMEOUT),
        (RuntimeError("NCCL communicator was aborted on rank 1"), contract.NCCL_ERROR),
        (dist.DistNetworkError("Connection reset by peer"), contract.NCCL_ERROR),
        # A peer gone, as gloo's transport words it (seen on two real nodes: rank 0's process
        # SIGKILLed, rank 1 raised this): a collective's error, which the peer's own cause
        # outranks, not Internal (a bug of ours).
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
                      "by peer [127.0.0.1]:29500"), contract.NCCL_ERROR),
        # gloo's other errors are not named: Internal, as before.
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:210] op.preamble.length "
                      "<= op.nbytes. 8 vs 4"), contract.INTERNAL),
        (OSError(errno.ENOSPC, "No space left on device", "/ftjob/x/checkpoints"),
         contract.DISK_FULL),
        (KeyError("x"), contract.INTERNAL),
    ],
)  # fmt: skip
def test_exceptions_are_named(exc, reason):
    got, message, where = termination.classify(raised(exc))
    assert got == reason
    assert message.startswith(type(exc).__name__)
    assert where  # the file:line, or the path, it happened at


def test_the_most_telling_cause_names_the_failure():
    full = OSError(errno.ENOSPC, "No space left on device", "/ftjob/x/model/model.safetensors")
    export = contract.TrainerError("writing the model failed", reason=contract.EXPORT_FAILED)
    assert termination.classify(raised(export, full))[0] == contract.DISK_FULL
    bad = contract.TrainerError("line 3: no text", reason=contract.BAD_DATA, where="data.jsonl")
    assert termination.classify(raised(bad, KeyError("text"))) == (
        contract.BAD_DATA,
        "line 3: no text",
        "data.jsonl",
    )


def _write(path: str, record: dict) -> None:
    import os

    os.environ["FTJOB_TERMINATION_LOG"] = path
    termination.write(record)


def test_ranks_sharing_one_file_leave_one_whole_record_the_most_telling(tmp_path):
    path = str(tmp_path / "termination-log")
    timeouts = [contract.Failure(contract.NCCL_TIMEOUT, "waited", rank=r).record()
                for r in range(1, 8)]  # fmt: skip
    oom = contract.Failure(contract.HOST_OOM, "no memory", rank=5).record()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write, args=(path, rec)) for rec in [*timeouts[:4], oom,
                                                                    *timeouts[4:]]]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(hangs.FLOOR)
        assert p.exitcode == 0
    record = json.loads((tmp_path / "termination-log").read_text())
    assert record["reason"] == contract.HOST_OOM and record["rank"] == 5


def test_a_failure_beats_success_and_the_first_of_equals_stays():
    first = contract.Failure(contract.INTERNAL, "first", rank=0).record()
    second = contract.Failure(contract.INTERNAL, "second", rank=1).record()
    done = contract.success_record("/ftjob/x/model")
    assert contract.keep(contract.keep(None, first), second) == first
    assert contract.keep(first, done) == first and contract.keep(done, first) == first
    assert contract.parse(contract.dumps(done)) == done
    assert contract.parse('{"exportPath": "/m"}') == {"outcome": "succeeded", "exportPath": "/m"}
    assert contract.parse("Traceback (most recent call last):") is None
