"""GPU suite (runs only where torch.cuda.is_available()): a ~1B Llama initialised from its
config (TinyLlama-1.1B's shape), sequence 2048 packed, bf16, activation checkpointing, full
fine-tune and LoRA: ftjob (`ftjob run`, one process per GPU) against TRL SFTTrainer with
accelerate FSDP2 on the same GPUs. MFU = tokens/s x flops/token / (peak x GPUs), both sides
with ftjob's flop count (docs/progress.md)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import common
from bench.report import row

ONE_B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4,
             max_position_embeddings=4096)  # fmt: skip
SEQ, MICRO_BATCH, STEPS = 2048, 4, 12


def available() -> bool:
    import torch

    return torch.cuda.is_available()


def model_1b(work: Path) -> Path:
    common.SHAPES.setdefault("1b", ONE_B)
    return common.model_dir("1b", work)


def data(work: Path) -> Path:
    """The tiny chat data repeated: enough packed 2048-token sequences for STEPS steps."""
    out = work / "data" / "chat-x40.jsonl"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(common.CHAT_DATA.read_text() * 40)
    return out


def mfu(tokens_per_second: float, model: Path, method: str, gpus: int) -> float | None:
    import torch

    from ftjob.modelshape import ModelShape, flops_per_token
    from ftjob.trainer import progress

    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    adapter = shape.lora_params(16, ["all-linear"]) if method == "lora" else 0
    flops = flops_per_token(
        params=shape.matmul_params,
        adapter_params=adapter, layers=shape.layers, hidden=shape.hidden, seq_len=SEQ,
        frozen_base=method != "full",
    )  # fmt: skip
    peak = progress.peak_flops(torch.cuda.get_device_name(0))
    return tokens_per_second * flops / (peak * gpus) if peak else None


def run(work: Path, quick: bool) -> dict:
    import torch

    gpus = torch.cuda.device_count()
    model, chat = model_1b(work), data(work)
    cases, rows = [], []
    for method in ["full"] if quick else ["full", "lora"]:
        doc = common.job(f"gpu-1b-{method}", model, steps=STEPS, seq=SEQ, method=method,
                         micro_batch=MICRO_BATCH, nodes=1, lr=1e-5)  # fmt: skip
        doc["spec"]["dataset"]["source"] = str(chat)
        doc["spec"]["training"].update(precision="bf16", activationCheckpointing=True)
        doc["spec"]["resources"]["gpusPerNode"] = gpus
        ours = common.ftjob_run(doc, work, timeout=1800)
        args = ["--model", str(model), "--data", str(chat), "--steps", str(STEPS), "--seq",
                str(SEQ), "--micro-batch", str(MICRO_BATCH), "--method", method, "--lr", "1e-5",
                "--bf16", "--fsdp", "--activation-checkpointing"]  # fmt: skip
        wall, out = common.torchrun(str(common.ROOT / "bench" / "trl_worker.py"), args, gpus,
                                    work, timeout=1800)  # fmt: skip
        trl = common.last_json(out, "TRL")
        mine, theirs = ours.steady_tokens_per_second(skip=2), trl["tokensPerSecond"]
        m_mfu = ours.progress.get("mfu") or mfu(mine, model, method, gpus)
        t_mfu = mfu(theirs, model, method, gpus)
        cases.append({"method": method, "ftjob": mine, "trl": theirs, "ftjobMfu": m_mfu,
                      "trlMfu": t_mfu, "trlWrapper": trl["wrapper"]})  # fmt: skip
        label = f"~1B {method}, {gpus} GPU, seq {SEQ} x mb {MICRO_BATCH}, bf16"
        rows.append(
            row(
                f"tokens/s, {label}",
                mine,
                theirs,
                f"TRL SFTTrainer ({trl['wrapper']})",
                mine / theirs,
                ">= 1.1x",
                mine / theirs >= 1.1,
            )
        )
        full = method == "full"
        rows.append(
            row(
                f"MFU, {label}",
                m_mfu,
                t_mfu,
                "TRL SFTTrainer",
                goal=">= 0.45" if full else "-",
                met=(m_mfu or 0) >= 0.45 if full else None,
            )
        )
    return {"cases": cases, "rows": rows}
