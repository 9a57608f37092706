"""ftjob/cli/failure.py: which node's failure explains a run, from records first, logs second.

The records are made by ftjob.api.contract (what the trainer writes); the log lines are the
shapes the trainer, Python and torchrun print (tests/e2e/test_run_display.py runs the
real processes).
"""

from ftjob.api import contract
from ftjob.cli import failure

TORCHRUN_KILLED = [
    "[rank1]:[W1123 05:45:19.242000] something before",
    "ftjob.trainer FAILED",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-11-21_20:02:53",
    "  rank      : 1 (local_rank: 0)",
    "  exitcode  : -9 (pid: 17354)",
    "  error_file: <N/A>",
    "  traceback : Signal 9 (SIGKILL) received by PID 17354",
]
PEER_GONE = [
    "Traceback (most recent call last):",
    '  File "x.py", line 3, in <module>',
    "[rank0]: RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "  rank      : 0 (local_rank: 0)",
    "  exitcode  : 1 (pid: 1)",
]


def outcome(node, code, lines=(), record=None):
    return failure.NodeOutcome(node, code, record, list(lines), f"logs/node-{node}.log")


def test_everyone_succeeding_is_no_failure():
    ok = contract.success_record("/job/model")
    assert failure.summarize([outcome(0, 0, record=ok), outcome(1, 0)]) is None


def test_a_record_names_rank_reason_and_fix_and_beats_a_peers_timeout():
    data = contract.Failure(contract.BAD_DATA, "data.jsonl line 3: not valid JSON", rank=1)
    peer = contract.Failure(contract.NCCL_TIMEOUT, "allreduce timed out", rank=0)
    s = failure.summarize(
        [outcome(0, 1, record=peer.record()), outcome(1, 1, record=data.record())]
    )
    assert (s.node, s.rank, s.reason) == (1, 1, contract.BAD_DATA)
    assert s.headline() == "node 1 (rank 1) failed: BadData: data.jsonl line 3: not valid JSON"
    assert "spec.dataset.source" in s.fix and s.log == "logs/node-1.log"


def test_without_a_record_the_trainers_error_line_is_the_cause(trainer_runs):
    """The real trainer's log of a bad record, its termination record lost."""
    real = trainer_runs.get("bad-data")
    lines = real.log.splitlines()
    s = failure.summarize([outcome(0, 1, PEER_GONE), outcome(1, 1, lines)])
    said = next(x for x in lines if x.startswith("error: rank"))
    assert s.headline() == "node 1 (rank 0) failed: " + said.split(": ", 2)[2]
    assert s.reason == contract.BAD_DATA and "line 2" in s.cause


def test_an_invalid_spec_lists_its_fields():
    lines = ["error: /job/spec.json: invalid FineTuneJob:", "  spec.training.maxSteps: >= 1"]
    s = failure.summarize([outcome(0, 1, lines)])
    assert s.cause == "/job/spec.json: invalid FineTuneJob:"
    assert s.details == ["spec.training.maxSteps: >= 1"]


def test_a_killed_rank_is_named_by_torchruns_summary_over_the_peer_it_broke():
    # Node 0 exited first (its rank lost its peer); node 1's rank was SIGKILLed.
    s = failure.summarize([outcome(0, 1, PEER_GONE), outcome(1, 1, TORCHRUN_KILLED)])
    assert (s.node, s.rank, s.reason) == (1, 1, contract.HOST_OOM)
    assert s.cause.startswith("killed (SIGKILL)") and "ftjob plan" in s.fix


def test_no_gpu_and_out_of_memory_messages_get_their_fix():
    no_gpu = ["[rank0]: RuntimeError: Found no NVIDIA driver on your system."]
    s = failure.summarize([outcome(0, 1, no_gpu)])
    assert s.cause == "RuntimeError: Found no NVIDIA driver on your system."
    assert "resources.gpusPerNode: 0" in s.fix
    oom = ["[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    s = failure.summarize([outcome(0, 1, oom)])
    assert s.reason == contract.CUDA_OOM and "microBatchSize" in s.fix


def test_the_first_exception_is_the_cause_when_nothing_is_known():
    s = failure.summarize([outcome(0, 1, PEER_GONE)])
    assert s.headline() == (
        "node 0 (rank 0) failed: RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500"
    )
    assert s.fix is None
    assert failure.summarize([outcome(2, -15)]).headline() == "node 2 failed: exit code -15"
