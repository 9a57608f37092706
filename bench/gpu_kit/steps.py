"""The GPU call's measuring steps, one process each (bench/gpu_kit/run.sh runs them in order):

    python -m bench.gpu_kit.steps STEP --out DIR --work DIR [--sizes gpu|tiny]

    ftjob-full     ftjob's ~1B Llama full fine-tune, bf16, seq 2048 packed, 1 GPU per rank:
                   tokens/s, MFU, torch.cuda.max_memory_allocated per rank against `ftjob plan`,
                   the attention kernel the trainer ran
    ftjob-compile  the same with training.compile
    trl            TRL SFTTrainer + accelerate FSDP2 on the same job
    memory         LoRA and QLoRA: peak GPU memory against `ftjob plan`
    lora           (second call) ftjob LoRA against TRL LoRA
    offload        (second call) QLoRA with cpuOffload: peak against `ftjob plan`

Each result is appended to DIR/results.jsonl (one JSON object a line) the moment it exists, and
every child's output is printed as it comes (run.sh tees it to DIR/STEP.log): a step cut off by
its time limit still leaves what it had. ``--sizes tiny`` is the CPU rehearsal's: the tiny
model, seq 64, one CPU process, the same steps, files and fields.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench import common, gpu

STEPS = ("ftjob-full", "ftjob-compile", "trl", "memory", "lora", "offload")


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


def ftjob(doc: dict, work: Path) -> tuple[common.Run, str]:
    """``ftjob run`` of ``doc`` in a fresh folder, output streamed; the run and its stdout."""
    folder = work / "runs" / doc["metadata"]["name"]
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    job_file = folder / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    started = time.monotonic()
    out = streamed([sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir",
                    str(folder / "job")])  # fmt: skip
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


def planned_mib(doc: dict, model: Path) -> float:
    """`ftjob plan`'s per-device estimate less its fixed CUDA/NCCL reserve (which
    torch.cuda.max_memory_allocated does not count)."""
    from ftjob.api.spec import parse_spec
    from ftjob.plan.layout import estimate
    from ftjob.plan.modelshape import ModelShape

    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    e = estimate(parse_spec(doc["spec"]), shape)
    return (e.per_device - e.reserved) / 2**20


def peak_fields(run: common.Run, doc: dict, model: Path) -> dict:
    peaks = run.progress.get("trainPeakGpuMiB")  # per rank; absent on CPU
    planned = planned_mib(doc, model)
    measured = max(peaks) if peaks else None
    return {"peakGpuMiB": peaks, "plannedMiB": round(planned),
            "peakOverPlan": round(measured / planned, 3) if measured else None}  # fmt: skip


def ftjob_step(step: str, s: gpu.Setup, work: Path, out: Path, method: str = "full") -> None:
    model, chat = gpu.model_folder(s, work), gpu.data(work, s)
    doc = gpu.job(method, model, chat, s)
    if step == "ftjob-compile":
        doc["metadata"]["name"] += "-compile"
        doc["spec"]["training"]["compile"] = True
    run, stdout = ftjob(doc, work)
    rate = run.steady_tokens_per_second(skip=s.skip)
    length = gpu.attention_length(work / "runs" / doc["metadata"]["name"])
    record(out, step, method=method, tokensPerSecond=round(rate, 1),
           mfu=gpu.mfu(rate, model, method, s, length), attention=attention_kernel(stdout),
           **peak_fields(run, doc, model), attentionLength=round(length, 1),
           losses=run.losses(), wallSeconds=round(run.wall, 1), setup=s.__dict__)  # fmt: skip


def trl_step(step: str, s: gpu.Setup, work: Path, out: Path, method: str = "full") -> None:
    model, chat = gpu.model_folder(s, work), gpu.data(work, s)
    cmd = common.torchrun_command("bench.trl_worker", gpu.trl_args(method, model, chat, s),
                                  s.processes)  # fmt: skip
    started = time.monotonic()
    # The attention length of ftjob's run of the same job, where it ran (both pack alike).
    ours = work / "runs" / gpu.job(method, model, chat, s)["metadata"]["name"]
    length = gpu.attention_length(ours) if (ours / "job" / "data").is_dir() else None

    def recorded(line: str) -> None:  # at once: TRL's processes may take long to exit
        if not line.startswith("TRL "):
            return
        trl = json.loads(line[4:])
        rate = trl["tokensPerSecond"]
        record(out, step, method=method, tokensPerSecond=round(rate, 1),
               mfu=gpu.mfu(rate, model, method, s, length) if length else None,
               wrapper=trl["wrapper"], attention=trl["attention"], packing=trl["packing"],
               losses=trl["losses"], wallSeconds=round(time.monotonic() - started, 1))  # fmt: skip

    streamed(cmd, {"TMPDIR": str(work / "tmp")}, recorded)


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
    if a.step in ("ftjob-full", "ftjob-compile"):
        ftjob_step(a.step, s, a.work, a.out)
    elif a.step == "trl":
        trl_step(a.step, s, a.work, a.out)
    elif a.step == "lora":
        ftjob_step("lora-ftjob", s, a.work, a.out, "lora")
        trl_step("lora-trl", s, a.work, a.out, "lora")
    else:
        memory_step(a.step, s, a.work, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
