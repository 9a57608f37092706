"""How a job that ended reads (issue 52, point 3): its final step, losses and checkpoint,
no ETA, whether or not the operator's last read of rank 0's progress came after the end.

Rank 0 here is the trainer's real progress reporter (ftjob.trainer.report.progress) driven
with the calls train.py makes, and its pod ends with the record train.py writes from it; the
last test reads the record the real trainer wrote (tests/trainer_outputs.py).
"""

from datetime import timedelta

from test_status import T0, decide, pod, run_to

from ftjob.api import contract, crd
from ftjob.operator import status as st
from ftjob.trainer.gang import termination
from ftjob.trainer.report.progress import Progress

CHECKPOINT = "/ftjob/tiny-0f3c9a52/checkpoints/step-40"
MODEL = "/ftjob/tiny-0f3c9a52/model"


def trained(tmp_path, to: int) -> Progress:
    """Rank 0 of the tiny job (60 steps) after ``to`` steps: a logged loss every 5 steps, an
    evaluation and a checkpoint at step 40, as train.py reports them."""
    report = Progress(tmp_path, True, 60, 2, writes_files=False)
    report.begin(0)
    for step in range(1, to + 1):
        report.step(step, 5e-5, step / 60)
        if step % 5 == 0:
            report.logged(step, 2.4003989696502686 + (60 - step) / 100, 4096, 1e12)
        if step == 40:
            report.evaluated(40, 2.500812530517578)
            report.update(phase="training", lastCheckpoint=CHECKPOINT, lastCheckpointStep=40)
    return report


def succeeded(report: Progress, rank: int = 0) -> dict:
    """Rank ``rank``'s pod, ended as train.py's _succeeded ends it."""
    record = contract.success_record(MODEL, report.final()) if rank == 0 else None
    message = contract.dumps(record) if record else None
    return pod(rank, phase="Succeeded", exit_code=0, message=message)


def test_a_job_that_ends_between_two_reads_shows_how_it_ended(tmp_path):
    report = trained(tmp_path, 15)
    seen = dict(report.snapshot)  # the operator's last read: step 15, an ETA
    running = decide(run_to([pod(0), pod(1)]).status, [pod(0), pod(1)], snapshot=seen)
    assert running.status["progress"]["display"] == "15/60" and running.status["progress"]["eta"]
    report = trained(tmp_path, 60)  # ... then it trained to the end between two reads
    done = decide(running.status, [succeeded(report), succeeded(report, 1)], snapshot=seen)
    assert done.phase == "Succeeded"
    progress = done.status["progress"]
    assert progress["display"] == "60/60" and progress["phase"] == "succeeded"
    assert progress["loss"] == 2.4004 and progress["evalLoss"] == 2.5008
    assert "eta" not in progress
    assert done.status["lastCheckpoint"] == {"step": 40, "path": CHECKPOINT}
    # The handler keeps deciding with the last snapshot it read: it changes nothing now.
    later = decide(done.status, [succeeded(report), succeeded(report, 1)], T0, seen)
    assert later.status == done.status and not later.events


def test_a_failed_job_shows_the_step_it_reached(tmp_path):
    report = trained(tmp_path, 37)
    running = run_to([pod(0), pod(1)])  # never read since it started: step 0
    record = termination.named(contract.DISK_FULL, "no space left", step=37,
                               progress=report.final())  # fmt: skip
    failed = pod(0, phase="Failed", exit_code=1, message=contract.dumps(record))
    f = decide(running.status, [failed, pod(1)], backoffLimit=0)
    assert f.phase == "Failed"
    assert f.status["progress"]["display"] == "37/60" and f.status["progress"]["phase"] == "failed"
    assert "lastCheckpoint" not in f.status  # none was saved before step 40
    # A rank whose record has no progress (not rank 0) still says how far it got.
    other = termination.named(contract.NCCL_ERROR, "peer gone", step=36)
    lone = pod(1, phase="Failed", exit_code=1, message=contract.dumps(other))
    g = decide(running.status, [pod(0), lone], backoffLimit=0)
    assert g.status["progress"]["step"] == 36 and "eta" not in g.status["progress"]


def test_losses_are_kept_to_four_decimals_for_the_printer_columns(tmp_path):
    report = trained(tmp_path, 45)
    progress = st.progress(dict(report.snapshot))
    assert progress["loss"] == 2.5504 and progress["evalLoss"] == 2.5008
    columns = {c["name"]: c for c in crd.printer_columns()}
    assert columns["Loss"]["jsonPath"] == ".status.progress.loss"


def test_a_record_too_long_for_the_kubelet_keeps_its_reason_not_its_numbers(tmp_path):
    report = trained(tmp_path, 20)
    long = termination.named(contract.BAD_DATA, "x" * 4000, step=20, progress=report.final())
    text = contract.dumps(long)
    assert len(text.encode()) <= contract.RECORD_LIMIT
    assert contract.parse(text)["reason"] == contract.BAD_DATA


def test_the_real_trainers_success_record_carries_its_final_numbers(trainer_runs):
    run = trainer_runs.get("succeeded")  # 2 steps, a checkpoint every step, 1 kept
    done = decide(
        run_to([pod(0), pod(1)]).status,
        [pod(0, real=run), pod(1, phase="Succeeded", exit_code=0)],
        T0 + timedelta(minutes=1),
    )
    assert done.phase == "Succeeded"
    progress = done.status["progress"]
    assert progress["display"] == "2/2" and progress["phase"] == "succeeded"
    assert round(progress["loss"], 4) == progress["loss"]
    saved = contract.parse(run.record)["progress"]  # the newest checkpoint it kept
    assert done.status["lastCheckpoint"] == {
        "step": saved["lastCheckpointStep"],
        "path": saved["lastCheckpoint"],
    }
    assert saved["lastCheckpoint"].endswith(f"step-{saved['lastCheckpointStep']:08d}")
