"""Suite grpo (issue 54): GRPO with LoRA, ftjob (`ftjob run`, 2 nodes x 1 process) against TRL's
GRPOTrainer + accelerate (torchrun, 2 processes: DDP on CPU), in one run.

Same model, prompts (examples/data/tiny-prompts.jsonl), reward (examples/rewards/arithmetic.py:
partial credit for a number-shaped answer, full for the right one), completions per prompt,
completion length, completions per rank per step, sampling (temperature 1, top-p 1), loss (dapo,
beta 0, one optimizer step per generation batch), optimizer (AdamW, constant learning rate, no
warm-up or weight decay, clipping at 1.0), fp32, LoRA (r, alpha, targets, initial values); the
prompts are drawn by each side's own sampler, so the reward curves are compared as curves, not
step by step. Reported: steady steps/s after the warm-up steps (the best of ``runs`` alternating
runs a side), peak RSS per rank, each side's mean reward per step (first and last quarter, of
its first run) and completion length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench import common, dpo
from bench.report import row

PROMPTS = common.EXAMPLES / "data" / "tiny-prompts.jsonl"
REWARD = common.EXAMPLES / "rewards" / "arithmetic.py"
WORKER = "bench.trl_grpo_worker"
BASELINE = "TRL GRPOTrainer"


@dataclass(frozen=True)
class Setup:
    size: str  # a key of common.SHAPES
    steps: int = 12
    skip: int = 2  # warm-up steps left out of the rates
    generations: int = 8  # completions per prompt
    completion_length: int = 16  # tokens
    micro_batch: int = 8  # completions per rank per step
    processes: int = 2
    lr: float = 5e-3
    r: int = 16
    alpha: int = 32
    seed: int = 42
    runs: int = 3  # a side, alternating; the best rate of each side counts


FULL = Setup("190m")
QUICK = Setup("tiny", steps=6, runs=1)


def job(name: str, model: Path, s: Setup) -> dict:
    """The FineTuneJob: GRPO with LoRA on the bundled prompts, one process per node, fp32."""
    spec = {
        "model": {"source": str(model)},
        "dataset": {"source": str(PROMPTS), "format": "prompts", "maxSeqLength": 64},
        "method": {"type": "lora", "lora": {"r": s.r, "alpha": s.alpha, "dropout": 0.0,
                                            "targetModules": dpo.TARGETS}},
        "training": {"objective": "grpo",
                     "grpo": {"numGenerations": s.generations,
                              "maxCompletionLength": s.completion_length,
                              "temperature": 1.0, "topP": 1.0, "lossType": "dapo", "beta": 0.0,
                              "rewards": [{"type": "function", "name": "answer",
                                           "function": f"{REWARD}:answer"}]},
                     "maxSteps": s.steps, "learningRate": s.lr, "warmup": 0,
                     "scheduler": "constant", "weightDecay": 0.0, "maxGradNorm": 1.0,
                     "microBatchSize": s.micro_batch, "activationCheckpointing": "none",
                     "logEvery": 1, "evalEvery": 0, "seed": s.seed},
        "resources": {"nodes": s.processes, "gpusPerNode": 0},
        "checkpoint": {"volume": {"claimName": "bench"}, "every": s.steps + 1, "keep": 1},
    }  # fmt: skip
    return {"apiVersion": "ftjob.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def trl_args(model: Path, s: Setup) -> list[str]:
    return ["--model", str(model), "--data", str(PROMPTS), "--reward", f"{REWARD}:answer",
            "--steps", str(s.steps), "--generations", str(s.generations),
            "--completion-length", str(s.completion_length), "--micro-batch", str(s.micro_batch),
            "--lr", str(s.lr), "--lora-r", str(s.r), "--lora-alpha", str(s.alpha),
            "--targets", ",".join(dpo.TARGETS), "--seed", str(s.seed),
            "--skip", str(s.skip)]  # fmt: skip


def compare(work: Path, s: Setup) -> dict:
    model = common.model_dir(s.size, work)
    threads = {"OMP_NUM_THREADS": "1"}
    ours, theirs = common.alternate(
        s.runs, f"grpo-{s.size}", lambda name: job(name, model, s), WORKER,
        trl_args(model, s), work, s.processes, env=threads,
    )  # fmt: skip
    rates = [dpo.steady(r.log, s.skip, 1)[0] for r in ours]
    steps = [e for e in ours[0].log if e.get("event") == "step"]
    return {
        "setup": s.__dict__,
        "model": s.size,
        "params": common.param_count(model),
        "ftjob": {"stepsPerSecond": max(rates, key=lambda r: r or 0.0), "runs": rates,
                  "wall": [r.wall for r in ours],
                  "rewards": [e.get("reward") for e in steps],
                  "completionLengths": [e.get("completionLength") for e in steps],
                  "peakRssMiB": ours[0].progress.get("trainPeakRssMiB")},
        "baseline": {**theirs[0],
                     "stepsPerSecond": max((t["stepsPerSecond"] or 0.0) for t in theirs),
                     "runs": [t["stepsPerSecond"] for t in theirs]},
    }  # fmt: skip


def quarters(values: list) -> tuple[float | None, float | None]:
    """The mean of the first and of the last quarter of a curve (at least one point each)."""
    kept = [v for v in values if v is not None]
    if not kept:
        return None, None
    n = max(1, len(kept) // 4)
    return sum(kept[:n]) / n, sum(kept[-n:]) / n


def rows_for(c: dict) -> list[dict]:
    s, ours, base = c["setup"], c["ftjob"], c["baseline"]
    what = (f"{c['model']} ({c['params'] / 1e6:.1f}M) LoRA r{s['r']}, {s['processes']} procs, "
            f"{s['micro_batch']} completions a rank of {s['completion_length']} tokens, "
            f"{s['generations']} a prompt, {s['steps']} steps, best of {s['runs']}")  # fmt: skip
    name = f"{BASELINE} ({base.get('wrapper')})"
    mine, theirs = ours["stepsPerSecond"], base["stepsPerSecond"]
    first, last = quarters(ours["rewards"])
    base_first, base_last = quarters(base["rewards"])
    return [
        row(f"steps/s after {s['skip']} warm-up steps, {what}", mine, theirs, name,
            mine / theirs if mine and theirs else None),
        row(f"peak RSS MiB per rank (0 / 1), {what}", ours["peakRssMiB"], base["peakRssMiB"], name),
        row(f"mean reward, first quarter of the steps, {what}", first, base_first, name),
        row(f"mean reward, last quarter of the steps, {what}", last, base_last, name),
        row(f"reward per step, {what}", _curve(ours["rewards"]), _curve(base["rewards"]), name),
    ]  # fmt: skip


def _curve(values: list) -> str:
    return " ".join("-" if v is None else f"{v:.3f}" for v in values)


def run(work: Path, quick: bool) -> dict:
    case = compare(work, QUICK if quick else FULL)
    return {"cases": [case], "rows": rows_for(case)}
