"""The baseline a user would pick: TRL's SFTTrainer under torchrun (accelerate inside).

    python -m torch.distributed.run --standalone --nproc-per-node 2 --module bench.trl_worker \
        --model examples/tiny-model --data examples/data/tiny-chat.jsonl --steps 6

Same model, data, sequence length, micro-batch, steps and optimizer as the ftjob job that
bench.throughput generates, and the same packed-attention semantics: TRL's best-fit-decreasing
packing, padding-free (each micro-batch flattened to one row, documents delimited by
cu_seq_lens), into a model built with ftjob's packed attention (``--attention ftjob``, the
default: torch's varlen flash kernel on GPUs, per-document SDPA on CPU), so that both sides
run the same kernel class. On CPU accelerate wraps the model in DDP (it has no FSDP on CPU),
as ftjob's sharding auto does at the bench's sizes; on GPUs pass --fsdp for accelerate's FSDP2.
Prints ``TRL {json}`` on rank 0: steady tokens/s (the median of per-step rates after --skip
warm-up steps, as bench/common.py reads ftjob's) and per-step losses.
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

from bench import common


class Clock(TrainerCallback):
    """Wall time at the end of every optimizer step; the logged losses and token counts."""

    def __init__(self):
        self.ends, self.losses, self.tokens = [], [], []
        self.first_step_at = None

    def on_step_end(self, args, state, control, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        if len(self.ends) == 1:  # wall clock, for bench/startup.py's launch-to-first-step
            self.first_step_at = time.time()

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            # SFTTrainer's running count of trained tokens, summed over ranks (padding-free:
            # the flattened rows hold no padding).
            self.tokens.append(logs["num_tokens"])

    def rates(self, skip: int) -> list[float]:
        """Tokens/s of each step after the first ``skip`` (step k's: its tokens over the time
        since step k-1 ended, so step 1 never counts)."""
        return [
            (self.tokens[k] - self.tokens[k - 1]) / (self.ends[k] - self.ends[k - 1])
            for k in range(max(skip, 1), min(len(self.ends), len(self.tokens)))
        ]

    def steady_tokens_per_second(self, skip: int) -> float | None:
        """The steady rate of :meth:`rates` (bench.common.steady, as ftjob's side takes its)."""
        rates = self.rates(skip)
        return common.steady(rates) if rates else None


def parser() -> argparse.ArgumentParser:
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
    # ftjob: ftjob's packed attention (needs ftjob importable); or a transformers name.
    p.add_argument("--attention", choices=["ftjob", "sdpa", "flash_attention_2"], default="ftjob")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of tokens/s")
    # What a user who leaves TRL alone gets: SFTConfig's own packing (none), padding, gradient
    # checkpointing (on) and transformers' own attention (sdpa); --attention and
    # --activation-checkpointing are ignored. --bf16 still says the dtype (TRL's default on GPUs).
    p.add_argument("--trl-defaults", action="store_true")
    return p


def main() -> None:
    a = parser().parse_args()
    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(a.model)
    attn = "sdpa" if a.trl_defaults else a.attention
    if attn == "ftjob":
        from ftjob.trainer.model import attention

        attn = attention.implementation("sdpa")
    # Under FSDP2 with bf16, accelerate upcasts what trains to fp32 masters and computes in
    # bf16 (MixedPrecisionPolicy): ftjob's layout for full and LoRA alike. Without FSDP a bf16
    # model would train its bf16 weights themselves (no fp32 masters; an H200's trl-same did,
    # 2026-11-30): ftjob's one-process precision is fp32 weights under bf16 autocast, which
    # bf16=True gives an fp32 model. TRL's defaults keep the checkpoint's bf16.
    dtype = torch.bfloat16 if a.bf16 and (a.fsdp or a.trl_defaults) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation=attn)
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
    ours = dict(
        # TRL 1.16 defaults to both; ftjob's CPU job runs fp32 without recomputation.
        gradient_checkpointing=a.activation_checkpointing,
        # ftjob recomputes every decoder layer with non-reentrant checkpointing.
        gradient_checkpointing_kwargs={"use_reentrant": False},
        packing=True,
        # ftjob's packing: whole documents placed best-fit-decreasing into rows of `seq`
        # tokens (longer ones truncated), each attending only to itself.
        packing_strategy="bfd",
        padding_free=True,
    )
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
        bf16=a.bf16,
        max_length=a.seq,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        **fsdp,
        **({} if a.trl_defaults else ours),
    )
    data = load_dataset("json", data_files=a.data, split="train")
    clock = Clock()
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok,
                         peft_config=peft_config, callbacks=[clock])  # fmt: skip
    trainer.train()
    result = {
        "tokensPerSecond": clock.steady_tokens_per_second(a.skip),
        "stepRates": clock.rates(a.skip),
        "firstStepAt": clock.first_step_at,
        "losses": clock.losses,
        "wrapper": type(trainer.model_wrapped).__name__,
        "attention": model.config._attn_implementation,
        "packing": config.packing_strategy if config.packing else None,
        "gradientCheckpointing": config.gradient_checkpointing,
        "peakRssMiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cudaMaxAllocatedGiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print("TRL " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
