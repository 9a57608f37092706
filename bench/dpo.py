"""Suite dpo: preference training (DPO, LoRA), ftjob (`ftjob run`, FSDP2, 2 nodes x 1 process)
against TRL's DPOTrainer + accelerate (torchrun, 2 processes: DDP on CPU), in one run.

Same model, pairs, max tokens per sequence, micro-batch (pairs per rank), steps, optimizer
(AdamW, constant learning rate, no warm-up or weight decay, clipping at 1.0), beta, sigmoid
loss, fp32, LoRA (r, alpha, targets); the reference is the network with its adapters off on
both sides; OMP_NUM_THREADS=1. Reported: steady pairs/s and tokens/s after the warm-up steps
(the best of ``runs`` alternating runs a side), peak RSS per rank, and both sides' per-step
losses.

The pairs are bench-made from examples/data/tiny-pairs.jsonl (``synthetic``): each prompt is
other pairs' questions and chosen answers as context, then its own question, so that a
sequence is near ``seq`` tokens (the tiny pairs are ~20) and a step's cost is the model's,
not the loop's. TRL gets them in ftjob's sampling order, unshuffled, and its adapters are
initialised as ftjob's are (bench/trl_dpo_worker.py), so the losses can be compared step by
step and not only at step 1, where both are log 2.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from bench import common
from bench.report import row

PAIRS = common.EXAMPLES / "data" / "tiny-pairs.jsonl"
WORKER = "bench.trl_dpo_worker"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASELINE = "TRL DPOTrainer"


@dataclass(frozen=True)
class Setup:
    size: str  # a key of common.SHAPES
    seq: int = 256  # max tokens per sequence (prompt + response)
    micro_batch: int = 1  # pairs per rank per step
    steps: int = 8
    skip: int = 2  # warm-up steps left out of the rates
    processes: int = 2
    lr: float = 1e-3
    beta: float = 0.1
    r: int = 16
    alpha: int = 16
    seed: int = 42
    pairs: int = 64  # pairs in the bench's data set
    runs: int = 3  # a side, alternating; the best rate of each side counts


FULL = Setup("190m")
QUICK = Setup("tiny", seq=128, steps=6, micro_batch=2, runs=1)


def synthetic(path: Path, tokenizer, seq: int, count: int, seed: int = 0) -> Path:
    """``count`` pairs whose prompt is tiny-pairs questions with their chosen answers, then the
    pair's own question, filled up to ``seq`` tokens (prompt + the longer response + EOS, with
    8 tokens to spare, so neither side truncates and cuts differently)."""
    records = [json.loads(x) for x in PAIRS.read_text().splitlines() if x.strip()]
    rng = random.Random(seed)

    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2  # BOS, EOS

    out = []
    for own in rng.sample(records, count):
        longer = max(length(own["prompt"] + own["chosen"]), length(own["prompt"] + own["rejected"]))
        context = ""
        while True:
            shot = rng.choice(records)
            block = shot["prompt"] + shot["chosen"] + "\n\n"
            if longer + length(context + block) > seq - 8:
                break
            context += block
        out.append({"prompt": context + own["prompt"], "chosen": own["chosen"],
                    "rejected": own["rejected"]})  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def ftjob_order(s: Setup, n: int) -> list[int]:
    """The pairs ftjob's sampler gives step by step, rank by rank
    (ftjob.trainer.data.batches.Sampler):
    the order that makes accelerate's sharding of an unshuffled set give each rank the same
    micro-batches."""
    from ftjob.trainer.data.batches import Sampler

    sampler = Sampler(n, s.seed, s.processes, s.micro_batch, 1)
    return [i for step in range(s.steps) for rank in range(s.processes)
            for i in sampler.indices(step, 0, rank)]  # fmt: skip


def job(name: str, model: Path, data: Path, s: Setup) -> dict:
    """The FineTuneJob: DPO with LoRA on ``data``, one process per node, fp32, no eval."""
    spec = {
        "model": {"source": str(model)},
        "dataset": {"source": str(data), "format": "preference", "maxSeqLength": s.seq},
        "method": {"type": "lora", "lora": {"r": s.r, "alpha": s.alpha, "dropout": 0.0,
                                            "targetModules": TARGETS}},
        "training": {"objective": "dpo", "dpo": {"beta": s.beta, "lossType": "sigmoid"},
                     "maxSteps": s.steps, "learningRate": s.lr, "warmup": 0,
                     "scheduler": "constant", "weightDecay": 0.0, "maxGradNorm": 1.0,
                     "microBatchSize": s.micro_batch, "activationCheckpointing": "none",
                     "logEvery": 1, "evalEvery": 0, "seed": s.seed},
        "resources": {"nodes": s.processes, "gpusPerNode": 0},
        "checkpoint": {"volume": {"claimName": "bench"}, "every": s.steps + 1, "keep": 1},
    }  # fmt: skip
    return {"apiVersion": "ftjob.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def trl_args(model: Path, data: Path, s: Setup) -> list[str]:
    return ["--model", str(model), "--data", str(data), "--steps", str(s.steps),
            "--seq", str(s.seq), "--micro-batch", str(s.micro_batch), "--lr", str(s.lr),
            "--beta", str(s.beta), "--lora-r", str(s.r), "--lora-alpha", str(s.alpha),
            "--targets", ",".join(TARGETS), "--seed", str(s.seed), "--skip", str(s.skip),
            "--in-order"]  # fmt: skip


def steady(log: list[dict], skip: int, pairs_per_step: int) -> tuple[float | None, float | None]:
    """(pairs/s, tokens/s) of ftjob's steps after the first ``skip``, from its per-step log:
    a step's seconds are its tokens (the growth of tokensSeen) over its tokensPerSecond."""
    steps = [e for e in log if e.get("event") == "step"]
    seconds = tokens = 0.0
    counted = 0
    for before, this in zip(steps, steps[1:], strict=False):
        if this["step"] <= skip or not this.get("tokensPerSecond"):
            continue
        grew = this["tokensSeen"] - before["tokensSeen"]
        seconds += grew / this["tokensPerSecond"]
        tokens += grew
        counted += 1
    if not seconds:
        return None, None
    return pairs_per_step * counted / seconds, tokens / seconds


def compare(work: Path, s: Setup) -> dict:
    from transformers import AutoTokenizer

    model = common.model_dir(s.size, work)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = synthetic(work / "dpo" / f"pairs-{s.seq}.jsonl", tokenizer, s.seq, s.pairs)
    records = data.read_text().splitlines()
    ordered = work / "dpo" / f"pairs-{s.seq}-ftjob-order.jsonl"
    ordered.write_text("".join(records[i] + "\n" for i in ftjob_order(s, len(records))))
    threads = {"OMP_NUM_THREADS": "1"}
    ours, theirs = common.alternate(
        s.runs, f"dpo-{s.size}", lambda name: job(name, model, data, s), WORKER,
        trl_args(model, ordered, s), work, s.processes, env=threads,
    )  # fmt: skip
    rates = [steady(r.log, s.skip, s.micro_batch * s.processes) for r in ours]
    pairs_per_second, tokens_per_second = max(rates, key=lambda r: r[0] or 0.0)
    best = max(theirs, key=lambda t: t["pairsPerSecond"] or 0.0)
    lengths = [len(tokenizer(json.loads(x)["prompt"])["input_ids"]) for x in records]
    return {
        "setup": s.__dict__,
        "model": s.size,
        "params": common.param_count(model),
        "promptTokens": [min(lengths), max(lengths)],
        "ftjob": {"pairsPerSecond": pairs_per_second, "tokensPerSecond": tokens_per_second,
                  "runs": [r[0] for r in rates], "losses": ours[0].losses(),
                  "wall": [r.wall for r in ours],
                  "rewardAccuracy": [e.get("rewardAccuracy") for e in ours[0].log
                                     if e.get("event") == "step"],
                  "peakRssMiB": ours[0].progress.get("trainPeakRssMiB")},
        "baseline": {**best, "runs": [t["pairsPerSecond"] for t in theirs],
                     "losses": theirs[0]["losses"], "peakRssMiB": theirs[0]["peakRssMiB"]},
    }  # fmt: skip


def rows_for(c: dict) -> list[dict]:
    s, ours, base = c["setup"], c["ftjob"], c["baseline"]
    what = (f"{c['model']} ({c['params'] / 1e6:.1f}M) LoRA r{s['r']}, {s['processes']} procs, "
            f"seq {s['seq']} x {s['micro_batch']} pair(s), {s['steps']} steps, "
            f"best of {s['runs']}")  # fmt: skip
    name = f"{BASELINE} ({base['wrapper']})"

    def ratio(a, b):
        return a / b if a and b else None

    def first(losses):
        return losses[0] if losses else None

    gap = [abs(x - y) for x, y in zip(ours["losses"], base["losses"], strict=False)]
    return [
        row(f"pairs/s after {s['skip']} warm-up steps, {what}", ours["pairsPerSecond"],
            base["pairsPerSecond"], name, ratio(ours["pairsPerSecond"], base["pairsPerSecond"])),
        row(f"tokens/s after {s['skip']} warm-up steps, {what}", ours["tokensPerSecond"],
            base["tokensPerSecond"], name, ratio(ours["tokensPerSecond"], base["tokensPerSecond"])),
        row(f"peak RSS MiB per rank (0 / 1), {what}", ours["peakRssMiB"], base["peakRssMiB"],
            name),
        row(f"loss at step 1 (log 2 = 0.693), {what}", first(ours["losses"]),
            first(base["losses"]), name),
        row(f"largest loss difference, steps 1-{len(gap)} (same pairs in the same order), {what}",
            f"{max(gap):.1e}" if gap else None),
    ]  # fmt: skip


def run(work: Path, quick: bool) -> dict:
    case = compare(work, QUICK if quick else FULL)
    return {"cases": [case], "rows": rows_for(case)}
