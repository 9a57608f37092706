"""The GRPO baseline a user would pick: TRL's GRPOTrainer under torchrun (accelerate inside).

    python -m torch.distributed.run --standalone --nproc-per-node 2 --module bench.trl_grpo_worker \
        --model examples/tiny-model --data examples/data/tiny-prompts.jsonl --steps 4

Set up as bench.grpo's ftjob job is: the same model, prompts, reward (examples/rewards/
arithmetic.py's ``answer``, called with TRL's arguments), completions per prompt, completion
length, completions per rank per step, temperature 1 and top-p 1, the dapo loss with beta 0 and
one optimizer step per generation batch, AdamW at a constant learning rate with no warm-up or
weight decay, clipping at 1.0, fp32, no recomputation, LoRA with the same r, alpha and targets
(adapters initialised as ftjob's: bench.trl_dpo_worker.ftjob_adapter_init).

Each rank prints ``TRL-RANK {json}`` (its peak RSS); rank 0 prints ``TRL {json}``: steady
steps/s after --skip warm-up steps, and each step's mean reward and completion length.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import tempfile
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from bench.trl_dpo_worker import ftjob_adapter_init


class Clock(TrainerCallback):
    """Wall time at the end of every optimizer step; each logged step's reward and length."""

    def __init__(self):
        self.ends, self.rewards, self.lengths = [], [], []

    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            self.rewards.append(logs["reward"])
            self.lengths.append(logs.get("completions/mean_length"))

    def steps_per_second(self, skip: int) -> float | None:
        """Steps after the first ``skip`` over their time (step k's: since step k-1 ended)."""
        first, last = max(skip, 1), len(self.ends) - 1
        if last < first:
            return None
        return (last - first + 1) / (self.ends[last] - self.ends[first - 1])


def user_reward(path: str, name: str):
    """The job's reward function from its file, called as TRL calls one: the dataset's other
    columns come as keyword lists; ftjob also passes the records whole, so build them here."""
    spec = importlib.util.spec_from_file_location("bench_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name)

    def reward(prompts, completions, answer, **_):
        return fn(prompts=prompts, completions=completions, records=[{"answer": a} for a in answer])

    reward.__name__ = name
    return reward


def parser() -> argparse.ArgumentParser:
    """The worker's arguments (bench.grpo.trl_args builds them from the suite's Setup)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--reward", required=True, help="path.py:function")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--completion-length", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8, help="completions per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the rate")
    return p


def config(a: argparse.Namespace) -> GRPOConfig:
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-bench-"),
        max_steps=a.steps,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=1,
        num_generations=a.generations,
        max_completion_length=a.completion_length,
        temperature=1.0,
        top_p=1.0,
        loss_type="dapo",
        beta=0.0,
        num_iterations=1,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=a.seed,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )


def main() -> None:
    a = parser().parse_args()
    from peft import LoraConfig, get_peft_model

    tok = AutoTokenizer.from_pretrained(a.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation="sdpa")  # fmt: skip
    lora = LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0,
                      target_modules=a.targets.split(","), task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lora)
    ftjob_adapter_init(model, a.seed)
    path, _, name = a.reward.rpartition(":")
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[user_reward(path, name)], args=config(a),
                          train_dataset=load_dataset("json", data_files=a.data, split="train"),
                          processing_class=tok, callbacks=[clock])  # fmt: skip
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print("TRL-RANK " + json.dumps({"rank": rank, "peakRssMiB": peak}), flush=True)
    if rank == 0:
        print("TRL " + json.dumps({
            "stepsPerSecond": clock.steps_per_second(a.skip), "rewards": clock.rewards,
            "completionLengths": clock.lengths, "wrapper": type(trainer.model_wrapped).__name__,
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
