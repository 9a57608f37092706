"""The training loop: load, shard, resume, train, checkpoint, evaluate, export.

    torchrun --standalone --nproc-per-node 2 -m ftjob.trainer --spec examples/tiny.yaml

(``ftjob run examples/tiny.yaml`` sets the environment up for you: FTJOB_JOB_DIR,
FTJOB_SOURCE_ROOT.) Every rank runs this file top to bottom; rank 0 also reports progress.
"""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import get_scheduler
from transformers.utils import logging as hf_logging

from ftjob import contract
from ftjob.modelshape import flops_per_token
from ftjob.spec import FineTuneJobSpec
from ftjob.trainer import checkpoint, data, export, model, parallel, progress, termination

SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def run(spec: FineTuneJobSpec, name: str) -> Path:
    """Train the job described by ``spec``; return the export's path.

    Progress is served from the first second (phase "starting"), so whoever watches sees a
    download or a long load as what it is, not as silence; a failure sets phase "failed"
    and leaves the step it happened at on the exception (``ftjob_step``) for the record.
    """
    job_dir = Path(os.environ.get("FTJOB_JOB_DIR") or Path("runs") / name)
    report = _progress(spec, job_dir)
    try:
        return _run(spec, name, job_dir, report)
    except BaseException as e:
        e.ftjob_step = report.last_step  # type: ignore[attr-defined]
        with contextlib.suppress(OSError):  # a full disk must not hide what failed
            report.update(phase="failed")
        raise
    finally:
        report.close()


def _run(spec: FineTuneJobSpec, name: str, job_dir: Path, report: progress.Progress) -> Path:
    d = parallel.init(spec)
    out = export.target(spec, job_dir)
    say = print if d.is_main else (lambda *a, **k: None)
    hf_logging.disable_progress_bar()  # pod logs are not terminals
    if not d.is_main:
        hf_logging.set_verbosity_error()  # one copy of each warning is enough
    if out.exists():
        # A gang restarted after the export was written (a pod evicted at the very end): the
        # job is done, and says so in the record the operator requires for success.
        say(f"{name}: already trained; the exported model is in {out}", flush=True)
        report.update(phase="succeeded", exportPath=str(out))
        if d.is_main:
            termination.write(contract.success_record(str(out)))
        dist.destroy_process_group()
        return out
    t = spec.training
    torch.manual_seed(t.seed)

    # Data first: a bad record fails the job in seconds, before any weights are read.
    report.phase("preparing-data")
    tok = model.load_tokenizer(spec)
    ds = data.load(spec, tok)
    sampler = data.Sampler(len(ds.train), t.seed, d.world_size, t.micro_batch_size,
                           t.gradient_accumulation)  # fmt: skip
    total = t.max_steps or sampler.steps_for(t.epochs)

    report.phase("loading")
    built = model.build(spec, d, tok)
    params, trainable = model.count_parameters(built.model)
    sharding = spec.effective_sharding(4 * params + 12 * trainable, _gpu_bytes(d))
    mesh = parallel.mesh(spec, d, sharding)
    net = parallel.shard(built.model, spec, mesh, sharding, built.ignored)
    model.materialize(built, d, spec.parallelism.cpu_offload)
    net.train()
    torch.manual_seed(t.seed + d.rank)  # dropout: a different stream on each rank
    load_rss = [0.0] * d.world_size
    dist.all_gather_object(load_rss, _peak_rss_mib())

    weights = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        weights,
        lr=t.peak_learning_rate(spec.method.type),
        weight_decay=t.weight_decay,
        fused=d.device.type == "cuda",  # one kernel for all tensors where the device has it
    )
    scheduler = get_scheduler(SCHEDULERS[t.scheduler], optimizer, t.warmup_steps(total), total)
    ckpt = checkpoint.Checkpointer(
        job_dir / "checkpoints", d.rank, spec.checkpoint.keep, spec.checkpoint.async_save
    )
    _plan_progress(report, spec, d, total, net, params, trainable, sharding)
    report.log(
        f"{name}: {spec.method.type} fine-tune of {spec.model.source}, {params:,} parameters "
        f"({trainable:,} trained), {sharding} sharding over {d.world_size} ranks, "
        f"{len(ds.train)} train / {len(ds.eval)} eval sequences, {total} steps"
    )
    report.update(loadPeakRssMiB=load_rss)
    report.log("peak RSS per rank after loading (MiB): " + ", ".join(f"{m:.0f}" for m in load_rss))

    start = 0
    found = checkpoint.latest(job_dir / "checkpoints")
    if found is not None:
        start = ckpt.load(found, net, optimizer, scheduler)
        report.update(resumedFrom=str(found), lastCheckpoint=str(found), lastCheckpointStep=start)
        report.log(f"resuming from checkpoint {found} (step {start})")
    else:
        report.log(f"no checkpoint in {job_dir / 'checkpoints'}: starting at step 0")
    report.begin(start)

    evaluated_at = None
    for step in range(start, total):
        loss, tokens = _train_step(
            net, optimizer, weights, ds, sampler, step, d, t.max_grad_norm, ckpt.before_update
        )
        scheduler.step()
        done = step + 1
        lr = scheduler.get_last_lr()[0]
        report.step(done, loss, lr, tokens, sampler.epoch(done), log=done % t.log_every == 0)
        if ds.eval and t.eval_every and done % t.eval_every == 0:
            report.phase("evaluating")
            report.evaluated(done, evaluate(net, ds, d, t.micro_batch_size))
            evaluated_at = done
        if done % spec.checkpoint.every == 0 and done < total:
            report.update(phase="checkpointing")
            ckpt.save(net, optimizer, scheduler, done)
            path = checkpoint.folder(ckpt.root, done)
            report.update(phase="training", lastCheckpoint=str(path), lastCheckpointStep=done)
    ckpt.close()
    if ds.eval and evaluated_at != total:
        report.phase("evaluating")
        report.evaluated(total, evaluate(net, ds, d, t.micro_batch_size))
    # Before the export, whose full-model gather on rank 0 is not training memory: what
    # `ftjob plan` estimates per process, measured (rank 1 never holds the whole model).
    train_rss = [0.0] * d.world_size
    dist.all_gather_object(train_rss, _peak_rss_mib())
    report.update(trainPeakRssMiB=train_rss)

    report.update(phase="exporting")
    try:
        export.export(net, spec, tok, out, d.rank)
    except Exception as e:  # a full disk inside stays DiskFull: the most telling name wins
        raise contract.TrainerError(
            f"writing the model to {out} failed: {e}", reason=contract.EXPORT_FAILED, where=str(out)
        ) from e
    report.update(phase="succeeded", exportPath=str(out), etaSeconds=0)
    report.log(f"exported model: {out}")
    if d.rank == 0:
        termination.write(contract.success_record(str(out)))
    dist.destroy_process_group()
    return out


def token_loss(net, batch: dict, device: torch.device) -> tuple[torch.Tensor, int]:
    """Sum of next-token losses over the labelled tokens, and their count."""
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    target = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)),
        target.reshape(-1),
        ignore_index=data.IGNORE,
        reduction="sum",
    )
    return loss, int((target != data.IGNORE).sum())


def _train_step(
    net, optimizer, weights, ds, sampler, step, d, max_norm, before_update
) -> tuple[float, int]:
    micro = [
        data.collate([ds.train[i] for i in sampler.indices(step, m, d.rank)], ds.pad_id)
        for m in range(sampler.accumulation)
    ]
    # Every labelled token of the step weighs the same, whichever rank or micro-batch has it:
    # divide by the global count (FSDP then averages gradients over ranks, hence x world).
    labelled = sum(int((b["labels"][:, 1:] != data.IGNORE).sum()) for b in micro)
    counts = torch.tensor([float(labelled)], device=d.device)
    dist.all_reduce(counts)
    tokens_all = max(float(counts.item()), 1.0)
    total = torch.zeros((), device=d.device)
    for m, batch in enumerate(micro):
        # Reduce-scatter gradients once per step, not once per micro-batch.
        net.set_requires_gradient_sync(m == len(micro) - 1)
        loss, _ = token_loss(net, batch, d.device)
        (loss * d.world_size / tokens_all).backward()
        total += loss.detach()
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(weights, max_norm)
    before_update()  # a background checkpoint may still be copying weights and moments
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    seen = sum(int(b["attention_mask"].sum()) for b in micro) * d.world_size
    return float(total) / tokens_all, seen


@torch.no_grad()
def evaluate(net, ds: data.Data, d: parallel.Dist, micro_batch: int) -> float:
    """Mean next-token loss over the whole eval set (all ranks)."""
    net.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=d.device)
    for batch in data.eval_batches(ds, d.rank, d.world_size, micro_batch):
        loss, count = token_loss(net, batch, d.device)
        sums += torch.tensor([float(loss), count], dtype=torch.float64, device=d.device)
    dist.all_reduce(sums)
    net.train()
    return float(sums[0] / sums[1])


def _peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB; rank 0 reads the weights, the others should stay small.
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _gpu_bytes(d: parallel.Dist) -> int | None:
    if d.device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(d.device).total_memory


def _progress(spec: FineTuneJobSpec, job_dir: Path) -> progress.Progress:
    """Rank 0's reporter, serving before the process group exists (RANK is torchrun's)."""
    main = int(os.environ.get("RANK", "0")) == 0
    report = progress.Progress(job_dir, main, None, int(os.environ.get("WORLD_SIZE", "1")))
    port = os.environ.get("FTJOB_PROGRESS_PORT")
    report.serve(int(port) if port else spec.network.progress_port)
    return report


def _plan_progress(report, spec, d, total, net, params, trainable, sharding) -> None:
    config = net.config
    # An untied input embedding is a lookup; a tied one is also the output head's matmul.
    embed = 0 if config.tie_word_embeddings else net.get_input_embeddings().weight.numel()
    frozen_base = spec.method.type != "full"
    flops = flops_per_token(
        params=params - embed - (trainable if frozen_base else 0),
        adapter_params=trainable if frozen_base else 0,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        seq_len=spec.dataset.max_seq_length,
        frozen_base=frozen_base,
    )
    name = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else None
    report.planned(
        total,
        flops_per_token=flops,
        peak=progress.peak_flops(name, spec.resources.gpu_type),
        device=name or "cpu",
        sharding=sharding,
        method=spec.method.type,
    )
