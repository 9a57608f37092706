"""GPU suite (runs only where torch.cuda.is_available()): a ~1B Llama initialised from its
config (TinyLlama-1.1B's shape), sequence 2048 packed, bf16, activation checkpointing, full
fine-tune and LoRA: ftjob (`ftjob run`, one process per GPU) against TRL SFTTrainer with
accelerate FSDP2 on the same GPUs.

Like with like: both sides pack whole documents best-fit-decreasing into rows of `seq`
tokens, each document attending only to itself (TRL padding-free), through the same
attention (ftjob's packed implementation: torch's varlen flash kernel), recomputing every
decoder layer (non-reentrant checkpointing), fp32 master weights and bf16 compute (a bf16
frozen base for LoRA). Tokens/s is the mean of per-step rates after ``skip`` warm-up steps
on both sides, and MFU = that x flops/token / (peak x GPUs), both sides with ftjob's flop
count (docs/progress.md), its attention term from the documents' real lengths.

``compare`` takes the sizes and the device as a ``Setup``: the GPU suite is ``gpu_setup()``;
``python -m bench.gpu_kit.rehearse compare`` runs the very same code with ``SMOKE`` (the tiny
model on 2 CPU processes), so that the suite's plumbing is exercised before a GPU session.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from bench import common
from bench.report import row

MFU_GOAL = 0.45  # issue 7: a ~1B full fine-tune on one H100


@dataclass(frozen=True)
class Setup:
    shape: str  # a key of common.SHAPES
    seq: int
    micro_batch: int
    steps: int
    processes: int  # one per GPU, or CPU processes
    gpu: bool
    repeat_data: int  # copies of the tiny chat data; 0: as many as the steps need (copies())
    skip: int  # warm-up steps (allocation, autotuning) left out of tokens/s on both sides


def gpu_setup() -> Setup:
    import torch

    return Setup("1b", seq=2048, micro_batch=4, steps=12, processes=torch.cuda.device_count(),
                 gpu=True, repeat_data=0, skip=3)  # fmt: skip


SMOKE = Setup("tiny", seq=64, micro_batch=2, steps=4, processes=2, gpu=False, repeat_data=1,
              skip=2)  # fmt: skip
# The GPU call's rehearsal on CPU (bench/gpu_kit/run.sh rehearse): one process, as on the one GPU.
REHEARSAL = Setup("rehearsal", seq=64, micro_batch=2, steps=4, processes=1, gpu=False,
                  repeat_data=1, skip=1)  # fmt: skip
# The rehearsal's model: the tiny model's vocabulary, wide enough that every linear weight
# splits into whole NF4 blocks (QLoRA), small enough for seconds per CPU step (~0.8M parameters).
REHEARSAL_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
# Every decoder layer recomputed, as TRL's gradient_checkpointing does.
CHECKPOINTING = True


def available() -> bool:
    import torch

    return torch.cuda.is_available()


def copies(s: Setup) -> int:
    """Copies of the tiny chat data that fill ``s``'s steps, a quarter to spare (packing leaves
    gaps): more only cost preparation time. Counted in the tiny tokenizer's chat template."""
    if s.repeat_data:
        return s.repeat_data
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(common.TINY_MODEL)
    chats = [json.loads(x)["messages"] for x in common.CHAT_DATA.read_text().splitlines() if x]
    per_copy = sum(len(ids) for ids in tok.apply_chat_template(chats, tokenize=True)["input_ids"])
    return max(1, math.ceil(1.25 * s.steps * s.micro_batch * s.seq * s.processes / per_copy))


def data(work: Path, s: Setup) -> Path:
    """The tiny chat data repeated as often as ``s`` needs."""
    n = copies(s)
    out = work / "data" / f"chat-x{n}.jsonl"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(common.CHAT_DATA.read_text() * n)
    return out


def model_folder(s: Setup, work: Path) -> Path:
    """``s``'s model, built once in ``work`` in bf16 (half what every run reads), on the GPU
    where there is one (initialising 1.1B parameters there takes seconds)."""
    if s.shape in ("tiny", "medium", "large", "190m"):
        return common.model_dir(s.shape, work)
    out = work / "models" / f"{s.shape}-bf16"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if s.shape == "rehearsal":
        config = LlamaConfig.from_pretrained(common.TINY_MODEL)
        for key, value in REHEARSAL_SHAPE.items():
            setattr(config, key, value)
        config.head_dim = config.hidden_size // config.num_attention_heads
    else:
        config = common.llama_config(s.shape)
    device = torch.device("cuda" if s.gpu else "cpu")
    with torch.random.fork_rng(devices=[0] if s.gpu else []), device:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(common.TINY_MODEL).save_pretrained(tmp)
    tmp.rename(out)
    # The GPU memory back before ftjob runs on it: its preflight refuses a GPU another process
    # holds over 10% of (the 3B model made here once held 15 GiB of an H200 in this process).
    del model
    if s.gpu:
        torch.cuda.empty_cache()
    return out


def attention_length(run_dir: Path) -> float:
    """sum(length^2) / sum(length) over the documents ftjob prepared for a run: a packed
    document attends only to itself, so attention costs per token as if every sequence
    were this long (12 x layers x hidden x it)."""
    from ftjob.trainer.data.batches import Sequences

    (info,) = (run_dir / "job" / "data").glob("*/info.json")
    lengths = [n for row in Sequences.open(info.parent / "train").column("seq_lengths")
               for n in row]  # fmt: skip
    return sum(n * n for n in lengths) / sum(lengths)


def mfu(tokens_per_second: float, model: Path, method: str, s: Setup,
        attention: float) -> float | None:  # fmt: skip
    """Model FLOPs utilisation by ftjob's formula; None where the device's peak is unknown.
    ``attention``: the attention length per token (:func:`attention_length`)."""
    import torch

    from ftjob.plan.modelshape import ModelShape, flops_per_token
    from ftjob.trainer.report import progress

    if not s.gpu:
        return None
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    adapter = shape.lora_params(16, ["all-linear"]) if method == "lora" else 0
    flops = flops_per_token(
        params=shape.matmul_params,
        adapter_params=adapter, layers=shape.layers, hidden=shape.hidden, seq_len=attention,
        frozen_base=method != "full",
    )  # fmt: skip
    peak = progress.peak_flops(torch.cuda.get_device_name(0))
    return tokens_per_second * flops / (peak * s.processes) if peak else None


def job(method: str, model: Path, chat: Path, s: Setup) -> dict:
    doc = common.job(f"gpu-{s.shape}-{method}", model, steps=s.steps, seq=s.seq, method=method,
                     micro_batch=s.micro_batch, nodes=1, lr=1e-5)  # fmt: skip
    spec = doc["spec"]
    spec["dataset"]["source"] = str(chat)
    spec["training"]["activationCheckpointing"] = "all" if CHECKPOINTING else "none"
    if s.gpu:
        spec["training"]["precision"] = "bf16"
        spec["resources"]["gpusPerNode"] = s.processes
    else:
        spec["resources"]["processesPerNode"] = s.processes
    return doc


def trl_args(method: str, model: Path, chat: Path, s: Setup) -> list[str]:
    args = ["--model", str(model), "--data", str(chat), "--steps", str(s.steps), "--seq",
            str(s.seq), "--micro-batch", str(s.micro_batch), "--method", method, "--lr", "1e-5",
            "--fsdp", "--skip", str(s.skip), "--attention", "ftjob"]  # fmt: skip
    args += ["--activation-checkpointing"] if CHECKPOINTING else []
    return args + (["--bf16"] if s.gpu else [])


def compare(work: Path, s: Setup, methods: list[str]) -> dict:
    model, chat = model_folder(s, work), data(work, s)
    cases, rows = [], []
    for method in methods:
        doc = job(method, model, chat, s)
        ours = common.ftjob_run(doc, work, timeout=1800)
        wall, out = common.torchrun("bench.trl_worker",
                                    trl_args(method, model, chat, s), s.processes, work,
                                    timeout=1800)  # fmt: skip
        trl = common.last_json(out, "TRL")
        mine, theirs = ours.steady_tokens_per_second(skip=s.skip), trl["tokensPerSecond"]
        length = attention_length(work / "runs" / doc["metadata"]["name"])
        m_mfu, t_mfu = mfu(mine, model, method, s, length), mfu(theirs, model, method, s, length)
        cases.append({"method": method, "ftjob": mine, "trl": theirs, "ftjobMfu": m_mfu,
                      "trlMfu": t_mfu, "trlWrapper": trl["wrapper"],
                      "trlAttention": trl["attention"], "trlPacking": trl["packing"],
                      "attentionLength": length, "skip": s.skip,
                      "ftjobLosses": ours.losses(), "trlLosses": trl["losses"]})  # fmt: skip
        where = f"{s.processes} GPU, bf16" if s.gpu else f"{s.processes} CPU processes, fp32"
        params = common.param_count(model) / 1e6
        label = f"{params:,.0f}M {method}, {where}, seq {s.seq} x mb {s.micro_batch}"
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
                goal=f">= {MFU_GOAL}" if full else "-",
                met=(m_mfu or 0) >= MFU_GOAL if full else None,
            )
        )
    return {"setup": s.__dict__, "cases": cases, "rows": rows}


def memory(work: Path, s: Setup) -> dict:
    """LoRA (bf16 frozen base) and QLoRA (NF4 base sharded under NCCL) on the GPUs: peak GPU
    memory per rank against `ftjob plan`'s estimate (less its fixed CUDA/NCCL reserve, which
    the allocator does not count), and the QLoRA loss curve next to LoRA's."""
    from ftjob.api.jobspec import parse_spec
    from ftjob.plan.layout import estimate
    from ftjob.plan.modelshape import ModelShape

    model, chat = model_folder(s, work), data(work, s)
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    cases, rows = [], []
    # The last is the 70B recipe's layout: 4-bit base sharded, states in CPU memory (the
    # gradient clipping and export gather on CPU tensors need gloo beside NCCL).
    for method, offload in (("lora", False), ("qlora", False), ("qlora", True)):
        doc = job(method, model, chat, s)
        if offload:
            doc["metadata"]["name"] += "-offload"
            doc["spec"]["parallelism"] = {"sharding": "full", "cpuOffload": True}
            method += " + cpuOffload"
        ours = common.ftjob_run(doc, work, timeout=1800)
        measured = max(ours.progress.get("trainPeakGpuMiB") or [0])
        e = estimate(parse_spec(doc["spec"]), shape)
        planned = (e.per_device - e.reserved) / 2**20
        cases.append({"method": method, "peakGpuMiB": ours.progress.get("trainPeakGpuMiB"),
                      "plannedMiB": planned, "losses": ours.losses()})  # fmt: skip
        rows.append(row(f"peak GPU MiB per rank, {shape.params / 1e6:,.0f}M {method}, "
                        f"{s.processes} GPU", measured, planned, "ftjob plan", measured / planned,
                        "within +-30%", abs(measured / planned - 1) <= 0.3))  # fmt: skip
    return {"cases": cases, "rows": rows}


def run(work: Path, quick: bool) -> dict:
    result = compare(work, gpu_setup(), ["full"] if quick else ["full", "lora"])
    mem = memory(work, gpu_setup())
    return {**result, "memory": mem["cases"], "rows": result["rows"] + mem["rows"]}
