"""Suite kernels: what ftjob's written-out backwards (trainer/model/lora.py's LoRA layers,
trainer/model/norms.py's RMSNorm, trainer/model/rotary.py's rotary embedding) save in a step,
against peft's and transformers' own forward;
and what sampling's weight-on-the-left products (trainer/model/thin.py) save in a GRPO
sampling (8 completions of one prompt, 16 tokens: the grpo suite's shape), against torch's
linear.

One process, one thread: the 190M Llama (--quick: the 24M one) with LoRA r16 on every linear
layer, ftjob's packed attention, one micro-batch of 512 tokens in 15 documents of 20-49
tokens (the chat data's lengths), forward, loss and backward. The variants alternate round by
round in the same process (round k runs them in turn, the order flipped every other round), so
that a busy machine slows each alike; each variant's best and median CPU time count.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import common
from bench.report import row

ROUNDS = 12
VARIANTS = (
    "peft and transformers",
    "written-out LoRA",
    "written-out LoRA and RMSNorm",
    "written-out LoRA, RMSNorm and rotary",
)
SAMPLING = ("torch's linear", "weight on the left")


def model(size: str, work: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ftjob.trainer.model import attention

    net = AutoModelForCausalLM.from_pretrained(
        common.model_dir(size, work), dtype=torch.float32,
        attn_implementation=attention.implementation("sdpa"),
    )  # fmt: skip
    config = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(net, config)


def batch(tokens: int = 512, seed: int = 1) -> tuple[torch.Tensor, dict]:
    """Input ids and the packed-attention kwargs of one flattened micro-batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(20, 50, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - tokens
    ids = torch.randint(3, 1024, (1, tokens), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                 "max_length_q": max(lengths), "max_length_k": max(lengths)}  # fmt: skip


class Switch:
    """Each LoRA layer's, RMSNorm's and attention's class, as peft and transformers build them
    and as ftjob's fuse() leaves them, to set by variant."""

    def __init__(self, net):
        from ftjob.trainer.model import lora, norms, rotary

        before = {m: type(m) for m in net.modules()}
        lora.fuse(net)
        norms.fuse(net)
        rotary.fuse(net)
        self.classes = {m: (before[m], type(m)) for m in net.modules() if type(m) is not before[m]}

    def use(self, variant: str) -> None:
        for module, (plain, fused) in self.classes.items():
            kind = next((k for k in ("Norm", "Attention") if k in plain.__name__), "LoRA")
            written = {"Norm": "RMSNorm", "Attention": "rotary", "LoRA": "LoRA"}[kind] in variant
            module.__class__ = fused if written else plain


def measure(size: str, work: Path) -> dict:
    torch.set_num_threads(1)
    net, (ids, kwargs) = model(size, work), batch()
    switch = Switch(net)

    def step() -> float:
        start = time.process_time()
        logits = net(input_ids=ids, **kwargs).logits
        F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        return time.process_time() - start

    times = {v: [] for v in VARIANTS}
    for k in range(ROUNDS):
        for variant in VARIANTS if k % 2 else VARIANTS[::-1]:
            switch.use(variant)
            step()  # the first after a switch: its allocations settle
            times[variant].append(step())
    switch.use(VARIANTS[-1])  # as ftjob builds it
    times.update(sampling(net))
    return {"size": size, "params": common.param_count(common.model_dir(size, work)),
            "swapped": len(switch.classes), "times": times,
            "best": {v: min(t) for v, t in times.items()},
            "median": {v: sorted(t)[len(t) // 2] for v, t in times.items()}}  # fmt: skip


def sampling(net) -> dict[str, list[float]]:
    """CPU seconds of a sampling by ftjob's engine, with and without thin.py's turned
    products, the two alternating round by round."""
    from unittest import mock

    from ftjob.trainer.model import thin
    from ftjob.trainer.objectives.generate import KvSampling

    engine = KvSampling(16, temperature=1.0, top_p=1.0, eos=(2,), pad=0, synced=False)
    prompts = [list(range(5, 20))] * 8
    times = {v: [] for v in SAMPLING}
    for k in range(ROUNDS):
        for variant in SAMPLING if k % 2 else SAMPLING[::-1]:
            plain = mock.patch.object(thin, "turned", lambda rows, weight: False)
            with plain if variant == SAMPLING[0] else contextlib.nullcontext():
                start = time.process_time()
                engine.complete(net, prompts, torch.Generator().manual_seed(k))
                times[variant].append(time.process_time() - start)
    return times


def run(work: Path, quick: bool) -> dict:
    c = measure("medium" if quick else "190m", work)
    size = f"{c['size']} ({c['params'] / 1e6:.0f}M) LoRA r16"
    steps = f"{size} forward + backward, 512 tokens, 1 thread, {ROUNDS} rounds"
    samplings = f"{size}, 8 completions of a 15-token prompt, 16 tokens, 1 thread, {ROUNDS} rounds"
    return {"cases": [c], "rows": _rows(c, "a step", VARIANTS, steps)
                                  + _rows(c, "a sampling", SAMPLING, samplings)}  # fmt: skip


def _rows(c: dict, unit: str, variants: tuple[str, ...], what: str) -> list[dict]:
    """Each variant but the first against the first (the library's own), best and median."""
    base = variants[0]
    return [
        row(
            f"CPU s {unit} ({kind}), {variant} vs {base}, {what}",
            c[kind][variant],
            c[kind][base],
            base,
            c[kind][base] / c[kind][variant],
        )  # fmt: skip
        for kind in ("best", "median")
        for variant in variants[1:]
    ]
