"""method: a full fine-tune, LoRA or QLoRA, with the adapter and 4-bit settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ftjob.api.schema import api_field


@dataclass(kw_only=True)
class LoraSpec:
    """lora: low-rank adapter settings (peft)."""

    r: int = api_field("r: rank of the adapter matrices.", 16, minimum=1, maximum=1024)
    alpha: float = api_field(
        "alpha scales the adapter update by alpha/r.", 32.0, minimum=0, exclusive_minimum=True
    )
    dropout: float = api_field("dropout on the adapter input.", 0.05, minimum=0, maximum=0.9)
    target_modules: list[str] = api_field(
        "targetModules: module names to adapt, or [all-linear] for every linear layer but "
        "the output head.",
        factory=lambda: ["all-linear"],
        min_items=1,
        max_items=64,
        pattern=r"^[^\s]+$",
        pattern_hint="be a module name (e.g. q_proj) without spaces",
        max_length=128,
    )


@dataclass(kw_only=True)
class QuantizationSpec:
    """quantization: how QLoRA stores the frozen base weights (torchao NF4, sharded by FSDP2)."""

    type: Literal["nf4", "fp4"] = api_field("type of 4-bit storage.", "nf4")
    double_quant: bool = api_field(
        "doubleQuant also quantizes the quantization constants (saves ~0.4 bit/param).", True
    )


METHODS = ("full", "lora", "qlora")  # method.type (and a profile's limits.allowedMethods)


@dataclass(kw_only=True)
class MethodSpec:
    """method: full fine-tune, LoRA or QLoRA."""

    type: Literal[METHODS] = api_field(  # type: ignore[valid-type]
        "type: full trains every weight; lora trains adapters on a frozen base; qlora trains "
        "adapters on a 4-bit base.",
        "lora",
    )
    lora: LoraSpec | None = api_field("lora settings (lora and qlora; defaults apply).", None)
    quantization: QuantizationSpec | None = api_field(
        "quantization of the base model (qlora only); default {type: nf4, doubleQuant: true}.",
        None,
    )

    def lora_settings(self) -> LoraSpec | None:
        """The adapter settings in force, or None for a full fine-tune."""
        if self.type == "full":
            return None
        return self.lora or LoraSpec()

    def quantization_settings(self) -> QuantizationSpec | None:
        """The 4-bit storage in force: qlora without a quantization block gets the defaults
        (every field has one), other methods none."""
        if self.type != "qlora":
            return None
        return self.quantization or QuantizationSpec()
