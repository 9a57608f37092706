"""model: the base model a job fine-tunes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ftjob.api.jobspec.fields import SOURCE_HINT, SOURCE_PATTERN
from ftjob.api.schema import api_field


@dataclass(kw_only=True)
class ModelSpec:
    """model: the base model to fine-tune."""

    source: str = api_field(
        "source of the weights: hf://org/name from the Hugging Face Hub, or a folder path. A "
        "relative path is read from the shared volume (cluster) or beside the job file "
        "(ftjob run).",
        pattern=SOURCE_PATTERN,
        pattern_hint=SOURCE_HINT,
        max_length=512,
        example="hf://meta-llama/Meta-Llama-3-8B",
    )
    revision: str | None = api_field(
        "revision (branch, tag or commit) of an hf:// source.", None, min_length=1, max_length=128
    )
    attention: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = api_field(
        "attention implementation; each keeps packed documents apart at every microBatchSize. "
        "sdpa: ftjob's packed attention, torch's varlen flash kernel on GPUs (bf16) and one "
        "scaled_dot_product_attention per document elsewhere, no sequence x sequence mask; "
        "flash_attention_2/3: the flash-attn packages' varlen kernels (GPUs, installed "
        "separately); eager: transformers' dense-mask reference, slow, for checking.",
        "sdpa",
    )
    trust_remote_code: bool = api_field(
        "trustRemoteCode runs Python code shipped with the model. Off unless you trust it.",
        False,
    )
