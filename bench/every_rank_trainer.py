"""The trainer with every rank reading the whole model itself (a plain ``from_pretrained`` on
each rank, then ``fully_shard`` splits the real weights): the baseline bench/loading.py sets
against ftjob's rank-0 loading. A benchmark's stand-in, not a way ftjob runs.

    python -m torch.distributed.run --nproc-per-node 2 bench/every_rank_trainer.py --spec JOB
"""

from __future__ import annotations

import sys

from transformers import AutoModelForCausalLM

from ftjob.trainer import model
from ftjob.trainer.__main__ import exit_now, main

_skeleton = model.build


def build(spec, tokenizer) -> model.Built:
    built = _skeleton(spec, tokenizer)  # the names and dtypes the trainer expects
    if built.quantized:
        raise SystemExit("every-rank loading is measured for full and lora jobs only")
    real = AutoModelForCausalLM.from_pretrained(
        model.resolve(spec.model.source),
        dtype=model.frozen_dtype(spec),
        attn_implementation=spec.model.attention,
        **model.hub_kwargs(spec),
    )
    model._prepare(real, tokenizer)
    real = model._adapters(real, spec)
    for p in real.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    built.model, built.read_weights = real, True
    return built


def materialize(built, d, cpu_offload=False) -> None:
    """Nothing to hand out: fully_shard already kept each rank's part of its own copy."""


model.build, model.materialize = build, materialize

if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
