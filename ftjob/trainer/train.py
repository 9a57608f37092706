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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import get_scheduler
from transformers.utils import logging as hf_logging

from ftjob.api import contract
from ftjob.api.contract import BAD_SPEC, EXPORT_FAILED, TrainerError
from ftjob.api.spec import FineTuneJobSpec
from ftjob.job import folder as jobfolder
from ftjob.job.folder import JobFolder
from ftjob.job.lease import LEASE_SECONDS, Lease
from ftjob.plan.estimate import stride_name
from ftjob.plan.modelshape import model_flops
from ftjob.trainer import step
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import sources
from ftjob.trainer.gang import heartbeat, preflight, stragglers, termination
from ftjob.trainer.gang.owner import take_folder
from ftjob.trainer.model import attention, parallel
from ftjob.trainer.model import load as model
from ftjob.trainer.objectives import loss, objective
from ftjob.trainer.report import progress, trackers
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
    trackers.attach(report, spec, name, job_dir)  # spec.tracking: rank 0's listeners
    try:
        return _run(spec, name, job_dir, report)
    except BaseException as e:
        e.ftjob_step = report.last_step  # type: ignore[attr-defined]
        if not isinstance(e, KeyboardInterrupt | SystemExit):
            # The record first: the cleanup below takes a moment (the progress server stops,
            # trackers send what they hold), and a peer that failed faster has its agent end
            # this process meanwhile (torchrun's SIGTERM), which would leave no record.
            e.ftjob_record = termination.failure(e, step=report.last_step)  # type: ignore[attr-defined]
            termination.write(e.ftjob_record)
        with contextlib.suppress(OSError):  # a full disk must not hide what failed
            report.update(phase="failed")
        raise
    finally:
        report.close()


def _attention_line(spec: FineTuneJobSpec, run: Run, d: parallel.Dist) -> str:
    """Which attention kernel this run's layers go through (the GPU kit records it)."""
    compute = torch.bfloat16 if spec.compute_precision() == "bf16" else torch.float32
    implementation = run.net.config._attn_implementation
    return f"attention: {attention.kernel_name(implementation, d.device, compute)}"


def _run(spec: FineTuneJobSpec, name: str, job_dir: Path, report: progress.Progress) -> Path:
    d, beat = _join(spec, job_dir, report)
    out = jobfolder.export_path(job_dir, spec)
    say = print if d.is_main else (lambda *a, **k: None)
    hf_logging.disable_progress_bar()  # pod logs are not terminals
    if not d.is_main:
        hf_logging.set_verbosity_error()  # one copy of each warning is enough
    lease, recorded = _take(spec, name, job_dir, out, d, report)
    if jobfolder.finished(spec, recorded, out):
        # A gang restarted after the export was written (a pod evicted at the very end).
        say(f"{name}: already trained; the exported model is in {out}", flush=True)
        return _succeeded(out, d, report, lease, spec, job_dir)
    if jobfolder.export_present(out):
        _continuing(report, name, out, recorded.get("trainedSteps"), spec.training.max_steps)
    asked = spec  # what the job folder records; the run reads downloads from the volume
    spec = sources.fetch(
        spec,
        job_dir,
        d.is_main,
        say=lambda m: say(m, flush=True),
        downloading=lambda: report.phase("downloading"),
    )
    t = spec.training
    goal = objective.of(spec)
    torch.manual_seed(t.seed)

    # Data first: a bad record fails the job in seconds, before any weights are read.
    tok, ds, sampler, total = _data(spec, job_dir, d, report, say)

    report.phase("loading")
    run = _load(spec, tok, d, job_dir, lease, total)
    report.log(
        f"{name}: {spec.method.type} fine-tune of {asked.model.source}, {run.params:,} "
        f"parameters ({run.trainable:,} trained), {run.sharding} sharding over "
        f"{d.world_size} ranks, {len(ds.train)} train / {len(ds.eval or [])} eval {goal.unit}, "
        f"{total} steps" + run.speed_note()
    )
    report.log(_attention_line(spec, run, d))
    _plan_progress(report, spec, d, total, run)
    nodes = _loaded(report, d, run)
    goal.before_training(spec, run.net, ds, d, report.log)  # before any checkpoint is loaded

    start = _resume(job_dir, spec, d, run, report)
    steps = range(start, total)
    evaluated_at = _train(spec, d, run, ds, sampler, steps, report, beat, nodes, goal)
    run.ckpt.close()
    if ds.eval is not None and evaluated_at != total:
        report.phase("evaluating")
        _evaluated(report, total, run.net, ds, d, t.micro_batch_size, goal)
    _measure_peaks(d, report)

    report.phase("exporting")
    _export(run.net, spec, tok, out, d.rank, lease, asked)
    if d.is_main:
        jobfolder.write(job_dir, name, asked, trained_steps=total)
    report.log(f"exported model: {out}")
    return _succeeded(out, d, report, lease, asked, job_dir)


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


def _data(spec: FineTuneJobSpec, job_dir: Path, d, report: progress.Progress, say):
    """The tokenizer, the prepared data, its sampler and the number of steps to train."""
    t = spec.training
    report.phase("preparing-data")
    tok = model.load_tokenizer(spec)
    # Rank 0 prepares (or reuses) the data on the volume; the others wait, then memory-map it.
    ds = data.load(spec, tok, job_dir, is_main=d.is_main, log=lambda m: say(m, flush=True),
                   on_progress=lambda p: report.update(preparing=p))  # fmt: skip
    sampler = data.Sampler(len(ds.train), t.seed, d.world_size, t.micro_batch_size,
                           t.gradient_accumulation)  # fmt: skip
    return tok, ds, sampler, t.max_steps or sampler.steps_for(t.epochs)


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


def _loaded(report: progress.Progress, d: parallel.Dist, run: Run) -> list[str]:
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


def _succeeded(out: Path, d: parallel.Dist, report, lease: Lease | None, spec, job_dir) -> Path:
    """The job is done (once output.push is pushed): say so in progress and in the record the
    operator requires."""
    push.push(spec, job_dir, out, d, report)  # a failure: HubPushFailed, the export kept
    report.update(phase="succeeded", exportPath=str(out), etaSeconds=0)
    if d.is_main:
        termination.write(contract.success_record(str(out)))
    if lease:
        lease.release()
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


@dataclass
class Run:
    """The sharded model and what trains it (:func:`_load`)."""

    net: torch.nn.Module
    weights: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    ckpt: checkpoint.Checkpointer
    params: int
    trainable: int
    sharding: str
    replicated: bool  # a mesh with replicas (hybrid, none): their all-reduce can wait
    speed: parallel.Speed
    flops: Callable[[int, int], float]
    read_bytes: int  # what this rank read from the weight files
    load_seconds: float  # how long this rank took to read them

    def speed_note(self) -> str:
        setting = stride_name(self.speed.checkpoint_every)
        compiled = ", layers compiled" if self.speed.compile else ""
        return f"; activation checkpointing {setting}{compiled}"


def _load(spec, tok, d: parallel.Dist, job_dir: Path, lease, total: int) -> Run:
    """Build on meta, shard, every rank reads its shards of the weights; optimizer, schedule
    and checkpointer beside them."""
    t = spec.training
    built = model.build(spec, tok)
    loss.install(built.model)  # before sharding: the head's forward computes the loss
    params, trainable = model.count_parameters(built.model)
    sharding = spec.effective_sharding(4 * params + 12 * trainable, _gpu_bytes(d))
    mesh = parallel.mesh(spec, d, sharding)
    shards = parallel.shard_group_size(mesh)
    model.check_shardable(built, shards)  # before any weight is read
    speed = parallel.speed_settings(spec, built.model.config, _gpu_bytes(d))
    net = parallel.shard(built.model, spec, mesh, sharding, model.left_whole(built, shards), speed)
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
        fused=d.device.type == "cuda",  # one kernel for all tensors where the device has it
    )
    scheduler = get_scheduler(SCHEDULERS[t.scheduler], optimizer, t.warmup_steps(total), total)
    ckpt = checkpoint.Checkpointer(
        JobFolder(job_dir).checkpoints,
        d.rank,
        spec.checkpoint.keep,
        spec.checkpoint.async_save,
        fence=lease.check if lease else None,
    )
    replicated = mesh.ndim == 2 and mesh["replicate"].size() > 1
    flops = _flops_counter(spec, net, params, trainable)
    return Run(net, weights, optimizer, scheduler, ckpt, params, trainable, sharding, replicated,
               speed, flops, built.read_bytes, load_seconds)  # fmt: skip


def _train(spec, d, run: Run, ds, sampler, steps: range, report, beat, nodes, goal) -> int | None:
    """The optimizer steps, with evaluations and checkpoints on their schedules; the step
    last evaluated at. ``nodes``: each rank's node (:func:`_loaded`), for naming stragglers."""
    t, every = spec.training, spec.checkpoint.every
    slow = stragglers.Stragglers(spec.run_policy.straggler_margin, nodes)
    report.begin(steps.start)
    tally, evaluated_at = step.Tally(run.flops), None
    batches = step.Prefetch(ds, sampler, d.rank, steps, goal.collate)
    try:
        for n in steps:
            began = time.perf_counter()
            micro = batches.next(n)
            share, waited, sums = step.train_step(run.net, run.optimizer, run.weights, micro,
                                                  d.device, d.world_size, run.replicated,
                                                  t.max_grad_norm, run.ckpt.before_update,
                                                  goal)  # fmt: skip
            run.scheduler.step()
            wall = time.perf_counter() - began
            tally.add(share, micro, own_seconds=wall - waited, sums=sums)
            done = n + 1
            beat.at(done)
            report.step(done, run.scheduler.get_last_lr()[0], sampler.epoch(done), seconds=wall)
            if done % t.log_every == 0 or done == steps.stop:
                # The step's one host wait: loss, counts and every rank's own step time.
                loss_, tokens, flops, seconds, sums = tally.reduce(d.device, d.rank, d.world_size)
                report.logged(done, loss_, tokens, flops, **goal.step_metrics(sums))
                if slow.observe(seconds):
                    report.stragglers(slow.named, slow.describe())
            if ds.eval is not None and t.eval_every and done % t.eval_every == 0:
                report.phase("evaluating")
                _evaluated(report, done, run.net, ds, d, t.micro_batch_size, goal)
                evaluated_at = done
            if done % every == 0 and done < steps.stop:
                _checkpoint(spec, run, done, report)
    finally:
        batches.close()
    return evaluated_at


def _checkpoint(spec, run: Run, done: int, report) -> None:
    report.phase("checkpointing")
    run.ckpt.save(run.net, run.optimizer, run.scheduler, done)
    path = checkpoint.folder(run.ckpt.root, done)
    report.update(phase="training", lastCheckpoint=str(path), lastCheckpointStep=done)
    background = " (written in the background)" if spec.checkpoint.async_save else ""
    report.log(f"checkpoint saved: step {done} in {path}{background}")


def _resume(job_dir, spec, d, run: Run, report) -> int:
    """Load the newest intact checkpoint (damaged ones are moved aside and named), or the
    one ``checkpoint.resumeFrom`` names; the step to start at."""
    checkpoints = JobFolder(job_dir).checkpoints
    found, damaged = checkpoint.choose(checkpoints, d.rank, d.world_size)
    for note in damaged:
        report.log(f"{note}; using {found or 'none: starting at step 0'} instead")
    found = found or _seed(spec)
    if found is None:
        report.log(f"no checkpoint in {checkpoints}: starting at step 0")
        return 0
    start = run.ckpt.load(found, run.net, run.optimizer, run.scheduler)
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


def _export(net, spec, tok, out: Path, rank: int, lease: Lease | None, asked) -> None:
    """The export, with a failed write named (a full volume: DiskFull) on every rank and its
    temporary folder removed; the checkpoints stay, so a rerun exports again."""
    if lease:
        lease.check()
    failed = None
    try:
        export.export(net, spec, tok, out, rank, asked)
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


def _evaluated(report, step_: int, net, ds: data.Data, d, micro_batch: int, goal) -> None:
    loss_, metrics = goal.evaluate(net, ds, d, micro_batch)
    report.evaluated(step_, loss_, **metrics)


def _peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB; it counts the mapped weight files' pages a rank touched.
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _gpu_bytes(d: parallel.Dist) -> int | None:
    if d.device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(d.device).total_memory


def _progress(spec: FineTuneJobSpec, job_dir: Path) -> progress.Progress:
    """Rank 0's reporter, serving before the process group exists (RANK is torchrun's)."""
    main = int(os.environ.get("RANK", "0")) == 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Files in the job folder only once this run owns it (train._run takes the lease).
    report = progress.Progress(job_dir, main, None, world, writes_files=False)
    port = os.environ.get("FTJOB_PROGRESS_PORT")
    report.serve(int(port) if port else spec.network.progress_port)
    return report


def _plan_progress(report, spec, d, total, run: Run) -> None:
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
