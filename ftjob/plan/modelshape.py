"""The shape of a decoder-only transformer: what memory and FLOPs depend on.

Read from a model's config.json, or, for hf:// sources that cannot be read offline, from a
table of well-known models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ftjob.api.source import Hub, parse

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that memory and FLOPs depend on."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    checkpoint_bytes: int = 2  # bytes per weight as published (bf16 for the known models)

    @classmethod
    def from_config(cls, config: dict, name: str = "model") -> ModelShape:
        try:
            heads = config["num_attention_heads"]
            return cls(
                name=name,
                hidden=config["hidden_size"],
                layers=config["num_hidden_layers"],
                heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads,
                intermediate=config["intermediate_size"],
                vocab=config["vocab_size"],
                tied=bool(config.get("tie_word_embeddings", False)),
                checkpoint_bytes=DTYPE_BYTES.get(
                    str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"), 4
                ),
            )
        except KeyError as e:
            raise ValueError(f"{name}: config.json has no {e.args[0]}; cannot plan") from e

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def attention_params(self) -> int:
        return self.hidden * (2 * self.hidden + 2 * self.kv_dim)  # q, o and k, v

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate  # gate, up, down

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters that cost FLOPs: all but an untied input embedding (a lookup)."""
        return self.params - (0 if self.tied else self.vocab * self.hidden)

    @property
    def linear_params(self) -> int:
        """Weights of the decoder layers' linear layers: what LoRA adapts and QLoRA quantizes."""
        return self.layers * (self.attention_params + self.mlp_params)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear weight of a decoder layer (the same in every layer)."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip

    def adapted_input_width(self, targets: list[str]) -> int:
        """Summed input widths of the adapted linear layers of one decoder layer."""
        widths = {"q_proj": self.hidden, "k_proj": self.hidden, "v_proj": self.hidden}
        widths |= {"o_proj": self.hidden, "gate_proj": self.hidden, "up_proj": self.hidden}
        widths["down_proj"] = self.intermediate
        if "all-linear" in targets:
            return sum(widths.values())
        return sum(widths.get(t, 0) for t in targets)

    def lora_params(self, r: int, targets: list[str]) -> int:
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        shapes = {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        chosen = (
            shapes if "all-linear" in targets else {t: shapes[t] for t in targets if t in shapes}
        )
        return self.layers * sum(r * (a + b) for a, b in chosen.values())


def _llama(name, hidden, layers, heads, kv, inter, vocab, tied=False):
    return ModelShape(name, hidden, layers, heads, kv, inter, vocab, tied)


# Well-known models, matched on the hf:// repository name (case-insensitive; -hf, -Instruct
# and -chat variants share a shape).
KNOWN_MODELS = [
    (r"llama-2-7b", _llama("Llama-2-7B", 4096, 32, 32, 32, 11008, 32000)),
    (r"llama-2-13b", _llama("Llama-2-13B", 5120, 40, 40, 40, 13824, 32000)),
    (r"llama-2-70b", _llama("Llama-2-70B", 8192, 80, 64, 8, 28672, 32000)),
    (r"llama-3(\.1)?-8b", _llama("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256)),
    (r"llama-3(\.[13])?-70b", _llama("Llama-3-70B", 8192, 80, 64, 8, 28672, 128256)),
    (r"llama-3\.1-405b", _llama("Llama-3.1-405B", 16384, 126, 128, 8, 53248, 128256)),
    (r"llama-3\.2-1b", _llama("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, tied=True)),
    (r"llama-3\.2-3b", _llama("Llama-3.2-3B", 3072, 28, 24, 8, 8192, 128256, tied=True)),
    (r"mistral-7b", _llama("Mistral-7B", 4096, 32, 32, 8, 14336, 32768)),
    (r"qwen2\.5-7b", _llama("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064)),
]


def shape_for(source: str, config: dict | None) -> ModelShape:
    """The model's shape from its config.json, or from the table for hf:// sources."""
    if config is not None:
        return ModelShape.from_config(config, parse(source).name)
    shape = known_model(source)
    if shape is None:
        raise ValueError(
            f"spec.model.source: {source} is not a model ftjob knows offline; plan it from a "
            "folder with its config.json"
        )
    return shape


def known_model(source: str) -> ModelShape | None:
    """The shape of a well-known hf:// model, or None."""
    found = parse(source)
    if not isinstance(found, Hub):
        return None
    repo = found.repo.lower()
    for pattern, shape in KNOWN_MODELS:
        if re.search(rf"(^|/)(meta-)?{pattern}($|[-_/])", repo):
            return shape
    return None


def model_flops(
    params: int,
    adapter_params: int,
    layers: int,
    hidden: int,
    frozen_base: bool,
    tokens: int,
    attention_sq: int,
) -> float:
    """Model FLOPs of one forward and backward over ``tokens`` tokens: THE definition behind
    MFU, for the planner and for the trainer's live figure alike.

    ``(6·N or 4·N + 6·A)·tokens + 12·layers·hidden·attention_sq``:

    * ``params`` (N) excludes the input embedding (a lookup; a tied one still counts as the
      output head). A trained weight costs 6 FLOPs a token: 2 forward, 2 for the input
      gradient, 2 for its own gradient. With a frozen base (LoRA, QLoRA) the base weights
      need no weight gradient and cost 4; the adapters (A) cost 6.
    * Attention's two matmuls (scores q·kᵀ and their product with v) cost 2·hidden FLOPs per
      query-key pair each, forward; with the backward (twice the forward) 12·hidden per pair
      and layer: the count of PaLM's MFU (Chowdhery et al. 2022), without causal halving.
      A packed document attends only to itself, so the pairs are ``attention_sq``, the sum
      over documents of length² (the planner, which assumes every document is maxSeqLength
      long, passes tokens·maxSeqLength).

    Recomputation by activation checkpointing is not counted: it is not the model's work,
    and MFU compares setups that recompute differently.
    """
    matmul = 4 * params + 6 * adapter_params if frozen_base else 6 * params
    return float(matmul * tokens + 12 * layers * hidden * attention_sq)


def flops_per_token(
    params: int, adapter_params: int, layers: int, hidden: int, seq_len: int, frozen_base: bool
) -> float:
    """:func:`model_flops` of one token of a ``seq_len``-long document (the planner's view:
    every document fills maxSeqLength)."""
    return model_flops(params, adapter_params, layers, hidden, frozen_base, 1, seq_len)


# The loss computes the output head and the cross-entropy this many tokens at a time
# (trainer/objectives/loss.py), so fp32 logits never exist for a whole micro-batch.
LOSS_CHUNK_TOKENS = 1024


# torchao's NF4 stores 4-bit values in blocks of 64 and their scales, quantized again, in
# blocks of 256: a weight quantizes only whole scale blocks, and FSDP2 splits its NF4 storage
# along the first dimension without padding, so each shard must hold whole scale blocks too.
NF4_BLOCK = 64
NF4_SCALE_BLOCK = 256


def nf4_splits(rows: int, cols: int, shards: int) -> bool:
    """Whether a rows x cols weight quantizes to NF4 and splits evenly into ``shards``."""
    numel = rows * cols
    scales = NF4_BLOCK * NF4_SCALE_BLOCK
    return numel % scales == 0 and rows % shards == 0 and (numel // scales) % shards == 0


# The rule built on nf4_splits (which job is refused, with which field and fix) is
# ftjob.plan.limits.qlora_problem, shared by validate, plan, the operator and the trainer.
