"""The training loop: load, shard, resume, train, checkpoint, evaluate, export.

    torchrun --standalone --nproc-per-node 2 -m ftjob.trainer --spec examples/tiny.yaml

(``ftjob run examples/tiny.yaml`` sets the environment up for you: FTJOB_JOB_DIR,
FTJOB_SOURCE_ROOT.) Every rank runs this file top to bottom; rank 0 also reports progress,
phase by phase (ftjob.api.contract.PHASES), from the first second.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub.utils import disable_progress_bars

from ftjob.api import contract
from ftjob.api.contract import BAD_SPEC, EXPORT_FAILED, TrainerError
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.job import folder as jobfolder
from ftjob.job.folder import JobFolder
from ftjob.job.lease import LEASE_SECONDS, Lease
from ftjob.plan.estimate import stride_name
from ftjob.plan.modelshape import model_flops
from ftjob.plan.saving import checkpoint_bytes, save_seconds
from ftjob.trainer import step
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import context_slice
from ftjob.trainer.fetch import sources
from ftjob.trainer.gang import heartbeat, preempt, preflight, stragglers, termination
from ftjob.trainer.gang.owner import take_folder
from ftjob.trainer.model import attention, compile_cache, context, float8, parallel, planned
from ftjob.trainer.model import load as model
from ftjob.trainer.objectives import loss, objective
from ftjob.trainer.report import profile, progress, trackers
from ftjob.trainer.state import checkpoint, export, push, volume

SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def run(spec: FineTuneJobSpec, name: str) -> Path:
    """Train the job described by ``spec``; return the export's path.

    Progress is served from the first second (phase "starting"), so whoever watches sees a
    download or a long load as what it is, not as silence; a failure sets phase "failed"
    and leaves the step it happened at on the exception (``ftjob_step``) for the record.
    """
    job_dir = Path(os.environ.get("FTJOB_JOB_DIR") or Path("runs") / name)
    report = _progress(spec, job_dir)
    report.startup.mark("imports")  # the rest of start-up: marked where each phase ends
    trackers.attach(report, spec, name, job_dir)  # spec.tracking: rank 0's listeners
    try:
        return _run(spec, name, job_dir, report)
    except BaseException as e:
        e.ftjob_step = report.last_step  # type: ignore[attr-defined]
        if isinstance(e, contract.Preempted):
            raise  # not a failure: the entry point writes its record
        if not isinstance(e, KeyboardInterrupt | SystemExit):
            # The record first: the cleanup below takes a moment (the progress server stops,
            # trackers send what they hold), and a peer that failed faster has its agent end
            # this process meanwhile (torchrun's SIGTERM), which would leave no record.
            e.ftjob_record = termination.failure(e, report.last_step, report.final())  # type: ignore[attr-defined]
            termination.write(e.ftjob_record)
        with contextlib.suppress(OSError):  # a full disk must not hide what failed
            report.update(phase="failed")
        raise
    finally:
        report.close()


@dataclass
class Job:
    """The job as this rank runs it once the gang formed and the folder is this run's: what
    every phase reads. Two specs, named for what each is: ``asked`` is the one the folder
    records and the export's card names; ``spec`` reads downloads from the volume instead
    (ftjob.trainer.fetch.sources)."""

    asked: FineTuneJobSpec
    spec: FineTuneJobSpec
    name: str
    d: parallel.Dist
    report: progress.Progress
    folder: Path  # the job folder (FTJOB_JOB_DIR)
    lease: Lease | None  # rank 0's hold on the folder; None on the other ranks
    beat: heartbeat.Heartbeat
    goal: objective.Objective = field(init=False)

    def __post_init__(self) -> None:
        self.goal = objective.of(self.spec)

    @property
    def out(self) -> Path:
        return jobfolder.export_path(self.folder, self.asked)

    def say(self, message: str) -> None:
        if self.d.is_main:
            print(message, flush=True)


def _run(spec: FineTuneJobSpec, name: str, job_dir: Path, report: progress.Progress) -> Path:
    d, beat = _join(spec, job_dir, report)
    out = jobfolder.export_path(job_dir, spec)
    disable_progress_bars()  # pod logs are not terminals (a download's; transformers' too)
    lease, recorded = _take(spec, name, job_dir, out, d, report)
    report.startup.mark("rendezvous")
    if jobfolder.finished(spec, recorded, out):
        # A gang restarted after the export was written (a pod evicted at the very end).
        job = Job(spec, spec, name, d, report, job_dir, lease, beat)
        job.say(f"{name}: already trained; the exported model is in {out}")
        return _succeeded(job)
    if jobfolder.export_present(out):
        _continuing(report, name, out, recorded.get("trainedSteps"), spec.training.max_steps)
    resolved = sources.fetch(
        spec,
        job_dir,
        d.is_main,
        say=lambda m: print(m, flush=True) if d.is_main else None,
        downloading=lambda: report.phase("downloading"),
        progress=lambda got, total: report.update(downloadedBytes=got, downloadBytes=total),
    )
    report.startup.mark("download")
    return _train_and_export(Job(spec, resolved, name, d, report, job_dir, lease, beat))


def _train_and_export(job: Job) -> Path:
    """Data, model, resume, the steps, the last evaluation, the export."""
    torch.manual_seed(job.spec.training.seed)
    job.spec, split = planned.resolved(job.spec)  # contextParallel auto: the plan's number
    if split:
        job.report.log(split)
    # The plan first, from the model's own config.json: a job that cannot fit its memory ends
    # now (WillNotFit, permanent) rather than out of memory in the data's preparation or the
    # load, once per restart. Every rank decides alike from the same inputs.
    said, plan = planned.keep(job.spec)  # raises WillNotFit
    job.report.update(plan=plan)  # an OOMKilled pod is held to it (ftjob.operator.foreseen)
    job.report.log(said)
    # Data first: a bad record fails the job in seconds, before any weights are read.
    tok, ds, sampler, total = _data(job)
    job.report.startup.mark("data")
    job.report.phase("loading")
    run = _load(job, tok, total)
    _describe(job, run, ds, total)
    nodes = _loaded(job.report, job.d, run)
    # _load times its weights' reading; the rest builds, shards, makes the optimizer, and waits
    # in _loaded's gather for the gang's slowest rank to have loaded too.
    job.report.startup.mark("shard", within=("load", run.load_seconds))
    # Before resuming: a full fine-tune's DPO reference is the loaded model's (GRPO's frozen
    # reference is read from model.source here too, the starting weights whatever the resume).
    job.goal.before_training(job.spec, run.net, ds, job.d, job.report.log, job.folder)
    start = _resume(job, run)
    # Only now: loading a checkpoint takes an optimizer step of its own (torch initialises
    # the moments so), and scales computed then would be the weights' from before the load.
    float8.rescale_after_each_step(run.net, run.optimizer, job.spec)
    job.report.startup.mark("resume")  # the first step's seconds: Progress.step
    evaluated_at = _train(job, run, ds, sampler, range(start, total), nodes)
    run.ckpt.close()
    if ds.eval is not None and evaluated_at != total:
        job.report.phase("evaluating")
        _evaluated(job, run, ds, total)
    _measure_peaks(job.d, job.report)
    job.report.phase("exporting")
    _export(job, run.net, tok)
    if job.d.is_main:
        jobfolder.write(job.folder, job.name, job.asked, trained_steps=total)
    job.report.log(f"exported model: {job.out}")
    return _succeeded(job)


def _describe(job: Job, run: step.Run, ds: data.Data, total: int) -> None:
    """The run in words (model, sharding, data, steps, attention kernel) and the plan's
    numbers that progress compares the run against."""
    spec, d = job.spec, job.d
    job.report.log(
        f"{job.name}: {spec.method.type} fine-tune of {job.asked.model.source}, "
        f"{run.params:,} parameters ({run.trainable:,} trained), {_layout_words(job, run)}, "
        f"{len(ds.train)} train / {len(ds.eval or [])} eval "
        f"{job.goal.unit}, {total} steps" + _speed_note(run.speed)
    )
    compute = model.compute_dtype(spec)
    implementation = run.net.config._attn_implementation  # the GPU kit records the kernel
    job.report.log(f"attention: {attention.kernel_name(implementation, d.device, compute)}")
    _plan_progress(job.report, spec, d, total, run)


def _layout_words(job: Job, run: step.Run) -> str:
    if parallel.plain_enough(job.spec, job.d):
        return "one process: a plain module (no FSDP)"
    split = ""
    if run.context:
        n = run.context.size
        split = (f"context parallel {n} (Ulysses all-to-all over heads) x data parallel "
                 f"{job.d.world_size // n}, ")  # fmt: skip
    if parallel.ddp(job.spec, job.d, run.sharding):
        return f"{split}replicated (DDP) over {job.d.world_size} ranks"
    return f"{split}{run.sharding} sharding over {job.d.world_size} ranks"


def _speed_note(speed: parallel.Speed) -> str:
    setting = stride_name(speed.checkpoint_every)
    compiled = ", layers compiled" if speed.compile else ""
    return f"; activation checkpointing {setting}{compiled}"


def _take(spec: FineTuneJobSpec, name: str, job_dir: Path, out: Path, d, report):
    """Before anything is written to the job folder: one run writes there at a time. Returns
    rank 0's lease (None elsewhere) and the folder's record of the spec it was trained with."""
    wait = min(2 * LEASE_SECONDS, spec.network.collective_timeout_seconds - 5)
    lease = take_folder(job_dir, d.rank, wait)
    recorded = jobfolder.claim(job_dir, name, spec, writer=d.is_main)
    # The folder is this run's and its record this spec's: progress.json carries on from
    # what the previous run of this job left there (a refused spec left it untouched).
    report.own_folder()
    if d.is_main:
        jobfolder.recover_export(out)  # an export swap a crash cut short
    return lease, recorded


def _data(job: Job):
    """The tokenizer, the prepared data, its sampler and the number of steps to train."""
    spec, d, t = job.spec, job.d, job.spec.training
    job.report.phase("preparing-data")
    _quiet_transformers(d.is_main)
    tok = model.load_tokenizer(spec)
    # Rank 0 prepares (or reuses) the data on the volume; the others wait, then memory-map it.
    ds = data.load(spec, tok, job.folder, is_main=d.is_main, log=job.say,
                   on_progress=lambda p: job.report.update(preparing=p))  # fmt: skip
    # A context-parallel group reads one micro-batch: the data is split over the groups.
    sampler = job.goal.sampler(len(ds.train), spec, d.world_size // spec.context_parallel)
    return tok, ds, sampler, t.max_steps or sampler.steps_for(t.epochs)


def _quiet_transformers(is_main: bool) -> None:
    """transformers' logging, set where this phase first imports transformers (the tokenizer's)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # pod logs are not terminals
    if not is_main:
        hf_logging.set_verbosity_error()  # one copy of each warning is enough


def _join(spec: FineTuneJobSpec, job_dir: Path, report: progress.Progress):
    """Join the gang, start this rank's heartbeat and, before anything is read or written,
    check this node, the fabric and the volume (the preflight): a bad node fails fast."""
    # NCCL names the transport it chose only in its own log, set up before it starts.
    nccl_file = preflight.nccl_log(spec, job_dir, int(os.environ.get("RANK", "0")))
    d = parallel.init(spec)
    # Every rank's last step in the gang's store: a collective that times out names the rank
    # that stopped answering (ftjob.trainer.gang.heartbeat), the preflight's own included.
    beat = heartbeat.start(
        d.rank, d.world_size, contract.node_name(), spec.network.collective_timeout_seconds
    )
    if preflight.enabled(spec):
        report.update(preflight=preflight.run(spec, d, job_dir, report.log, nccl_file))
    return d, beat


def _loaded(report: progress.Progress, d: parallel.Dist, run: step.Run) -> list[str]:
    """What each rank read, in how long, and its peak memory: gathered in the first
    collective after loading (every rank has read its part by then), with each rank's node
    (stragglers name it). Returns the nodes, by rank."""
    loaded = [("", 0.0, 0, 0.0)] * d.world_size
    mine = (contract.node_name(), _peak_rss_mib(), run.read_bytes, run.load_seconds)
    dist.all_gather_object(loaded, mine)
    report.update(loadPeakRssMiB=[rss for _, rss, _, _ in loaded])
    report.log(
        "loading: each rank read its own part of the weights ("
        + ", ".join(f"{b / 2**30:.2f} GiB in {s:.1f} s" for _, _, b, s in loaded)
        + "); peak RSS per rank after loading (MiB): "
        + ", ".join(f"{rss:.0f}" for _, rss, _, _ in loaded)
    )
    return [node for node, _, _, _ in loaded]


def _succeeded(job: Job) -> Path:
    """The job is done (once output.push is pushed): say so in progress and in the record the
    operator requires."""
    out = job.out
    push.push(job.asked, job.folder, out, job.d, job.report)  # a failure: PushFailed
    job.report.update(phase="succeeded", exportPath=str(out), etaSeconds=0)
    if job.d.is_main:
        termination.write(contract.success_record(str(out), job.report.final()))
    if job.lease:
        job.lease.release()
    dist.destroy_process_group()
    return out


def _continuing(report, name: str, out: Path, exported: int | None, total: int) -> None:
    """Say, before anything trains, that this run goes on from a finished job and that its
    export will be replaced (maxSteps raised after the export): the log and the progress
    field ``replacesExport`` tell ``ftjob run`` and the operator."""
    held = f"holds {exported} steps" if exported is not None else "was written earlier"
    report.update(replacesExport=str(out), exportedSteps=exported)
    report.log(
        f"{name}: continues a finished job to {total} steps; the export at {out} ({held}) "
        f"will be replaced when this run completes, and stays readable until then"
    )


def _load(job: Job, tok, total: int) -> step.Run:
    """Build on meta, shard, every rank reads its shards of the weights; optimizer, schedule
    and checkpointer beside them."""
    spec, d, t = job.spec, job.d, job.spec.training
    built = model.build(spec, tok)
    parallel.check_context_heads(spec, built.model.config)  # before any weight is read
    loss.install(built.model)  # before sharding: the head's forward computes the loss
    params, trainable = model.count_parameters(built.model)
    if built.converted:
        job.report.log(float8.words(spec, built.converted))
    chosen = parallel.layout(spec, d, built.model.config)
    if chosen.reason:
        job.report.log(chosen.reason)  # what sharding auto chose, and why
    sharding = chosen.sharding
    speed = parallel.Speed(chosen.stride, spec.compile_enabled(d.device.type == "cuda"))
    shards = parallel.shard_group(spec, d, sharding)
    model.check_shardable(built, shards)  # before any weight is read
    whole = model.left_whole(built, shards)
    net, reduce_last = parallel.wrap(built.model, spec, d, sharding, whole, speed)
    began = time.monotonic()
    model.materialize(built, d, spec.parallelism.cpu_offload)
    load_seconds = time.monotonic() - began
    net.train()
    torch.manual_seed(t.seed + d.rank)  # dropout: a different stream on each rank
    weights = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        weights,
        lr=t.peak_learning_rate(spec.method.type),
        weight_decay=t.weight_decay,
        # One kernel for all tensors, on CPU as on GPUs; the unfused kernels read each
        # parameter's step count on the host every step (tests/e2e/test_host_reads.py).
        fused=True,
    )
    scheduler = get_scheduler(SCHEDULERS[t.scheduler], optimizer, t.warmup_steps(total), total)
    ckpt = checkpoint.Checkpointer(
        JobFolder(job.folder).checkpoints,
        d.rank,
        spec.checkpoint.keep,
        spec.checkpoint.async_save,
        fence=job.lease.check if job.lease else None,
    )
    flops = _flops_counter(spec, net, params, trainable)
    return step.Run(net, weights, optimizer, scheduler, ckpt, params, trainable, sharding,
                    reduce_last, speed, flops, built.read_bytes, load_seconds,
                    parallel.context_group(spec, d))  # fmt: skip


def get_scheduler(*args, **kwargs):
    """transformers' learning-rate schedules, imported when the optimizer is made: their module
    imports transformers' Trainer utilities and, through them, peft, also for a full fine-tune."""
    from transformers import get_scheduler as schedule

    return schedule(*args, **kwargs)


def _train(job: Job, run: step.Run, ds, sampler, steps: range, nodes: list[str]) -> int | None:
    """The optimizer steps, with evaluations and checkpoints on their schedules; the step
    last evaluated at. ``nodes``: each rank's node (:func:`_loaded`), for naming stragglers."""
    spec, d, report, goal = job.spec, job.d, job.report, job.goal
    t, every = spec.training, spec.checkpoint.every
    slow = stragglers.Stragglers(spec.run_policy.straggler_margin, nodes)
    report.begin(steps.start)
    tally, evaluated_at = step.Tally(run.flops), None
    batches = _prefetch(run, d, ds, sampler, steps, goal.collate)
    request = preempt.Request(preempt.grace_seconds())
    vote = preempt.Vote(request)
    request.arm()  # from here a SIGTERM is a checkpoint at the next step boundary
    try:
        # FTJOB_PROFILE_STEPS: a few of these steps under torch.profiler, on rank 0
        for n in profile.steps(steps, job.folder, d.is_main, d.device, report.log):
            began = time.perf_counter()
            micro = goal.rollout(run.net, batches.next(n), n, d)  # GRPO samples here
            with _split(run):
                share, waited, sums = step.train_step(run, micro, d, t.max_grad_norm, goal, vote)
            run.scheduler.step()
            wall = time.perf_counter() - began
            tally.add(share, micro, own_seconds=wall - waited, sums=sums)
            done = n + 1
            job.beat.at(done)
            report.step(done, run.scheduler.get_last_lr()[0], sampler.epoch(done), seconds=wall)
            if n == steps.start and run.speed.compile:  # the step that compiled the layers
                report.log(compile_cache.used().note(wall, compile_cache.folder()))
            if done % t.log_every == 0 or done == steps.stop:
                # The step's one host wait: loss, counts and every rank's own step time.
                loss_, tokens, flops, seconds, sums = tally.reduce(d.device, d.rank, d.world_size)
                report.logged(done, loss_, tokens, flops, **goal.step_metrics(sums))
                if slow.observe(seconds):
                    report.stragglers(slow.named, slow.describe())
            if vote.agreed():
                _preempted(job, run, done, request)  # raises contract.Preempted
            if ds.eval is not None and t.eval_every and done % t.eval_every == 0:
                report.phase("evaluating")
                _evaluated(job, run, ds, done)
                evaluated_at = done
            if done % every == 0 and done < steps.stop:
                _checkpoint(job, run, done)
    finally:
        request.disarm()
        batches.close()
    return evaluated_at


def _prefetch(run: step.Run, d: parallel.Dist, ds, sampler, steps: range, collate):
    """This rank's micro-batches, read ahead: with context parallelism a group's ranks are one
    reader of the sampler's (the same micro-batch), each keeping its own slice of the sequence."""
    cp = run.context
    if cp is None:
        return step.Prefetch(ds, sampler, d.rank, steps, collate)
    return step.Prefetch(
        ds,
        sampler,
        d.rank // cp.size,
        steps,
        lambda rows, pad: context_slice.cut(collate(rows, pad), cp.rank, cp.size, pad),
    )


def _split(run: step.Run):
    """Attention over the group's whole sequence (forward and backward), where there is one."""
    return context.parallel(run.context) if run.context else contextlib.nullcontext()


def _preempted(job: Job, run: step.Run, done: int, request: preempt.Request) -> None:
    """The gang agreed to stop for a SIGTERM after step ``done``: save a complete checkpoint
    here if every rank's time left holds it, and end with contract.Preempted either way."""
    needed = run.ckpt.expected_seconds(_planned_save_seconds(job, run))
    fits = preempt.save_fits(request.time_left(), needed)
    short = torch.tensor([0.0 if fits else 1.0], device=job.d.device)
    dist.all_reduce(short, op=dist.ReduceOp.MAX)  # one answer for all ranks
    if short.item() > 0:
        kept = checkpoint.latest(run.ckpt.root)
        message = (
            f"stopped for a SIGTERM after step {done} without saving: the grace period left "
            f"too little time for a save of about {needed:.0f} s; the newest complete "
            f"checkpoint is {kept or 'none (a rerun starts at step 0)'}"
        )
        job.report.log(message)
        job.report.update(phase="preempted")
        raise contract.Preempted(done, None, message)
    job.report.log(f"SIGTERM: the gang stops after step {done} and saves there")
    _checkpoint(job, run, done)
    run.ckpt.close()  # a background save is written and committed before the process ends
    saved = checkpoint.folder(run.ckpt.root, done)
    message = f"stopped for a SIGTERM after step {done}; checkpoint {saved} saved"
    job.report.update(phase="preempted")
    job.report.log(message)
    raise contract.Preempted(done, str(saved), message)


def _planned_save_seconds(job: Job, run: step.Run) -> float:
    """The planner's time for a save of this job, for a run that has measured none yet."""
    return save_seconds(checkpoint_bytes(run.trainable), job.spec.resources.nodes)


def _checkpoint(job: Job, run: step.Run, done: int) -> None:
    report = job.report
    report.phase("checkpointing")
    run.ckpt.save(run.net, run.optimizer, run.scheduler, done, own=job.goal.held())
    path = checkpoint.folder(run.ckpt.root, done)
    report.update(phase="training", lastCheckpoint=str(path), lastCheckpointStep=done)
    background = " (written in the background)" if job.spec.checkpoint.async_save else ""
    report.log(f"checkpoint saved: step {done} in {path}{background}")


def _resume(job: Job, run: step.Run) -> int:
    """Load the newest intact checkpoint (damaged ones are moved aside and named), or the
    one ``checkpoint.resumeFrom`` names; the step to start at."""
    report, checkpoints = job.report, JobFolder(job.folder).checkpoints
    found, damaged = checkpoint.choose(checkpoints, job.d.rank, job.d.world_size)
    for note in damaged:
        report.log(f"{note}; using {found or 'none: starting at step 0'} instead")
    found = found or _seed(job.spec)
    if found is None:
        report.log(f"no checkpoint in {checkpoints}: starting at step 0")
        return 0
    start, own = run.ckpt.load(found, run.net, run.optimizer, run.scheduler)
    job.goal.restore(own)
    report.update(resumedFrom=str(found), lastCheckpoint=str(found), lastCheckpointStep=start)
    report.log(f"resuming from checkpoint {found} (step {start})")
    return start


def _measure_peaks(d: parallel.Dist, report: progress.Progress) -> None:
    """Peak memory per rank before the export, whose full-model gather on rank 0 is not
    training memory: what `ftjob plan` estimates per process, measured."""
    train_rss = [0.0] * d.world_size
    dist.all_gather_object(train_rss, _peak_rss_mib())
    report.update(trainPeakRssMiB=train_rss)
    if d.device.type == "cuda":  # what the caching allocator handed out at most, per rank
        gpu_peak = [0.0] * d.world_size
        dist.all_gather_object(gpu_peak, round(torch.cuda.max_memory_allocated(d.device) / 2**20))
        report.update(trainPeakGpuMiB=gpu_peak)


def _seed(spec: FineTuneJobSpec) -> Path | None:
    """The checkpoint ``checkpoint.resumeFrom`` names, for a job folder with none yet."""
    if not spec.checkpoint.resume_from:
        return None
    given = Path(model.resolve(spec.checkpoint.resume_from))
    if (given / checkpoint.COMMITTED).is_file():
        return given
    found = checkpoint.latest(JobFolder(given).checkpoints) or checkpoint.latest(given)
    if found is None:
        raise TrainerError(
            f"spec.checkpoint.resumeFrom: no committed checkpoint in {given} (nor in its "
            "checkpoints/ folder); name a job folder or a checkpoints/step-N folder",
            reason=BAD_SPEC,
            where="spec.checkpoint.resumeFrom",
        )
    return found


def _export(job: Job, net, tok) -> None:
    """The export, with a failed write named (a full volume: DiskFull) on every rank and its
    temporary folder removed; the checkpoints stay, so a rerun exports again."""
    out = job.out
    if job.lease:
        job.lease.check()
    failed = None
    try:
        export.export(net, job.spec, tok, out, job.d.rank, job.asked)
    except Exception as e:  # noqa: BLE001 - every failure is named, agreed and raised below
        named = volume.write_failed(e, "export", out.parent, EXPORT_FAILED) or TrainerError(
            f"writing the model to {out} failed: {e}", reason=EXPORT_FAILED, where=str(out)
        )
        shutil.rmtree(out.with_name(f".tmp-{out.name}"), ignore_errors=True)  # export's temp
        failed = (str(named), named.reason, named.where)
        dist.barrier()  # the one the other ranks wait in at the end of export.export
    agreed = [failed]
    dist.broadcast_object_list(agreed, src=0)  # only rank 0 writes: its outcome is everyone's
    if agreed[0] is not None:
        message, reason, where = agreed[0]
        raise TrainerError(message, reason=reason, where=where)


def _evaluated(job: Job, run: step.Run, ds: data.Data, done: int) -> None:
    with _split(run):  # the objective cuts its batches as the group's (context.active)
        loss_, metrics = job.goal.evaluate(run.net, ds, job.d, job.spec.training.micro_batch_size)
    job.report.evaluated(done, loss_, **metrics)


def _peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB; it counts the mapped weight files' pages a rank touched.
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _progress(spec: FineTuneJobSpec, job_dir: Path) -> progress.Progress:
    """Rank 0's reporter, serving before the process group exists (RANK is torchrun's)."""
    main = int(os.environ.get("RANK", "0")) == 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Files in the job folder only once this run owns it (train._run takes the lease).
    report = progress.Progress(job_dir, main, None, world, writes_files=False)
    port = os.environ.get("FTJOB_PROGRESS_PORT")
    report.serve(int(port) if port else spec.network.progress_port)
    return report


def _plan_progress(report, spec, d, total, run: step.Run) -> None:
    name = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else None
    report.planned(
        total,
        peak=progress.peak_flops(name, spec.resources.gpu_type),
        device=name or "cpu",
        sharding=run.sharding,
        method=spec.method.type,
        activationCheckpointing=run.speed.checkpoint_every,
        compiled=run.speed.compile,
    )


def _flops_counter(spec: FineTuneJobSpec, net, params: int, trainable: int):
    """Model FLOPs of a micro-batch from its tokens and its documents' lengths (modelshape's
    one definition, shared with ftjob plan; recomputation is not counted)."""
    config = net.config
    # An untied input embedding is a lookup; a tied one is also the output head's matmul.
    embed = 0 if config.tie_word_embeddings else net.get_input_embeddings().weight.numel()
    frozen = spec.method.type != "full"
    base = params - embed - (trainable if frozen else 0)

    def flops(tokens: int, attention_sq: int) -> float:
        return model_flops(base, trainable if frozen else 0, config.num_hidden_layers,
                           config.hidden_size, frozen, tokens, attention_sq)  # fmt: skip

    return flops
