"""The baseline a user would pick: TRL's SFTTrainer under torchrun (accelerate inside).

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/trl_worker.py \
        --model examples/tiny-model --data examples/data/tiny-chat.jsonl --steps 6

Same model, data, sequence length, micro-batch, steps and optimizer as the ftjob job that
bench.throughput generates. On CPU accelerate wraps the model in DDP (it has no FSDP on CPU),
so this is DDP versus ftjob's FSDP2; on GPUs pass --fsdp for accelerate's FSDP2.
Prints ``TRL {json}`` on rank 0: steady tokens/s (after the first step) and per-step losses.
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
from trl import SFTConfig, SFTTrainer


class Clock(TrainerCallback):
    """Wall time at the end of every optimizer step, and the logged losses."""

    def __init__(self):
        self.ends, self.losses = [], []

    def on_step_end(self, args, state, control, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--method", choices=["full", "lora"], default="full")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="accelerate FSDP2 (GPUs only)")
    p.add_argument("--activation-checkpointing", action="store_true")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(a.model)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    peft_config = None
    if a.method == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
    fsdp = {}
    if a.fsdp and cuda:
        fsdp = dict(fsdp="full_shard auto_wrap",
                    fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap":
                                 ["LlamaDecoderLayer"], "reshard_after_forward": True})  # fmt: skip
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        max_steps=a.steps,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=1,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=42,
        # TRL 1.16 defaults to both; ftjob's CPU job runs fp32 without recomputation.
        bf16=a.bf16,
        gradient_checkpointing=a.activation_checkpointing,
        max_length=a.seq,
        packing=True,
        packing_strategy="wrapped",  # ftjob's packing: one token stream cut every `seq`
        use_cpu=not cuda,
        dataloader_num_workers=0,
        **fsdp,
    )
    data = load_dataset("json", data_files=a.data, split="train")
    clock = Clock()
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok,
                         peft_config=peft_config, callbacks=[clock])  # fmt: skip
    trainer.train()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens_per_step = a.micro_batch * a.seq * world  # wrapped packing: no padding
    span = clock.ends[-1] - clock.ends[0]
    result = {
        "tokensPerSecond": tokens_per_step * (len(clock.ends) - 1) / span if span else None,
        "losses": clock.losses,
        "wrapper": type(trainer.model_wrapped).__name__,
        "peakRssMiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cudaMaxAllocatedGiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print("TRL " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
