"""The DPO baseline a user would pick: TRL's DPOTrainer under torchrun (accelerate inside).

    python -m torch.distributed.run --standalone --nproc-per-node 2 --module bench.trl_dpo_worker \
        --model examples/tiny-model --data examples/data/tiny-pairs.jsonl --steps 4

Set up as bench.dpo's ftjob job is: the same model, pairs, max length per sequence,
micro-batch (pairs per rank), steps, AdamW at a constant learning rate with no warm-up or
weight decay, gradient clipping at 1.0, sigmoid loss at the same beta, fp32, no
recomputation, and LoRA with the same r, alpha and target modules whose reference is the
network with its adapters disabled (TRL's default for a PeftModel without ref_model).

Two settings make the losses comparable step by step, not only at step 1 (log 2):
- ``--in-order``: the pairs are taken in file order (a SequentialSampler instead of the
  Trainer's seeded shuffle). bench.dpo writes the file in ftjob's sampling order, and
  accelerate's sharding gives rank r of step s the micro-batch s x world + r, as ftjob does.
- the adapters' initial values are drawn as ftjob draws them (``ftjob_adapter_init``): peft's
  own reset of each LoRA layer, in module order, from one generator seeded with the job's seed.

Each rank prints ``TRL-RANK {json}`` (its peak RSS); rank 0 prints ``TRL {json}``: steady
pairs/s and tokens/s (after --skip warm-up steps) and the per-step losses.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer


class Clock(TrainerCallback):
    """Wall time at the end of every optimizer step; the logged losses, token counts and
    reward accuracies."""

    def __init__(self):
        self.ends, self.losses, self.tokens, self.accuracies = [], [], [], []

    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            # DPOTrainer's running count of attended tokens (both sequences of every pair,
            # prompts included, padding not), summed over ranks: what ftjob's tokensSeen counts.
            self.tokens.append(logs.get("num_tokens"))
            self.accuracies.append(logs.get("rewards/accuracies"))

    def steady(self, skip: int, pairs_per_step: int) -> tuple[float | None, float | None]:
        """(pairs/s, tokens/s) over the steps after the first ``skip`` (step k's time: since
        step k-1 ended, so step 1 never counts)."""
        first = max(skip, 1)
        last = min(len(self.ends), len(self.tokens)) - 1
        if last < first:
            return None, None
        seconds = self.ends[last] - self.ends[first - 1]
        pairs = pairs_per_step * (last - first + 1)
        tokens = None
        if self.tokens[last] is not None and self.tokens[first - 1] is not None:
            tokens = (self.tokens[last] - self.tokens[first - 1]) / seconds
        return pairs / seconds, tokens


def ftjob_adapter_init(model, seed: int) -> None:
    """Redraw the LoRA layers' initial values as ftjob does (ftjob.trainer.model.load's
    _init_adapters): torch seeded with the job's seed, then peft's reset of each LoRA layer in
    module order."""
    from peft.tuners.lora import LoraLayer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in model.modules():
            if isinstance(layer, LoraLayer):
                for name in layer.lora_A.keys() | layer.lora_embedding_A.keys():
                    layer.reset_lora_parameters(name, model.peft_config[name].init_lora_weights)


def parser() -> argparse.ArgumentParser:
    """The worker's arguments (bench.dpo.trl_args builds them from the suite's Setup)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=256, help="max tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="pairs per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--in-order", action="store_true", help="no shuffle: the file's order")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the rates")
    return p


def main() -> None:
    a = parser().parse_args()
    from peft import LoraConfig, get_peft_model

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation="sdpa")  # fmt: skip
    lora = LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0,
                      target_modules=a.targets.split(","), task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lora)
    ftjob_adapter_init(model, a.seed)
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-dpo-bench-"),
        max_steps=a.steps,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=1,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",  # ftjob's torch.optim.AdamW (not fused on CPU)
        beta=a.beta,
        loss_type=["sigmoid"],
        max_length=a.seq,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=a.seed,
        # TRL 1.16 defaults to both; ftjob's CPU job runs fp32 without recomputation.
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    data = load_dataset("json", data_files=a.data, split="train")
    clock = Clock()
    trainer_class = InOrder if a.in_order else DPOTrainer
    trainer = trainer_class(model=model, args=config, train_dataset=data, processing_class=tok,
                            callbacks=[clock])  # fmt: skip
    trainer.train()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pairs_per_second, tokens_per_second = clock.steady(a.skip, a.micro_batch * world)
    rank = int(os.environ.get("RANK", "0"))
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print("TRL-RANK " + json.dumps({"rank": rank, "peakRssMiB": peak}), flush=True)
    if rank == 0:
        result = {
            "pairsPerSecond": pairs_per_second,
            "tokensPerSecond": tokens_per_second,
            "losses": clock.losses,
            "rewardAccuracy": clock.accuracies,
            "stepEnds": clock.ends,
            "wrapper": type(trainer.model_wrapped).__name__,
            "inOrder": a.in_order,
        }
        print("TRL " + json.dumps(result), flush=True)


class InOrder(DPOTrainer):
    """DPOTrainer taking the pairs in the dataset's order (accelerate still shards them)."""

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


if __name__ == "__main__":
    main()
