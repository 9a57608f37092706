"""The GPU call's measuring steps, one process each (bench/gpu_kit/run.sh runs them in order):

    python -m bench.gpu_kit.steps STEP --out DIR --work DIR [--sizes gpu|tiny]

The main call, most valuable first; every job is ftjob's default (sharding, activation
checkpointing and compile left to auto):
    profile      the ~1B Llama full fine-tune (bf16, seq 2048 packed) under torch.profiler for
                 3 steps after the trainer's warm-up (`ftjob run --profile-steps 3`): the
                 device's busy fraction, the 10 longest kernels, the host syncs; the summary
                 also in DIR/profile.json
    versus-trl   the same job's tokens/s, MFU and peak against `ftjob plan` (ftjob-default),
                 then TRL SFTTrainer at TRL's defaults (trl-defaults) and with ftjob's settings:
                 packing, attention, recomputation and FSDP as ftjob ran them (trl-same)
The second call (rest):
    compile-3b   the default job compiled at a second size (Llama-3.2-3B's shape): peak against
                 `ftjob plan`, which counts a compiled step as the eager one
    offload      QLoRA with cpuOffload: peak against `ftjob plan`
    ckpt-stall   a step after an asyncSave checkpoint against the steps without one
    lora-8b      Llama-3-8B-shaped LoRA at seq 4096: tokens/s (NeMo: 12,473 on one H100)
    ddp          the ~1B LoRA job on every GPU, replicated (sharding none: DDP) then fully
                 sharded: tokens/s each, the plan's step time for each. NCCL puts no two
                 ranks of one communicator on one GPU (tests/gpu), so a one-GPU machine
                 records that it has one GPU and measures nothing
    context      the same LoRA job with each sequence split over 2 GPUs (contextParallel 2)
                 and unsplit: tokens/s, peak and the plan's of each (2+ GPUs, as ddp)
And (a call of its own, when time is left): memory, LoRA and QLoRA peaks against the plan.
The grpo call (issue 75; `run.sh grpo`):
    grpo-sampling GRPO's sampling engine on the ~1B model: tokens/s at 8 and 32 rows, and the
                 share of the peak it reaches against the one the planner assumes
The fp8 call (issue 58; `run.sh fp8`), bf16 then fp8, both compiled, 12 steps each:
    fp8-1b       the ~1B Llama full fine-tune (float8 all-gathers): tokens/s, peak against
                 `ftjob plan`, the losses
    fp8-8b       Llama-3-8B-shaped LoRA at seq 4096 (the frozen base's linears in float8)

Each result is appended to DIR/results.jsonl (one JSON object a line) the moment it exists, and
every child's output is printed as it comes (run.sh tees it to DIR/STEP.log): a step cut off by
its time limit still leaves what it had. ``--sizes tiny`` is the CPU rehearsal's: the tiny
model at every size, seq 64, one CPU process, the same steps, files and fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench import common, gpu

STEPS = ("profile", "versus-trl", "compile-3b", "offload", "ckpt-stall", "lora-8b", "ddp",
         "context", "memory", "grpo-sampling", "fp8-1b", "fp8-8b")  # fmt: skip
PROFILED = 3  # steps under the profiler, after ftjob.trainer.report.profile.WARMUP
NEMO_8B_LORA = 12473  # tok/s, Llama-3-8B LoRA seq 4096 on one H100 (NeMo's published table)


def record(out: Path, step: str, **fields) -> None:
    """One result line in out/results.jsonl, written and flushed now."""
    line = json.dumps({"step": step, "time": round(time.time()), **fields}, default=str)
    with (out / "results.jsonl").open("a") as f:
        f.write(line + "\n")
    print(f"RESULT {line}", flush=True)


def streamed(cmd: list[str], env: dict | None = None, on_line=None) -> str:
    """Run ``cmd`` in the repo, printing its output as it comes (and handing each line to
    ``on_line``); all of it, or raise."""
    proc = subprocess.Popen(cmd, cwd=common.ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
        if on_line:
            on_line(line)
    if proc.wait() != 0:
        raise RuntimeError(f"{cmd[2:4]} failed (exit {proc.returncode}); output above")
    return "".join(lines)


def ftjob(doc: dict, work: Path, args: tuple[str, ...] = ()) -> tuple[common.Run, str]:
    """``ftjob run`` of ``doc`` (with ``args``) in a fresh folder, output streamed; the run and
    its stdout."""
    folder = work / "runs" / doc["metadata"]["name"]
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    job_file = folder / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    started = time.monotonic()
    out = streamed([sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir",
                    str(folder / "job"), *args])  # fmt: skip
    job_dir = folder / "job"
    progress = json.loads((job_dir / "progress.json").read_text())
    log = [json.loads(x) for x in (job_dir / "progress.jsonl").read_text().splitlines() if x]
    # The export is not measured: free the disk (tmpfs on the GPU machine) for the next step.
    subprocess.run(["rm", "-rf", str(job_dir / "model"), str(job_dir / "checkpoints")])
    return common.Run(time.monotonic() - started, progress, log, out[-2000:]), out


def attention_kernel(stdout: str) -> str | None:
    """What the trainer said computes attention (its ``attention: ...`` log line)."""
    found = re.findall(r"^attention: (.+)$", stdout, re.MULTILINE)
    return found[-1].strip() if found else None


def planned_mib(doc: dict, model: Path, settings: dict) -> float:
    """`ftjob plan`'s per-device estimate, at the sharding and activation checkpointing the
    trainer chose (``settings``: :func:`chosen`; auto resolves by the GPU's memory, which a
    plan of the bare spec does not know), less its fixed CUDA/NCCL reserve (which
    torch.cuda.max_memory_allocated does not count)."""
    from ftjob.api.jobspec import parse_spec
    from ftjob.plan.layout import estimate
    from ftjob.plan.modelshape import ModelShape

    spec = json.loads(json.dumps(doc["spec"]))
    if settings.get("sharding"):
        spec.setdefault("parallelism", {})["sharding"] = settings["sharding"]
    if settings.get("activationCheckpointing"):
        spec["training"]["activationCheckpointing"] = settings["activationCheckpointing"]
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    e = estimate(parse_spec(spec), shape)
    return (e.per_device - e.reserved) / 2**20


def peak_fields(run: common.Run, doc: dict, model: Path) -> dict:
    peaks = run.progress.get("trainPeakGpuMiB")  # per rank; absent on CPU
    planned = planned_mib(doc, model, chosen(run))
    measured = max(peaks) if peaks else None
    return {"peakGpuMiB": peaks, "plannedMiB": round(planned),
            "peakOverPlan": round(measured / planned, 3) if measured else None}  # fmt: skip


def sized(s: gpu.Setup, shape: str, **sizes) -> gpu.Setup:
    """``s`` at the GPU call's ``shape`` (a key of common.SHAPES) and ``sizes``; the rehearsal
    keeps its tiny model and sizes at every step."""
    return dataclasses.replace(s, shape=shape, **sizes) if s.gpu else s


def default_job(s: gpu.Setup, work: Path, method: str = "full", tag: str = "default") -> dict:
    """``s``'s job at ftjob's defaults: sharding, activation checkpointing, compile on auto."""
    doc = gpu.job(method, gpu.model_folder(s, work), gpu.data(work, s), s)
    doc["metadata"]["name"] += f"-{tag}"
    del doc["spec"]["training"]["activationCheckpointing"]
    return doc


def chosen(run: common.Run) -> dict:
    """What auto chose, as the trainer reported it (progress.json), in the spec's words."""
    from ftjob.plan.estimate import stride_name

    stride = run.progress.get("activationCheckpointing")  # layers between recomputed ones
    return {"sharding": run.progress.get("sharding"), "compiled": run.progress.get("compiled"),
            "activationCheckpointing": None if stride is None else stride_name(stride)}  # fmt: skip


def rate_fields(run: common.Run, doc: dict, s: gpu.Setup, work: Path, stdout: str) -> dict:
    model = Path(doc["spec"]["model"]["source"])
    rate = run.steady_tokens_per_second(skip=s.skip)
    length = gpu.attention_length(work / "runs" / doc["metadata"]["name"])
    return {"tokensPerSecond": round(rate, 1), "attentionLength": round(length, 1),
            "mfu": gpu.mfu(rate, model, doc["spec"]["method"]["type"], s, length),
            "attention": attention_kernel(stdout)}  # fmt: skip


def profile_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    from ftjob.trainer.report import profile

    short = dataclasses.replace(s, steps=profile.WARMUP + PROFILED)
    doc = default_job(short, work, tag="profile")
    run, _ = ftjob(doc, work, ("--profile-steps", str(PROFILED)))
    found = work / "runs" / doc["metadata"]["name"] / "job" / "logs" / "profile"
    shutil.copyfile(found / "summary.json", out / "profile.json")
    summary = json.loads((found / "summary.json").read_text())
    record(out, step, **summary, **chosen(run), setup=short.__dict__)


def versus_trl_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    """ftjob's default job, then TRL at its defaults and TRL with the settings ftjob ran."""
    doc = default_job(s, work)
    run, stdout = ftjob(doc, work)
    fields, settings = rate_fields(run, doc, s, work, stdout), chosen(run)
    model = Path(doc["spec"]["model"]["source"])
    record(out, "ftjob-default", **fields, **settings, **peak_fields(run, doc, model),
           losses=run.losses(), wallSeconds=round(run.wall, 1), setup=s.__dict__)  # fmt: skip
    length = fields["attentionLength"]
    trl_step("trl-defaults", s, work, out, ["--trl-defaults"], length)
    same = ["--attention", "ftjob"]  # ftjob's packed attention; the worker packs as ftjob does
    same += ["--fsdp"] if settings["sharding"] not in (None, "none") else []
    # TRL recomputes every layer or none: every-N counts as on.
    recomputed = settings["activationCheckpointing"] not in (None, "none")
    trl_step("trl-same", s, work, out, same + (["--activation-checkpointing"] if recomputed
                                              else []), length)  # fmt: skip


def trl_step(step: str, s: gpu.Setup, work: Path, out: Path, extra: list[str],
             length: float | None) -> None:  # fmt: skip
    """TRL's SFTTrainer (bench/trl_worker.py) on ``s``'s model and data with ``extra`` args;
    MFU with the attention length of ftjob's run of the same data (``length``)."""
    model, chat = gpu.model_folder(s, work), gpu.data(work, s)
    args = ["--model", str(model), "--data", str(chat), "--steps", str(s.steps), "--seq",
            str(s.seq), "--micro-batch", str(s.micro_batch), "--lr", "1e-5", "--skip",
            str(s.skip), *extra, *(["--bf16"] if s.gpu else [])]  # fmt: skip
    started = time.monotonic()

    def recorded(line: str) -> None:  # at once: TRL's processes may take long to exit
        if not line.startswith("TRL "):
            return
        trl = json.loads(line[4:])
        rate = trl["tokensPerSecond"]
        record(out, step, tokensPerSecond=round(rate, 1), args=extra,
               mfu=gpu.mfu(rate, model, "full", s, length) if length else None,
               wrapper=trl["wrapper"], attention=trl["attention"], packing=trl["packing"],
               gradientCheckpointing=trl["gradientCheckpointing"], losses=trl["losses"],
               peakGiB=trl["cudaMaxAllocatedGiB"],
               wallSeconds=round(time.monotonic() - started, 1))  # fmt: skip

    cmd = common.torchrun_command("bench.trl_worker", args, s.processes)
    streamed(cmd, {"TMPDIR": str(work / "tmp")}, recorded)


def compile_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    """The default job compiled at the second size: is the plan within 15% of its peak?"""
    big = sized(s, "3b", micro_batch=2, steps=6)
    doc = default_job(big, work, tag="compile")
    doc["spec"]["training"]["compile"] = True
    run, stdout = ftjob(doc, work)
    model = Path(doc["spec"]["model"]["source"])
    record(out, step, shape=big.shape, **rate_fields(run, doc, big, work, stdout), **chosen(run),
           **peak_fields(run, doc, model), losses=run.losses(), wallSeconds=round(run.wall, 1),
           setup=big.__dict__)  # fmt: skip


def step_seconds(run: common.Run) -> list[float]:
    """Each logged step's seconds (logEvery 1): its tokens over its tokens/s. A step's interval
    runs from the previous log to its own, so it holds the checkpoint saved before it."""
    steps = [e for e in run.log if e.get("event") == "step"]
    seen = [0] + [e["tokensSeen"] for e in steps]
    return [(seen[k + 1] - seen[k]) / e["tokensPerSecond"] for k, e in enumerate(steps)]


def stall_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    """8 steps, an asyncSave checkpoint after step 4: step 5's seconds (which hold the save)
    against the median of steps 2-4 and 6-8 (step 1 warms up)."""
    doc = default_job(dataclasses.replace(s, steps=8), work, tag="stall")
    doc["spec"]["checkpoint"].update(every=4, asyncSave=True)
    run, _ = ftjob(doc, work)
    seconds = step_seconds(run)
    usual = statistics.median(seconds[1:4] + seconds[5:])
    record(out, step, stepSeconds=[round(x, 4) for x in seconds], savedAfterStep=4,
           asyncSave=True, stallSeconds=round(seconds[4] - usual, 4),
           medianStepSeconds=round(usual, 4), wallSeconds=round(run.wall, 1))  # fmt: skip


def lora_8b_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    big = sized(s, "8b", seq=4096, micro_batch=1, steps=8)
    doc = default_job(big, work, method="lora", tag="lora")
    run, stdout = ftjob(doc, work)
    model = Path(doc["spec"]["model"]["source"])
    record(out, step, shape=big.shape, **rate_fields(run, doc, big, work, stdout), **chosen(run),
           **peak_fields(run, doc, model), yardstick=NEMO_8B_LORA, losses=run.losses(),
           wallSeconds=round(run.wall, 1), setup=big.__dict__)  # fmt: skip


def ddp_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    """The default LoRA job replicated (DDP) and fully sharded, one result each. The
    rehearsal runs it as 2 CPU processes (gloo), the plumbing the GPUs' call takes."""
    s = s if s.gpu else dataclasses.replace(s, processes=2)
    if s.processes < 2:
        record(out, step, skipped=f"{s.processes} GPU: DDP needs 2 ranks, and NCCL puts no two "
               "ranks of one communicator on one GPU")  # fmt: skip
        return
    for sharding in ("none", "full"):
        doc = default_job(s, work, method="lora", tag=f"ddp-{sharding}")
        doc["spec"]["parallelism"] = {"sharding": sharding}
        run, stdout = ftjob(doc, work)
        model = Path(doc["spec"]["model"]["source"])
        record(out, step, processes=s.processes,
               **rate_fields(run, doc, s, work, stdout), **chosen(run),
               **peak_fields(run, doc, model), plannedStepSeconds=planned_step(doc, model),
               losses=run.losses(), wallSeconds=round(run.wall, 1))  # fmt: skip


def context_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    """The default LoRA job with each sequence split over 2 processes (parallelism.
    contextParallel 2, Ulysses all-to-alls) and unsplit on the same processes: tokens/s, peak
    and the plan's step time and peak of each (what the all-to-alls cost, what the split
    saves). The rehearsal runs it as 2 CPU processes (gloo)."""
    s = s if s.gpu else dataclasses.replace(s, processes=2)
    if s.processes < 2:
        record(out, step, skipped=f"{s.processes} GPU: a split needs 2 ranks, and NCCL puts no "
               "two ranks of one communicator on one GPU")  # fmt: skip
        return
    for split in (1, 2):
        doc = default_job(s, work, method="lora", tag=f"context-{split}")
        doc["spec"]["parallelism"] = {"contextParallel": split}
        run, stdout = ftjob(doc, work)
        model = Path(doc["spec"]["model"]["source"])
        record(out, step, contextParallel=split, processes=s.processes,
               **rate_fields(run, doc, s, work, stdout), **peak_fields(run, doc, model),
               plannedStepSeconds=planned_step(doc, model), losses=run.losses(),
               wallSeconds=round(run.wall, 1))  # fmt: skip


def sampling_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    """GRPO's sampling engine alone (trainer/objectives/generate.py KvSampling, as the trainer
    runs it on one rank) on the ~1B model in bf16: tokens/s at 8 and at 32 rows of 256 new
    tokens after 128-token prompts, and the share of the device's peak that is (the planner's
    FLOPs a token: plan/estimate.py generation_seconds), against the share the planner
    assumes (GENERATION_HFU), which GRPO's planned step time rests on. The rehearsal: the tiny
    model on CPU, 2 rows of 8 tokens, no peak."""
    import torch
    from transformers import AutoModelForCausalLM

    from ftjob.plan.estimate import GENERATION_HFU
    from ftjob.plan.modelshape import ModelShape
    from ftjob.trainer.objectives.generate import KvSampling
    from ftjob.trainer.report import progress

    model = gpu.model_folder(s, work)
    device = torch.device("cuda" if s.gpu else "cpu")
    dtype = torch.bfloat16 if s.gpu else torch.float32
    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device)
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    prompt, new, sizes = (128, 256, (8, 32)) if s.gpu else (16, 8, (2,))
    peak = progress.peak_flops(torch.cuda.get_device_name(0)) if s.gpu else None
    # No end-of-sequence token: every row draws all its tokens, the planner's worst case.
    engine = KvSampling(max_new=new, temperature=1.0, top_p=1.0, eos=(), pad=0, synced=False)
    forward = 2 * shape.matmul_params + 4 * shape.hidden * (prompt + new) * shape.layers
    for rows in sizes:
        g = torch.Generator(device=device).manual_seed(rows)
        prompts = torch.randint(1, shape.vocab, (rows, prompt)).tolist()
        engine.complete(net, prompts, g)  # warm-up: the allocator's and kernels' first calls
        began = time.perf_counter()
        tokens = sum(len(c) for c in engine.complete(net, prompts, g))  # ends in host reads
        rate = tokens / (time.perf_counter() - began)
        record(out, step, rows=rows, promptTokens=prompt, newTokens=new,
               tokensPerSecond=round(rate, 1),
               hfu=round(rate * forward / peak, 4) if peak else None,
               plannedHfu=GENERATION_HFU)  # fmt: skip


def planned_step(doc: dict, model: Path) -> float | None:
    """`ftjob plan`'s step time for ``doc`` (None without a GPU type)."""
    from ftjob.api.jobspec import parse_spec
    from ftjob.plan.layout import estimate
    from ftjob.plan.modelshape import ModelShape

    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    seconds = estimate(parse_spec(doc["spec"]), shape).step_seconds
    return None if seconds is None else round(seconds, 4)


def memory_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    """LoRA and QLoRA (memory), or QLoRA with cpuOffload (offload): one result each."""
    model, chat = gpu.model_folder(s, work), gpu.data(work, s)
    cases = [("qlora", True)] if step == "offload" else [("lora", False), ("qlora", False)]
    for method, offload in cases:
        doc = gpu.job(method, model, chat, s)
        if offload:  # the 70B recipe's layout: 4-bit base sharded, states in CPU memory
            doc["metadata"]["name"] += "-offload"
            doc["spec"]["parallelism"] = {"sharding": "full", "cpuOffload": True}
        run, _ = ftjob(doc, work)
        record(out, step, method=method + (" + cpuOffload" if offload else ""),
               **peak_fields(run, doc, model), losses=run.losses(),
               wallSeconds=round(run.wall, 1))  # fmt: skip


def fp8_step(step: str, s: gpu.Setup, work: Path, out: Path) -> None:
    """bf16 then fp8, both compiled, on the same job: one result each, the moment it exists.
    The rehearsal compiles with aot_eager (run.sh) and emulates float8 on CPU."""
    if step == "fp8-8b":
        s, method = sized(s, "8b", seq=4096, micro_batch=1, steps=12), "lora"
    else:
        s, method = sized(s, "1b", steps=12), "full"
    for precision in ("bf16", "fp8"):
        doc = default_job(s, work, method=method, tag=precision)
        doc["spec"]["training"].update(precision=precision, compile=True)
        run, stdout = ftjob(doc, work)
        model = Path(doc["spec"]["model"]["source"])
        record(out, step, precision=precision, shape=s.shape, method=method,
               **rate_fields(run, doc, s, work, stdout), **chosen(run),
               **peak_fields(run, doc, model), losses=run.losses(),
               wallSeconds=round(run.wall, 1), setup=s.__dict__)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=STEPS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--sizes", choices=["gpu", "tiny"], default="gpu")
    a = p.parse_args(argv)
    s = gpu.gpu_setup() if a.sizes == "gpu" else gpu.REHEARSAL
    a.out.mkdir(parents=True, exist_ok=True)
    (a.work / "tmp").mkdir(parents=True, exist_ok=True)
    STEP_FUNCTIONS[a.step](a.step, s, a.work, a.out)
    return 0


STEP_FUNCTIONS = {"profile": profile_step, "versus-trl": versus_trl_step,
                  "compile-3b": compile_step, "offload": memory_step, "ckpt-stall": stall_step,
                  "lora-8b": lora_8b_step, "ddp": ddp_step, "context": context_step,
                  "memory": memory_step,
                  "grpo-sampling": sampling_step,
                  "fp8-1b": fp8_step,
                  "fp8-8b": fp8_step}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
