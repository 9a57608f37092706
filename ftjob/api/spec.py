"""The FineTuneJob spec: the one source of truth for the API.

The CRD schema (``ftjob crd``), ``ftjob validate``, the operator and the trainer all read
these classes. Each field's docstring becomes its ``kubectl explain`` text. Parse a spec with
:func:`parse_spec`; it raises :class:`~ftjob.api.schema.SpecError` naming every bad field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ftjob import __version__
from ftjob.api import contract, promotion
from ftjob.api import kubevalidation as kv
from ftjob.api.hardware import FP8_GPU_TYPES, GPUS, RETIRED_GPU_TYPES
from ftjob.api.objectives import OBJECTIVES
from ftjob.api.rewards import UNIQUE_NAMES, RewardSpec
from ftjob.api.schema import (
    QUANTITY_PATTERN,
    FieldError,
    FreeForm,
    IntOrString,
    Rule,
    SpecError,
    api_field,
    check_update,
    parse,
    unknown_field,
)
from ftjob.api.source import is_hub

GROUP, VERSION, KIND, PLURAL = "ftjob.dev", "v1alpha1", "FineTuneJob", "finetunejobs"
API_VERSION = f"{GROUP}/{VERSION}"
# What a FineTuneJob document holds at its top (a status is allowed and ignored, as by kubectl).
DOCUMENT_KEYS = ("apiVersion", "kind", "metadata", "spec", "status")
# The release's trainer image name: a placeholder (nothing is published under it), used only
# when neither spec.image nor the operator's --default-image names one.
DEFAULT_IMAGE = f"ghcr.io/ftjob/trainer:{__version__}"

DNS_LABEL = kv.DNS_LABEL
DNS_LABEL_HINT = "be a DNS label (lowercase letters, digits and '-')"
DNS_SUBDOMAIN_HINT = "be a DNS subdomain (lowercase letters, digits, '-' and '.')"
LABEL_KEY_HINT = (
    "be a label key: an optional DNS prefix and '/', then at most 63 letters, digits, '-', "
    "'_' or '.', starting and ending with a letter or digit"
)
LABEL_VALUE_HINT = (
    "be a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with "
    "a letter or digit"
)


def label_map(doc: str, max_properties: int) -> Any:
    """A map of label keys to label values (a nodeSelector, a namespace's matchLabels), checked
    as the API server checks labels."""
    return api_field(
        doc,
        factory=dict,
        max_properties=max_properties,
        key_pattern=kv.QUALIFIED_NAME,
        key_hint=LABEL_KEY_HINT,
        key_max_length=kv.QUALIFIED_NAME_MAX,
        pattern=kv.LABEL_VALUE,
        pattern_hint=LABEL_VALUE_HINT,
        max_length=63,
    )


# hf://org/name (or a legacy hf://name), s3://bucket/key-or-prefix (S3's bucket names: 3-63
# lowercase letters, digits, '.' and '-'), an absolute path, or a path relative to the job.
SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][\w.-]*(/[\w.-]+)?|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\S*)?|[^:\s]+)$"
)
SOURCE_HINT = "be hf://org/name, s3://bucket/prefix or a path (absolute on a volume, or relative)"
# output.push: destinations, each a Hub model repository, always with its namespace (a user or
# an organization), or an s3:// prefix (a bucket name as for sources, and a prefix: never a
# bucket's root).
PUSH_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\s]*[^\s/])$"
)
PUSH_HINT = (
    "be hf://org/name, the Hub model repository to upload to, e.g. hf://my-org/my-model, or "
    "s3://bucket/prefix, e.g. s3://models/llama3-8b-guanaco"
)
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# Segments start with a letter, digit or '_', so '..' (and absolute paths) cannot escape the
# job's folder. RE2, which the API server uses, has no lookahead to say it more directly.
RELATIVE_PATH = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$"
RELATIVE_PATH_HINT = "be a relative path of plain names (no '..', no leading '/')"
# What the job's folder already holds (ftjob/api/contract.py): an export there would
# overwrite it. ([.] rather than an escape: the pattern also goes into a CEL string.)
RESERVED_OUTPUT = (
    "^("
    + "|".join(n.replace(".", "[.]") for n in contract.FOLDER_DIRS + contract.FOLDER_FILES)
    + ")(/|$)"
)
# A share of all steps: 0% to 100%.
WARMUP = r"^([0-9]+|([0-9]{1,2}([.][0-9]+)?|100([.]0+)?)%)$"
# Variables ftjob sets itself for torchrun and the trainer; a user value would break wiring.
RESERVED_ENV_PREFIXES = ("PET_", "FTJOB_", "TORCHELASTIC_")
GPU_TYPES = tuple(GPUS)
_FP8_CEL = "[" + ", ".join(f"'{name}'" for name in FP8_GPU_TYPES) + "]"
# activationCheckpointing: auto, all, none or every-N (N >= 2; N = 1 is all).
CHECKPOINTING_PATTERN = r"^(auto|all|none|every-([2-9]|[1-9][0-9]{1,2}))$"
# Whether compile: unset turns torch.compile on for GPU jobs. GPU runs have shown compiled layers
# train to the same losses, 1.34-1.74x faster (bench/RESULTS.md); `ftjob plan` counts them as
# eager, 1.2-1.6x their measured peaks (an H100, 2026-12-05): on once the plan is within 15%.
COMPILE_VERIFIED_ON_GPU = False
RESERVED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "HF_TOKEN")


@dataclass(kw_only=True)
class VolumeRef:
    """A PersistentVolumeClaim shared by every pod of the job (ReadWriteMany)."""

    claim_name: str = api_field(
        "claimName of a ReadWriteMany PersistentVolumeClaim in the job's namespace.",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        pattern_hint="be a PersistentVolumeClaim name (lowercase letters, digits, '-', '.')",
        max_length=253,
    )


@dataclass(kw_only=True)
class SecretKeyRef:
    """A key of a Secret in the job's namespace; its value only ever travels as a secretKeyRef."""

    name: str = api_field(
        "name of the Secret.",
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )
    key: str = api_field(
        "key inside the Secret.",
        "token",
        pattern=kv.CONFIG_MAP_KEY,
        pattern_hint="be a Secret key: letters, digits, '-', '_' and '.' (not '.' or '..')",
        max_length=253,
    )


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


@dataclass(kw_only=True)
class DatasetSpec:
    """dataset: what to train on and how records become tokens."""

    source: str = api_field(
        "source of the data: hf://org/name, or a .jsonl/.json/.parquet/.csv file or a "
        "datasets folder saved with save_to_disk. Relative paths as for model.source.",
        pattern=SOURCE_PATTERN,
        pattern_hint=SOURCE_HINT,
        max_length=512,
    )
    split: str = api_field("split of the source to train on.", "train", min_length=1, max_length=64)
    subset: str | None = api_field(
        "subset (configuration name) of an hf:// dataset.", None, min_length=1, max_length=128
    )
    revision: str | None = api_field(
        "revision (branch, tag or commit) of an hf:// dataset; the job pins the commit it "
        "names when it first starts.",
        None,
        min_length=1,
        max_length=128,
    )
    format: Literal["text", "chat", "instruction", "preference", "prompts"] = api_field(
        "format of each record: text (one text field), chat (a list of role/content "
        "messages rendered by the tokenizer's chat template), instruction (prompt and "
        "completion fields), preference (a prompt with a chosen and a rejected response, "
        "for training.objective dpo) or prompts (a prompt to complete, for training.objective "
        "grpo; the record's other fields are kept for the rewards to read). Preference fields "
        "and prompts hold plain text or lists of role/content messages (rendered by the chat "
        "template); without a prompt field, a preference prompt is what chosen and rejected "
        "share at their start.",
        "text",
    )
    text_field: str = api_field(
        "textField holds the text (format text).", "text", min_length=1, max_length=64
    )
    messages_field: str = api_field(
        "messagesField holds the messages (format chat).", "messages", min_length=1, max_length=64
    )
    prompt_field: str = api_field(
        "promptField holds the prompt (format instruction, preference and prompts).",
        "prompt",
        min_length=1,
        max_length=64,
    )
    completion_field: str = api_field(
        "completionField holds the completion (format instruction).",
        "completion",
        min_length=1,
        max_length=64,
    )
    chosen_field: str = api_field(
        "chosenField holds the preferred response (format preference).",
        "chosen",
        min_length=1,
        max_length=64,
    )
    rejected_field: str = api_field(
        "rejectedField holds the dispreferred response (format preference).",
        "rejected",
        min_length=1,
        max_length=64,
    )
    completion_only_loss: bool = api_field(
        "completionOnlyLoss: for chat and instruction data, learn only from assistant turns / "
        "completions (the prompt still conditions them).",
        True,
    )
    max_seq_length: int = api_field(
        "maxSeqLength: tokens per training sequence; longer records are truncated.",
        2048,
        minimum=16,
        maximum=131072,
    )
    packing: bool = api_field(
        "packing puts several records in one sequence (less padding; faster); each record "
        "still attends only to itself. Preference pairs are never packed.",
        True,
    )
    packing_strategy: Literal["bfd", "wrapped"] = api_field(
        "packingStrategy: bfd (best-fit decreasing: whole records share a sequence, each "
        "with its own positions and attention, longer ones truncated) or wrapped (one "
        "token stream cut every maxSeqLength tokens; tokens attend across records).",
        "bfd",
    )
    eval_fraction: float | None = api_field(
        "evalFraction of the records held out for evaluation (0 < f < 0.5). Set this or "
        "evalSplit, not both.",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=0.5,
    )
    eval_split: str | None = api_field(
        "evalSplit: a split of the source used for evaluation.", None, min_length=1, max_length=64
    )
    max_eval_sequences: int = api_field(
        "maxEvalSequences: at most this many eval sequences (preference pairs, for format "
        "preference) are evaluated each time (the same ones every time), so a large eval set "
        "stays affordable.",
        1000,
        minimum=1,
        maximum=10_000_000,
    )


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


@dataclass(kw_only=True)
class DpoSpec:
    """dpo: direct preference optimization settings (training.objective dpo)."""

    beta: float = api_field(
        "beta: how far the policy may move from the reference model; higher keeps it closer "
        "(for ipo: the regularization strength).",
        0.1,
        minimum=0,
        exclusive_minimum=True,
        maximum=100,
    )
    loss_type: Literal["sigmoid", "ipo"] = api_field(
        "lossType: sigmoid (the DPO paper's loss) or ipo (squared loss on the per-token "
        "log-ratio margin, as TRL computes it).",
        "sigmoid",
    )
    label_smoothing: float | None = api_field(
        "labelSmoothing: the share of pairs assumed mislabelled, for the sigmoid loss only "
        "(conservative DPO): each pair's loss is (1 - e) x its loss plus e x the loss of the "
        "pair reversed. Unset is 0.",
        None,
        minimum=0,
        maximum=0.5,
        exclusive_maximum=True,
    )


@dataclass(kw_only=True)
class GrpoSpec:
    """grpo: group relative policy optimization settings (training.objective grpo), named and
    defaulted as TRL's GRPOConfig."""

    rewards: list[RewardSpec] = api_field(
        "rewards scored on each completion; the advantage is their weighted sum, normalised "
        "within each prompt's group of completions.",
        factory=list,
        max_items=16,
    )
    num_generations: int = api_field(
        "numGenerations: completions sampled per prompt (a group); the global batch of "
        "completions (microBatchSize x gradientAccumulation x processes) must divide by it.",
        8,
        minimum=2,
        maximum=1024,
    )
    max_completion_length: int = api_field(
        "maxCompletionLength: tokens a completion may have at most; the prompt keeps at most "
        "dataset.maxSeqLength minus this many of its last tokens.",
        512,
        minimum=1,
        maximum=131072,
    )
    temperature: float = api_field(
        "temperature of sampling (and of the log-probabilities the loss takes, as TRL).",
        1.0,
        minimum=0,
        exclusive_minimum=True,
        maximum=100,
    )
    top_p: float = api_field(
        "topP: sample from the smallest set of tokens whose probability reaches it.",
        1.0,
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = api_field(
        "lossType: dapo (token-level mean over the generation batch), grpo (each "
        "completion's token mean, then the mean of completions) or dr_grpo (the token sum "
        "over batch x maxCompletionLength), as TRL computes them.",
        "dapo",
    )
    epsilon: float = api_field(
        "epsilon: the clipping range of the probability ratio, below 1 (and above, unless "
        "epsilonHigh is set).",
        0.2,
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    )
    epsilon_high: float | None = api_field(
        "epsilonHigh: the clipping range above 1 (DAPO's clip-higher); unset is epsilon.",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=10,
    )
    beta: float = api_field(
        "beta: weight of the KL term to the starting model; 0 (the default) holds no "
        "reference model.",
        0.0,
        minimum=0,
        maximum=100,
    )
    num_iterations: int = api_field(
        "numIterations: optimizer steps taken on each generation batch (TRL's mu).",
        1,
        minimum=1,
        maximum=64,
    )
    scale_rewards: Literal["group", "batch", "none"] = api_field(
        "scaleRewards: divide advantages by the standard deviation of rewards in the group "
        "(group), in the whole batch (batch), or not at all (none), as TRL.",
        "group",
    )
    mask_truncated_completions: bool = api_field(
        "maskTruncatedCompletions: leave completions cut at maxCompletionLength (no stop "
        "token) out of the loss and its token count, as TRL's mask_truncated_completions; "
        "their rewards still count in their group's advantages.",
        False,
    )
    importance_sampling_level: Literal["token", "sequence"] = api_field(
        "importanceSamplingLevel: token (each token's own probability ratio, GRPO's) or "
        "sequence (one ratio per completion, the geometric mean of its tokens', GSPO's), as "
        "TRL's importance_sampling_level.",
        "token",
    )
    top_k: int = api_field(
        "topK: sample from the k most likely tokens only; 0 keeps every token (TRL's top_k).",
        0,
        minimum=0,
        maximum=1000000,
    )
    min_p: float | None = api_field(
        "minP: drop the tokens whose probability is below minP times the most likely one's "
        "(TRL's min_p); unset keeps them.",
        None,
        minimum=0,
        maximum=1,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.epsilonHigh) || self.epsilonHigh >= self.epsilon",
            lambda s: s.epsilon_high is None or s.epsilon_high >= s.epsilon,
            "epsilonHigh is the upper clipping range and may not be below epsilon; raise it, "
            "or remove it to use epsilon on both sides",
            ".epsilonHigh",
        ),
        UNIQUE_NAMES,
    )

    @property
    def upper(self) -> float:
        """The clipping range above 1."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(kw_only=True)
class TrainingSpec:
    """training: the optimisation loop."""

    objective: Literal["sft", "dpo", "grpo"] = api_field(
        "objective: sft (next-token loss on the data), dpo (direct preference optimization "
        "on chosen/rejected pairs, dataset.format preference) or grpo (reinforcement learning "
        "from rewards on completions the model samples, dataset.format prompts).",
        "sft",
    )
    dpo: DpoSpec | None = api_field("dpo settings (objective dpo; defaults apply).", None)
    grpo: GrpoSpec | None = api_field(
        "grpo settings (objective grpo; rewards are required, the rest has defaults).", None
    )
    max_steps: int | None = api_field(
        "maxSteps: optimizer steps to run. Set this or epochs.", None, minimum=1, maximum=10**8
    )
    epochs: float | None = api_field(
        "epochs: passes over the training data. Set this or maxSteps.",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=1000,
    )
    learning_rate: float | None = api_field(
        "learningRate: peak learning rate. Default 2e-4 for lora/qlora, 2e-5 for full.",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    )
    scheduler: Literal["cosine", "linear", "constant"] = api_field(
        "scheduler: learning rate decay after warmup.", "cosine"
    )
    warmup: IntOrString = api_field(
        'warmup: steps (an integer) or a share of all steps ("3%").',
        "3%",
        pattern=WARMUP,
        pattern_hint='be a number of steps (100) or a percentage from 0% to 100% ("3%")',
    )
    weight_decay: float = api_field("weightDecay of AdamW.", 0.0, minimum=0, maximum=1)
    micro_batch_size: int = api_field(
        "microBatchSize: sequences per GPU (or process) per forward pass; for objective dpo, "
        "preference pairs (two sequences each, both in the same forward); for objective grpo, "
        "completions (prompt and completion, one sequence each).",
        1,
        minimum=1,
        maximum=1024,
    )
    gradient_accumulation: int | None = api_field(
        "gradientAccumulation: micro-batches per optimizer step. Unset is 1, and for "
        "objective grpo the fewest that make a step's completions whole groups: "
        "numGenerations / gcd(microBatchSize x processes, numGenerations).",
        None,
        minimum=1,
        maximum=4096,
    )
    max_grad_norm: float = api_field(
        "maxGradNorm clips the gradient norm; 0 turns clipping off.", 1.0, minimum=0
    )
    precision: Literal["auto", "bf16", "fp32", "fp8"] = api_field(
        "precision of compute: auto is bf16 on GPUs and fp32 on CPUs (never fp8). fp8 is bf16 "
        "with the decoder layers' linear matmuls in float8 (torchao; the embedding and output "
        "projection stay bf16): faster on GPUs with float8 tensor cores (resources.gpuType "
        "L4, L40S, RTX4090, H100, H200, B200), emulated on CPU. Weights and optimizer states "
        "stay fp32 (a LoRA base: bf16), so checkpoints and exports are those of a bf16 run.",
        "auto",
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] | None = api_field(
        "fp8Recipe (advanced; precision fp8 only): how float8 values are scaled. tensorwise "
        "(the default): one scale per tensor, float8 all-gathers under FSDP; rowwise: a scale "
        "per row (more accurate, slower, torchao says).",
        None,
    )
    activation_checkpointing: str = api_field(
        "activationCheckpointing: which decoder layers keep only their input in the forward "
        "pass and recompute the rest in the backward (less memory, more compute). all: every "
        "layer (~1/3 more compute); every-N: every Nth layer (N >= 2: less recompute, more "
        "memory); none: no recompute (fastest, most memory); auto: the fastest of none, "
        "every-4, every-3, every-2 and all whose memory estimate (ftjob plan) fits the GPU, "
        "all on CPU or an unknown GPU.",
        "auto",
        pattern=CHECKPOINTING_PATTERN,
        pattern_hint="be auto, all, none or every-N with N >= 2 (e.g. every-2)",
        max_length=16,
        fixes={b: "use all (was true) or none (was false)" for b in (True, False)},
    )
    compile: bool | None = api_field(
        "compile each decoder layer with torch.compile before sharding (faster steps after "
        "a slower first one; ftjob plan counts its memory as the eager step's, an upper "
        "bound). The compiled layers are cached in the job's folder (compile-cache/): a "
        "restart loads them. Unset, ftjob decides: off on CPU; on GPUs on for precision fp8 "
        "(float8 is fast only compiled), else off until the plan counts compile's memory "
        "within 15%.",
        None,
    )
    seed: int = api_field("seed for initialisation and data order.", 42, minimum=0)
    log_every: int = api_field("logEvery: steps between progress lines.", 10, minimum=1)
    eval_every: int = api_field(
        "evalEvery: steps between evaluations (when an eval set exists); 0 evaluates only at "
        "the end.",
        100,
        minimum=0,
    )

    def fp8_scaling(self) -> str | None:
        """The float8 scaling recipe in force, or None when precision is not fp8."""
        if self.precision != "fp8":
            return None
        return self.fp8_recipe or "tensorwise"

    def dpo_settings(self) -> DpoSpec | None:
        """The DPO settings in force, or None for next-token training."""
        if self.objective != "dpo":
            return None
        return self.dpo or DpoSpec()

    def grpo_settings(self) -> GrpoSpec | None:
        """The GRPO settings in force, or None for other objectives."""
        if self.objective != "grpo":
            return None
        return self.grpo or GrpoSpec()

    def peak_learning_rate(self, method: str) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 2e-5 if method == "full" else 2e-4

    def warmup_steps(self, total_steps: int) -> int:
        if self.warmup.endswith("%"):
            return math.ceil(total_steps * float(self.warmup[:-1]) / 100)
        return int(self.warmup)


@dataclass(kw_only=True)
class ResourcesSpec:
    """resources: the shape of the gang."""

    nodes: int = api_field("nodes: pods in the gang, one per node.", 1, minimum=1, maximum=1024)
    gpus_per_node: int = api_field(
        "gpusPerNode: GPUs each pod takes, one training process each; 0 trains on CPU.",
        1,
        minimum=0,
        maximum=64,
    )
    processes_per_node: int | None = api_field(
        "processesPerNode: training processes per pod for CPU jobs (default 1). GPU jobs run "
        "one per GPU.",
        None,
        minimum=1,
        maximum=256,
    )
    gpu: str = api_field(
        "gpu: the extended resource name of a GPU.",
        "nvidia.com/gpu",
        pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$",
        pattern_hint="be a resource name like nvidia.com/gpu",
        max_length=253,
    )
    gpu_type: Literal[GPU_TYPES] | None = api_field(  # type: ignore[valid-type]
        "gpuType: the GPU product, for the memory plan and MFU (e.g. H100-SXM-80GB). "
        "H100-80GB (SXM or PCIe board) plans with its 80 GB and the slower board's peak, "
        "stated as assumed; MFU then uses the CUDA device name. Unset skips the fit check, "
        "and MFU uses the CUDA device name.",
        None,
        fixes=RETIRED_GPU_TYPES,
    )
    cpu: IntOrString | None = api_field(
        "cpu request and limit of each pod (a quantity, e.g. 90).",
        None,
        pattern=QUANTITY_PATTERN,
        pattern_hint='be a Kubernetes quantity (e.g. 8, "500m")',
        max_length=32,
    )
    memory: IntOrString | None = api_field(
        "memory request and limit of each pod (a quantity, e.g. 1000Gi).",
        None,
        pattern=QUANTITY_PATTERN,
        pattern_hint='be a Kubernetes quantity (e.g. "64Gi")',
        max_length=32,
    )

    @property
    def nproc_per_node(self) -> int:
        return self.gpus_per_node or self.processes_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


@dataclass(kw_only=True)
class ParallelismSpec:
    """parallelism: how FSDP shards the model states."""

    sharding: Literal["auto", "full", "hybrid", "grad-op", "none"] = api_field(
        "sharding: full shards parameters, gradients and optimizer states across all "
        "processes; hybrid shards within a node and replicates across nodes (less traffic "
        "between nodes); grad-op keeps parameters whole between forward and backward; none "
        "replicates (DDP-like; with adapters the frozen base is left whole, never gathered); "
        "auto picks the fastest of these whose memory fits in 90% of a GPU (CPU: of "
        "resources.memory, or the machine's, per process), as ftjob plan shows.",
        "auto",
    )
    cpu_offload: bool = api_field(
        "cpuOffload keeps parameters, gradients and optimizer states in CPU memory.", False
    )


@dataclass(kw_only=True)
class NetworkSpec:
    """network: the fabric between nodes and the NCCL settings for it."""

    fabric: Literal["efa", "infiniband", "tcp"] = api_field(
        "fabric: efa (AWS Elastic Fabric Adapter), infiniband (RDMA), or tcp.", "tcp"
    )
    efa_devices_per_node: int | None = api_field(
        "efaDevicesPerNode: vpc.amazonaws.com/efa devices per pod (p4d: 4, p5: 32); "
        "required with fabric efa.",
        None,
        minimum=1,
        maximum=64,
    )
    socket_interface: str | None = api_field(
        "socketInterface for NCCL's bootstrap traffic (NCCL_SOCKET_IFNAME), e.g. eth0.",
        None,
        min_length=1,
        max_length=64,
    )
    nccl_env: dict[str, str] = api_field(
        "ncclEnv: extra NCCL_*, FI_* or TORCH_NCCL_* variables, set on every pod.",
        factory=dict,
        key_pattern=r"^(NCCL|FI|TORCH_NCCL)_[A-Z0-9_]+$",
        key_hint="start with NCCL_, FI_ or TORCH_NCCL_",
        max_properties=64,
        max_length=1024,
    )
    collective_timeout_seconds: int = api_field(
        "collectiveTimeoutSeconds: a collective that waits this long fails the gang (shorter "
        "than runPolicy.stallTimeoutSeconds).",
        600,
        minimum=30,
    )
    rendezvous_port: int = api_field(
        "rendezvousPort of node 0 for torchrun.", 29500, minimum=1024, maximum=65535
    )
    progress_port: int = api_field(
        "progressPort on which rank 0 serves progress (JSON) and Prometheus metrics.",
        8000,
        minimum=1024,
        maximum=65535,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.progressPort != self.rendezvousPort",
            lambda n: n.progress_port != n.rendezvous_port,
            "progressPort must differ from rendezvousPort (both listen on node 0)",
            ".progressPort",
        ),
    )


@dataclass(kw_only=True)
class CheckpointSpec:
    """checkpoint: sharded checkpoints on a shared volume; restarts resume from the newest."""

    volume: VolumeRef | None = api_field(
        "volume shared by all pods for checkpoints and the exported model (required when "
        "nodes > 1). Mounted at /ftjob.",
        None,
    )
    path: str | None = api_field(
        "path of the job's folder on the volume (default: <name>-<first 8 characters of the "
        "job's uid>, so a job deleted and created again starts in a new, empty folder; "
        "ftjob run: runs/<name>). A path given here is reused by every job that names it.",
        None,
        pattern=RELATIVE_PATH,
        pattern_hint=RELATIVE_PATH_HINT,
        max_length=256,
    )
    resume_from: str | None = api_field(
        "resumeFrom: a folder on the volume (another job's folder, or one of its "
        "checkpoints/step-N folders) whose newest committed checkpoint this job starts from "
        "while its own folder has none. Read only: the job writes only to its own folder.",
        None,
        pattern=RELATIVE_PATH,
        pattern_hint=RELATIVE_PATH_HINT,
        max_length=256,
    )
    every: int = api_field("every: steps between checkpoints.", 100, minimum=1)
    keep: int = api_field("keep: newest complete checkpoints kept.", 3, minimum=1, maximum=100)
    async_save: bool = api_field(
        "asyncSave writes checkpoints in the background while training continues; each "
        "process then keeps a CPU copy of its share of the checkpoint.",
        False,
    )
    grace_period_seconds: int | None = api_field(
        "gracePeriodSeconds: the pods' terminationGracePeriodSeconds, the time between "
        "SIGTERM (an eviction, a drain, a spot reclaim, a preemption) and SIGKILL, in which "
        "the gang stops at a step boundary and saves a checkpoint there (default: twice the "
        "planner's save time, at least 60; a save that would not fit is skipped and the "
        "previous checkpoint is resumed).",
        None,
        minimum=5,
        maximum=86400,
    )


@dataclass(kw_only=True)
class OutputSpec:
    """output: the exported model, written once training has finished."""

    path: str | None = api_field(
        "path of the exported model inside the job's folder (default: model).",
        None,
        pattern=RELATIVE_PATH,
        pattern_hint=RELATIVE_PATH_HINT,
        max_length=256,
    )
    merge_adapter: bool = api_field(
        "mergeAdapter also writes the base model with the adapter merged in (lora/qlora).",
        False,
    )
    push: list[str] | None = api_field(
        "push uploads the export, with a model card, once training has finished, to each "
        "destination listed, in order: a Hugging Face Hub model repository (hf://org/name; "
        "created if missing; needs secrets.huggingFaceToken, a token that may write there), or "
        "an s3:// prefix (storage.s3's store and key pair; multipart, SHA-256 checksums, a "
        "manifest written last). A failed upload (PushFailed, naming the destination) is "
        "retried without training again, and without uploading again where it was done.",
        None,
        min_items=1,
        max_items=4,
        pattern=PUSH_PATTERN,
        pattern_hint=PUSH_HINT,
        max_length=200,
        example=["hf://my-org/llama3-8b-guanaco", "s3://models/llama3-8b-guanaco"],
    )
    promote_when: str | None = api_field(
        "promoteWhen: the push (to every destination) waits for this condition on the final "
        "evaluation's metrics, "
        "e.g. 'evalLoss < 1.8' or 'evalRewardAccuracy >= 0.7 and evalLoss < 0.6' (evalLoss, "
        "and eval + each metric of training.objective; <, <=, >, >=; joined by and). Unmet: "
        "the job succeeds unpromoted and status.progress.promotion says why, with the numbers.",
        None,
        max_length=256,
        example="evalLoss < 1.8",
    )
    private: bool = api_field(
        "private: the repository push creates is private (default); false makes it public. "
        "A repository that exists keeps its visibility.",
        True,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.push) || self.push.all(p, self.push.exists_one(q, q == p))",
            lambda o: o.push is None or len(set(o.push)) == len(o.push),
            "push lists each destination once",
            ".push",
        ),
        Rule(
            f"!has(self.path) || !self.path.matches('{RESERVED_OUTPUT}')",
            lambda o: o.path is None or not re.match(RESERVED_OUTPUT, o.path),
            f"path may not be or lie inside {', '.join(contract.FOLDER_DIRS)}, nor be "
            f"{', '.join(contract.FOLDER_FILES)}: the job's folder keeps those; use e.g. model",
            ".path",
        ),
    )


@dataclass(kw_only=True)
class SecretsSpec:
    """secrets: credentials, passed to pods only as secretKeyRefs."""

    hugging_face_token: SecretKeyRef | None = api_field(
        "huggingFaceToken for gated or private hf:// models and datasets, and for output.push "
        "(becomes HF_TOKEN).",
        None,
    )


@dataclass(kw_only=True)
class S3Spec:
    """s3: the object store of s3:// sources, as the AWS SDKs are told where it is and who asks."""

    endpoint: str | None = api_field(
        "endpoint of an S3-compatible store (Ceph, SeaweedFS, MinIO, R2, GCS's S3 interface), "
        "http(s)://host[:port]; unset: AWS (becomes AWS_ENDPOINT_URL).",
        None,
        pattern=r"^https?://[^\s/]+/?$",
        pattern_hint="be http(s)://host[:port], e.g. https://s3.example.com",
        max_length=253,
    )
    region: str | None = api_field(
        "region of the bucket (becomes AWS_REGION; S3-compatible stores take any).",
        None,
        pattern=r"^[a-z0-9-]+$",
        pattern_hint="be a region name like us-east-1",
        max_length=64,
    )
    access_key_id: SecretKeyRef | None = api_field(
        "accessKeyId: the Secret key holding the access key id (becomes AWS_ACCESS_KEY_ID). "
        "Unset: the pods' own AWS environment (a web identity token file, as EKS's IAM roles "
        "for service accounts give).",
        None,
    )
    secret_access_key: SecretKeyRef | None = api_field(
        "secretAccessKey: the Secret key holding the secret (becomes AWS_SECRET_ACCESS_KEY).",
        None,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.accessKeyId) == has(self.secretAccessKey)",
            lambda s: (s.access_key_id is None) == (s.secret_access_key is None),
            "accessKeyId and secretAccessKey come together: set both (a key pair) or neither",
            ".accessKeyId",
        ),
    )


@dataclass(kw_only=True)
class StorageSpec:
    """storage: object stores the job reads sources from."""

    s3: S3Spec = api_field("s3: the store of s3:// sources.", factory=S3Spec)


# An MLflow tracking server over HTTP(S), or Databricks' (databricks, databricks://profile).
MLFLOW_URI = r"^(https?://[^\s/]+(/[^\s]*)?|databricks(://[^\s]*)?)$"
# What W&B accepts as a project or entity name.
WANDB_NAME = r"^[^/\\#?%:\s]+$"


@dataclass(kw_only=True)
class MlflowSpec:
    """mlflow: an MLflow tracking server records the job as one run, kept across restarts."""

    tracking_uri: str = api_field(
        "trackingUri of the MLflow tracking server, e.g. http://mlflow.mlflow:5000 (http, "
        "https, or databricks).",
        pattern=MLFLOW_URI,
        pattern_hint="be an http(s):// address of an MLflow tracking server, or databricks",
        max_length=512,
        example="http://mlflow.mlflow:5000",
    )
    experiment: str = api_field(
        "experiment the run is recorded in; created if missing.",
        "ftjob",
        min_length=1,
        max_length=256,
    )
    username: SecretKeyRef | None = api_field(
        "username for HTTP basic auth (becomes MLFLOW_TRACKING_USERNAME); needs password.",
        None,
    )
    password: SecretKeyRef | None = api_field(
        "password for HTTP basic auth (becomes MLFLOW_TRACKING_PASSWORD); needs username.",
        None,
    )
    token: SecretKeyRef | None = api_field(
        "token: a bearer token instead of username and password (becomes MLFLOW_TRACKING_TOKEN).",
        None,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.username) == has(self.password)",
            lambda m: (m.username is None) == (m.password is None),
            "username and password go together: set both (basic auth), or neither",
            ".password",
        ),
        Rule(
            "!has(self.token) || !has(self.username)",
            lambda m: m.token is None or m.username is None,
            "set token or username and password, not both",
            ".token",
        ),
    )


@dataclass(kw_only=True)
class WandbSpec:
    """wandb: Weights & Biases records the job as one run, kept across restarts."""

    project: str = api_field(
        "project the run is recorded in.",
        pattern=WANDB_NAME,
        pattern_hint="be a W&B project name (no '/', '\\', '#', '?', '%', ':' or spaces)",
        max_length=128,
    )
    entity: str | None = api_field(
        "entity (team or user) owning the project (default: the API key's default entity).",
        None,
        pattern=WANDB_NAME,
        pattern_hint="be a W&B entity name (no '/', '\\', '#', '?', '%', ':' or spaces)",
        max_length=128,
    )
    api_key: SecretKeyRef | None = api_field(
        "apiKey: the W&B API key (becomes WANDB_API_KEY); required in online mode.", None
    )
    mode: Literal["online", "offline"] = api_field(
        "mode: online sends the run to W&B as it trains; offline writes it to the job's "
        "folder (wandb/) for a later `wandb sync`.",
        "online",
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.mode == 'offline' || has(self.apiKey)",
            lambda w: w.mode == "offline" or w.api_key is not None,
            "online mode needs apiKey, a Secret key holding the W&B API key; add it, or set "
            "mode: offline",
            ".apiKey",
        ),
    )


@dataclass(kw_only=True)
class TensorboardSpec:
    """tensorboard: TensorBoard event files in the job's folder (tensorboard/)."""

    enabled: bool = api_field("enabled writes the event files.", True)


@dataclass(kw_only=True)
class TrackingSpec:
    """tracking: experiment trackers rank 0 reports the run to (the spec as parameters, step
    and eval metrics, the export's location). A tracker that is down never fails training."""

    mlflow: MlflowSpec | None = api_field("mlflow: an MLflow tracking server.", None)
    wandb: WandbSpec | None = api_field("wandb: Weights & Biases.", None)
    tensorboard: TensorboardSpec | None = api_field(
        "tensorboard: event files in the job's folder.", None
    )


@dataclass(kw_only=True)
class BudgetSpec:
    """budget: what the job may spend; reached, the gang checkpoints and stops (phase
    Stopped, reason BudgetReached), and raising it resumes from that checkpoint."""

    gpu_hours: float | None = api_field(
        "gpuHours: GPU-hours of the pods' running time, over every attempt (status.cost); "
        "capped by the profile's limits.maxGpuHoursPerJob.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    amount: float | None = api_field(
        "amount: money at the profile's prices (status.cost.amount, in its currency).",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    node_hours: float | None = api_field(
        "nodeHours: hours of the gang's pods' running time, one pod a node, over every attempt "
        "(status.cost.nodeHours): how whole-node instances are billed, and a CPU job's budget.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )


@dataclass(kw_only=True)
class RunPolicySpec:
    """runPolicy: retries, timeouts and suspension."""

    backoff_limit: int = api_field(
        "backoffLimit: gang restarts allowed after failures before the job fails.",
        3,
        minimum=0,
        maximum=100,
    )
    stall_timeout_seconds: int = api_field(
        "stallTimeoutSeconds: no training progress for this long restarts the gang (training "
        "steps only; see startupTimeoutSeconds for what comes before the first).",
        1800,
        minimum=60,
    )
    start_timeout_seconds: int = api_field(
        "startTimeoutSeconds: the job fails if the pods of a gang do not all run this long "
        "after they exist (unschedulable, a missing claim, an image that cannot be pulled, a "
        "container that cannot be created; the reason is in the Pending condition and a "
        "Warning Event). Time gated by Kueue, waiting for quota, does not count.",
        1800,
        minimum=1,
    )
    startup_timeout_seconds: int = api_field(
        "startupTimeoutSeconds: the gang is restarted if its first training step has not "
        "started this long after every pod runs (downloading, preparing data, loading weights; "
        "rank 0 reports the phase it is in).",
        3600,
        minimum=60,
    )
    active_deadline_seconds: int | None = api_field(
        "activeDeadlineSeconds: the job fails once it has been active this long.", None, minimum=1
    )
    ttl_seconds_after_finished: int | None = api_field(
        "ttlSecondsAfterFinished: delete the finished job after this long (the volume keeps "
        "its files).",
        None,
        minimum=0,
    )
    suspend: bool = api_field(
        "suspend: true removes the pods and keeps the checkpoints; false resumes from them.",
        False,
    )
    in_place_restarts: int = api_field(
        "inPlaceRestarts: worker restarts in place per gang before the gang fails (then "
        "backoffLimit decides on a new gang). A worker failure restarts the workers of every "
        "node from the newest checkpoint without re-creating pods; a permanent failure (BadData, "
        "BadModel, BadSpec) never restarts.",
        3,
        minimum=0,
        maximum=100,
    )
    straggler_margin: float = api_field(
        "stragglerMargin: a rank whose step time exceeds (1 + stragglerMargin) x the median of "
        "all ranks on 3 consecutive log steps is named a straggler (log, progress, metric).",
        0.25,
        minimum=0,
        exclusive_minimum=True,
    )


# The bus bandwidth (GB/s, nccl-tests' busbw of an all-reduce) below which a multi-node
# gang's fabric is taken for misconfigured when preflight.minBusBandwidthGBps is unset. Far
# below what the fabric should give (EFA on p4d/p5 and 200-400 Gb/s InfiniBand: tens of GB/s,
# read from vendor figures, not measured here), and above what NCCL's fallback to sockets
# reaches on such hosts (a few GB/s): the check is for a wrong transport, not a slow one.
FABRIC_MIN_BUS_GBPS = {"efa": 10.0, "infiniband": 10.0, "tcp": None}


@dataclass(kw_only=True)
class PreflightSpec:
    """preflight: checks every pod runs before any weight is read (seconds): per GPU a timed
    matmul and a memory check, an all-reduce across the gang (its bus bandwidth and the
    transport NCCL chose), a write/read of the job's volume. A failed check fails the gang
    with NodeUnhealthy, FabricMisconfigured or VolumeUnusable; the node is kept away from the
    next gang where the fault is the node's."""

    mode: Literal["auto", "on", "off"] = api_field(
        "mode: auto runs the preflight when the job requests GPUs, on always (CPU jobs check "
        "the volume and the all-reduce), off never.",
        "auto",
    )
    min_bus_bandwidth_g_bps: float | None = api_field(
        "minBusBandwidthGBps: the all-reduce's bus bandwidth (GB/s, as nccl-tests reports "
        "busbw) below which the gang fails with FabricMisconfigured. Unset: 10 for fabric efa "
        "and infiniband with more than one node, no floor otherwise.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    min_matmul_tflops: float | None = api_field(
        "minMatmulTflops: a GPU whose bf16 matmul runs slower than this (TFLOP/s) fails its "
        "node with NodeUnhealthy. Unset: 40% of the dense bf16 peak of resources.gpuType (or "
        "of the GPU's CUDA name), no floor for an unknown GPU.",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    min_free_memory_fraction: float = api_field(
        "minFreeMemoryFraction: a GPU with less of its memory free than this before loading "
        "(another process holds it, or the device reports less than it has) fails its node.",
        0.9,
        minimum=0,
        maximum=1,
    )
    timeout_seconds: int = api_field(
        "timeoutSeconds: the all-reduce must finish within this long, or the gang fails with "
        "FabricMisconfigured.",
        120,
        minimum=5,
        maximum=3600,
    )

    def enabled(self, gpus_per_node: int) -> bool:
        return self.mode == "on" or (self.mode == "auto" and gpus_per_node > 0)

    def bus_floor(self, fabric: str, nodes: int) -> float | None:
        """The bus bandwidth floor in force (GB/s), or None."""
        if self.min_bus_bandwidth_g_bps is not None:
            return self.min_bus_bandwidth_g_bps
        return FABRIC_MIN_BUS_GBPS[fabric] if nodes > 1 else None


@dataclass(kw_only=True)
class Toleration:
    """A Kubernetes toleration."""

    key: str | None = api_field(
        "key of the taint; unset matches every key (operator Exists).",
        None,
        pattern=kv.QUALIFIED_NAME,
        pattern_hint=LABEL_KEY_HINT,
        max_length=kv.QUALIFIED_NAME_MAX,
    )
    operator: Literal["Exists", "Equal"] = api_field("operator: Exists or Equal.", "Equal")
    value: str | None = api_field(
        "value of the taint (operator Equal).",
        None,
        pattern=kv.LABEL_VALUE,
        pattern_hint=LABEL_VALUE_HINT,
        max_length=63,
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = api_field(
        "effect to tolerate; all effects when empty.", None
    )
    toleration_seconds: int | None = api_field(
        "tolerationSeconds for NoExecute taints.", None, minimum=0
    )

    # core/validation ValidateTolerations, so that the pods cannot be refused for them.
    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.key) || self.operator == 'Exists'",
            lambda t: t.key is not None or t.operator == "Exists",
            "a toleration without a key must have operator Exists (it then tolerates every "
            "taint); add a key or set operator: Exists",
            ".operator",
        ),
        Rule(
            "self.operator != 'Exists' || !has(self.value)",
            lambda t: t.operator != "Exists" or t.value is None,
            "operator Exists takes no value; remove value or use operator Equal",
            ".value",
        ),
        Rule(
            "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
            "tolerationSeconds needs effect NoExecute; remove it or set effect: NoExecute",
            ".tolerationSeconds",
        ),
    )


@dataclass(kw_only=True)
class SchedulingSpec:
    """scheduling: where and when the pods may run."""

    queue: str | None = api_field(
        "queue: a Kueue LocalQueue; the gang is admitted as one pod group.",
        None,
        pattern=DNS_LABEL,
        pattern_hint=DNS_LABEL_HINT,
        max_length=63,
    )
    priority_class_name: str | None = api_field(
        "priorityClassName of the pods.",
        None,
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )
    scheduler_name: str | None = api_field(
        "schedulerName of the pods.",
        None,
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )
    node_selector: dict[str, str] = label_map(
        "nodeSelector of the pods: node label keys and the values they must have.", 64
    )
    tolerations: list[Toleration] = api_field(
        "tolerations of the pods.", factory=list, max_items=64
    )
    affinity: FreeForm | None = api_field("affinity of the pods (a Kubernetes Affinity).", None)
    topology: str | None = api_field(
        "topology: a node label of a level of a Kueue Topology (e.g. "
        "cloud.provider.com/topology-rack): Kueue's Topology-Aware Scheduling admits the gang "
        "only into one domain of that level (one rack) and places it there; needs queue, and "
        "a ResourceFlavor of the queue's ClusterQueue with a topologyName.",
        None,
        pattern=kv.QUALIFIED_NAME,
        pattern_hint=LABEL_KEY_HINT,
        max_length=kv.QUALIFIED_NAME_MAX,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.topology) || has(self.queue)",
            lambda s: s.topology is None or s.queue is not None,
            "topology is Kueue's Topology-Aware Scheduling: set queue (a LocalQueue) too, or "
            "remove topology",
            ".topology",
        ),
    )


@dataclass(kw_only=True)
class PlanSpec:
    """plan: the memory check made before any pod starts (ftjob plan shows it)."""

    enforce: bool = api_field(
        "enforce: a job whose plan says it will not fit never starts pods (condition Planned, "
        "reason WillNotFit, with what to change). false only records the plan.",
        True,
    )


@dataclass(kw_only=True)
class PullSecret:
    """A Secret of the job's namespace with registry credentials (a dockerconfigjson)."""

    name: str = api_field(
        "name of the Secret.",
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )


@dataclass(kw_only=True)
class EnvSource:
    """valueFrom: where a variable's value is kept, so that it is never written in the job."""

    secret_key_ref: SecretKeyRef = api_field(
        "secretKeyRef: a key of a Secret in the job's namespace. On a cluster the pods read it "
        "(the job, its ConfigMap and its pods hold only the reference); `ftjob run` takes the "
        "variable from its own environment."
    )


@dataclass(kw_only=True)
class EnvVar:
    """An environment variable set on every training process: a value, or a Secret's key.
    The values of variables reach no tracker, status, Event or log (a value from a Secret is
    masked in what the trainer prints and records)."""

    name: str = api_field(
        "name of the variable.", pattern=ENV_NAME, pattern_hint="be an identifier", max_length=128
    )
    value: str = api_field(
        "value of the variable, written in the job as it is: a credential goes in valueFrom.",
        "",
        max_length=4096,
    )
    value_from: EnvSource | None = api_field(
        "valueFrom: the variable's value from a Secret (valueFrom.secretKeyRef.name and .key).",
        None,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.valueFrom) || !has(self.value) || self.value == ''",
            lambda e: e.value_from is None or e.value == "",
            "set value or valueFrom, not both",
            ".valueFrom",
        ),
    )


def _reserved(name: str) -> bool:
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


_RESERVED_CEL = " || ".join(
    [f"e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES]
    + [f"e.name == '{n}'" for n in RESERVED_ENV]
)

# The processes of a job, in CEL (ResourcesSpec.world_size), and a step's completions (GRPO).
_WORLD_CEL = (
    "self.resources.nodes * (self.resources.gpusPerNode > 0 ? self.resources.gpusPerNode : "
    "(has(self.resources.processesPerNode) ? self.resources.processesPerNode : 1))"
)
_COMPLETIONS_CEL = (
    f"self.training.microBatchSize * self.training.gradientAccumulation * {_WORLD_CEL}"
)


@dataclass(kw_only=True)
class FineTuneJobSpec:
    """FineTuneJob fine-tunes a language model with FSDP on a gang of torchrun pods."""

    model: ModelSpec = api_field("model to fine-tune.", immutable=True)
    dataset: DatasetSpec = api_field("dataset to train on.", immutable=True)
    method: MethodSpec = api_field("method of fine-tuning.", factory=MethodSpec, immutable=True)
    training: TrainingSpec = api_field(
        "training loop settings.", factory=TrainingSpec, immutable=True
    )
    resources: ResourcesSpec = api_field(
        "resources of each pod and the number of nodes.", factory=ResourcesSpec, immutable=True
    )
    parallelism: ParallelismSpec = api_field(
        "parallelism: FSDP sharding.", factory=ParallelismSpec, immutable=True
    )
    network: NetworkSpec = api_field("network fabric and NCCL settings.", factory=NetworkSpec)
    checkpoint: CheckpointSpec = api_field(
        "checkpoint location and cadence.", factory=CheckpointSpec, immutable=True
    )
    output: OutputSpec = api_field("output: the exported model.", factory=OutputSpec)
    secrets: SecretsSpec = api_field("secrets the pods may read.", factory=SecretsSpec)
    storage: StorageSpec = api_field(
        "storage: the object store of s3:// sources.", factory=StorageSpec
    )
    tracking: TrackingSpec = api_field(
        "tracking: experiment trackers (MLflow, Weights & Biases, TensorBoard).",
        factory=TrackingSpec,
    )
    run_policy: RunPolicySpec = api_field(
        "runPolicy: retries, timeouts, suspension.", factory=RunPolicySpec
    )
    scheduling: SchedulingSpec = api_field(
        "scheduling constraints of the pods.", factory=SchedulingSpec
    )
    plan: PlanSpec = api_field("plan: the fit check before launch.", factory=PlanSpec)
    preflight: PreflightSpec = api_field(
        "preflight: node, fabric and volume checks before loading.", factory=PreflightSpec
    )
    # No schema default: an unset image stays unset in the stored job, so the operator's
    # cluster-wide default (ftjob operator --default-image) can fill it in.
    image: str | None = api_field(
        "image of the trainer (default: the operator's --default-image, the chart's "
        "trainer.defaultImage); an edit applies at once to a gang that never ran (a new gang), "
        "else to the next gang attempt.",
        None,
        pattern=kv.IMAGE,
        pattern_hint="be an image reference without spaces, e.g. ghcr.io/org/trainer:1.0",
        max_length=512,
    )
    env: list[EnvVar] = api_field(
        "env: extra environment variables of the training processes.", factory=list, max_items=64
    )
    image_pull_secrets: list[PullSecret] = api_field(
        "imagePullSecrets: Secrets the pods pull the trainer image with (a private registry).",
        factory=list,
        max_items=16,
    )
    service_account_name: str | None = api_field(
        "serviceAccountName: the ServiceAccount of the job's namespace its pods run as, for "
        "workload identity (IRSA, GKE or Azure workload identity); its API token is not "
        "mounted. Under a FineTuneProfile only a name its limits.allowedServiceAccounts lists "
        "(default: the namespace's default ServiceAccount).",
        None,
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )
    budget: BudgetSpec = api_field("budget: a spend that stops the job.", factory=BudgetSpec)
    profile: str | None = api_field(
        "profile: the FineTuneProfile whose defaults fill what this job leaves unset and whose "
        "limits it must keep (default: the namespace's, by its label ftjob.dev/profile or a "
        "profile's namespaceSelector; docs/platform.md).",
        None,
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.method.type != 'full' || !has(self.method.lora)",
            lambda s: s.method.type != "full" or s.method.lora is None,
            "lora settings need method.type lora or qlora; remove method.lora for a full fine-tune",
            ".method.lora",
        ),
        Rule(
            "self.method.type == 'qlora' || !has(self.method.quantization)",
            lambda s: s.method.type == "qlora" or s.method.quantization is None,
            "quantization is only for method.type qlora; remove it or set type qlora",
            ".method.quantization",
        ),
        Rule(
            "!self.output.mergeAdapter || self.method.type != 'full'",
            lambda s: not s.output.merge_adapter or s.method.type != "full",
            "mergeAdapter needs an adapter (method.type lora or qlora); remove it for a full "
            "fine-tune",
            ".output.mergeAdapter",
        ),
        Rule(
            "self.training.objective != 'dpo' || self.dataset.format == 'preference'",
            lambda s: s.training.objective != "dpo" or s.dataset.format == "preference",
            "objective dpo trains on preference pairs: set dataset.format: preference (with "
            "prompt, chosen and rejected fields), or objective sft",
            ".dataset.format",
        ),
        Rule(
            "self.dataset.format != 'preference' || self.training.objective == 'dpo'",
            lambda s: s.dataset.format != "preference" or s.training.objective == "dpo",
            "preference data trains with training.objective: dpo; set it, or use a format for "
            "next-token training (text, chat or instruction)",
            ".training.objective",
        ),
        Rule(
            "!has(self.training.dpo) || !has(self.training.dpo.labelSmoothing) || "
            "!has(self.training.dpo.lossType) || self.training.dpo.lossType == 'sigmoid'",
            lambda s: (
                s.training.dpo is None
                or s.training.dpo.label_smoothing is None
                or s.training.dpo.loss_type == "sigmoid"
            ),
            "labelSmoothing applies to lossType sigmoid only; remove it, or set lossType: sigmoid",
            ".training.dpo.labelSmoothing",
        ),
        Rule(
            "self.training.objective == 'dpo' || !has(self.training.dpo)",
            lambda s: s.training.objective == "dpo" or s.training.dpo is None,
            "dpo settings need training.objective: dpo; set it, or remove training.dpo",
            ".training.dpo",
        ),
        Rule(
            "self.training.objective != 'grpo' || self.dataset.format == 'prompts'",
            lambda s: s.training.objective != "grpo" or s.dataset.format == "prompts",
            "objective grpo samples completions of prompts: set dataset.format: prompts (a "
            "prompt field, text or messages, plus what the rewards read)",
            ".dataset.format",
        ),
        Rule(
            "self.dataset.format != 'prompts' || self.training.objective == 'grpo'",
            lambda s: s.dataset.format != "prompts" or s.training.objective == "grpo",
            "prompts data trains with training.objective: grpo; set it (with training.grpo."
            "rewards), or use a format for next-token training (text, chat or instruction)",
            ".training.objective",
        ),
        Rule(
            "self.training.objective == 'grpo' || !has(self.training.grpo)",
            lambda s: s.training.objective == "grpo" or s.training.grpo is None,
            "grpo settings need training.objective: grpo; set it, or remove training.grpo",
            ".training.grpo",
        ),
        Rule(
            "self.training.objective != 'grpo' || (has(self.training.grpo) && "
            "has(self.training.grpo.rewards) && size(self.training.grpo.rewards) > 0)",
            lambda s: (
                s.training.objective != "grpo" or bool(s.training.grpo and s.training.grpo.rewards)
            ),
            "objective grpo learns from rewards: list at least one in training.grpo.rewards "
            "(e.g. {type: exactMatch, field: answer})",
            ".training.grpo.rewards",
        ),
        Rule(
            # Unset, gradientAccumulation is derived to hold whole groups (accumulation).
            "!has(self.training.grpo) || !has(self.training.gradientAccumulation) || "
            f"({_COMPLETIONS_CEL}) % self.training.grpo.numGenerations == 0",
            lambda s: (
                s.training.grpo is None
                or s.training.gradient_accumulation is None
                or s.global_batch_size % s.training.grpo.num_generations == 0
            ),
            "the completions of a step (microBatchSize x gradientAccumulation x processes) "
            "must divide by training.grpo.numGenerations, so each prompt's whole group trains "
            "in the same step; change numGenerations or the batch, or leave "
            "gradientAccumulation unset to have it derived",
            ".training.grpo.numGenerations",
        ),
        Rule(
            "!has(self.training.grpo) || self.training.grpo.maxCompletionLength < "
            "self.dataset.maxSeqLength",
            lambda s: (
                s.training.grpo is None
                or s.training.grpo.max_completion_length < s.dataset.max_seq_length
            ),
            "a sequence is the prompt and its completion: training.grpo.maxCompletionLength "
            "must be below dataset.maxSeqLength; raise maxSeqLength or lower the completion",
            ".training.grpo.maxCompletionLength",
        ),
        Rule(
            "!has(self.training.grpo) || !has(self.training.grpo.beta) || "
            "self.training.grpo.beta == 0.0 || self.method.type != 'full'",
            lambda s: (
                s.training.grpo is None or s.training.grpo.beta == 0 or s.method.type != "full"
            ),
            "training.grpo.beta > 0 needs a reference model: with method.type lora or qlora it "
            "is the network with its adapters off; a full fine-tune holds none, so set beta: 0 "
            "or use lora",
            ".training.grpo.beta",
        ),
        Rule(
            "self.training.objective != 'grpo' || !(has(self.dataset.evalFraction) || "
            "has(self.dataset.evalSplit))",
            lambda s: (
                s.training.objective != "grpo"
                or (s.dataset.eval_fraction is None and s.dataset.eval_split is None)
            ),
            "objective grpo does not evaluate yet (its training log reports the rewards); "
            "remove dataset.evalFraction and dataset.evalSplit",
            ".dataset",
        ),
        Rule(
            "has(self.training.maxSteps) != has(self.training.epochs)",
            lambda s: (s.training.max_steps is None) != (s.training.epochs is None),
            "set exactly one of training.maxSteps and training.epochs",
            ".training",
        ),
        Rule(
            "!(has(self.dataset.evalFraction) && has(self.dataset.evalSplit))",
            lambda s: s.dataset.eval_fraction is None or s.dataset.eval_split is None,
            "set evalFraction or evalSplit, not both",
            ".dataset.evalSplit",
        ),
        Rule(
            "self.parallelism.sharding != 'hybrid' || self.resources.nodes >= 2",
            lambda s: s.parallelism.sharding != "hybrid" or s.resources.nodes >= 2,
            "hybrid sharding needs resources.nodes >= 2; use full on one node",
            ".parallelism.sharding",
        ),
        Rule(
            "!self.parallelism.cpuOffload || self.parallelism.sharding != 'none'",
            lambda s: not s.parallelism.cpu_offload or s.parallelism.sharding != "none",
            "cpuOffload needs sharding (auto, full, hybrid or grad-op), not none",
            ".parallelism.cpuOffload",
        ),
        Rule(
            "self.network.fabric == 'tcp' || self.resources.gpusPerNode > 0",
            lambda s: s.network.fabric == "tcp" or s.resources.gpus_per_node > 0,
            "fabric efa and infiniband need GPUs (resources.gpusPerNode > 0); use tcp on CPU",
            ".network.fabric",
        ),
        Rule(
            "(self.network.fabric == 'efa') == has(self.network.efaDevicesPerNode)",
            lambda s: (s.network.fabric == "efa") == (s.network.efa_devices_per_node is not None),
            "fabric efa needs network.efaDevicesPerNode (p4d: 4, p5: 32), and only efa takes it",
            ".network.efaDevicesPerNode",
        ),
        Rule(
            "self.resources.gpusPerNode == 0 || !has(self.resources.processesPerNode)",
            lambda s: s.resources.gpus_per_node == 0 or s.resources.processes_per_node is None,
            "processesPerNode is for CPU jobs; GPU jobs run one process per GPU",
            ".resources.processesPerNode",
        ),
        Rule(
            "self.resources.gpusPerNode > 0 || !self.model.attention.startsWith('flash')",
            lambda s: s.resources.gpus_per_node > 0 or not s.model.attention.startswith("flash"),
            "flash attention needs GPUs; use sdpa on CPU",
            ".model.attention",
        ),
        Rule(
            "self.training.precision != 'fp8' || self.method.type != 'qlora'",
            lambda s: s.training.precision != "fp8" or s.method.type != "qlora",
            "precision fp8 casts each high-precision weight to float8 for its matmul; QLoRA's "
            "base is 4-bit NF4, so every step would dequantize it to bf16 and quantize again "
            "to float8 (slower than bf16, and rounded twice): use precision bf16 with qlora, or "
            "fp8 with method.type lora or full",
            ".training.precision",
        ),
        Rule(
            "self.training.precision == 'fp8' || !has(self.training.fp8Recipe)",
            lambda s: s.training.precision == "fp8" or s.training.fp8_recipe is None,
            "fp8Recipe is for precision fp8; remove it or set precision fp8",
            ".training.fp8Recipe",
        ),
        Rule(
            f"self.training.precision != 'fp8' || !has(self.resources.gpuType) || "
            f"self.resources.gpuType in {_FP8_CEL}",
            lambda s: (
                s.training.precision != "fp8" or s.resources.gpu_type in (None, *FP8_GPU_TYPES)
            ),
            "precision fp8 needs float8 tensor cores (CUDA capability 8.9: Ada, Hopper, "
            f"Blackwell), which resources.gpuType lacks; use precision bf16, or a gpuType of "
            f"{', '.join(FP8_GPU_TYPES)}",
            ".training.precision",
        ),
        Rule(
            "self.resources.gpusPerNode > 0 || !has(self.resources.gpuType)",
            lambda s: s.resources.gpus_per_node > 0 or s.resources.gpu_type is None,
            "gpuType names the GPU of a GPU job; remove it when gpusPerNode is 0",
            ".resources.gpuType",
        ),
        Rule(
            # A CPU job spends node time only (operator/cost.py): a GPU-hour or money budget
            # would never be reached, and so never stop it.
            "self.resources.gpusPerNode > 0 || "
            "(!has(self.budget.gpuHours) && !has(self.budget.amount))",
            lambda s: (
                s.resources.gpus_per_node > 0
                or (s.budget.gpu_hours is None and s.budget.amount is None)
            ),
            "a CPU job (gpusPerNode 0) spends no GPU-hours or money, so a budget in gpuHours or "
            "amount would never stop it; set budget.nodeHours instead",
            ".budget",
        ),
        Rule(
            "self.network.collectiveTimeoutSeconds < self.runPolicy.stallTimeoutSeconds",
            lambda s: s.network.collective_timeout_seconds < s.run_policy.stall_timeout_seconds,
            "collectiveTimeoutSeconds must be shorter than runPolicy.stallTimeoutSeconds, so a "
            "hung collective fails before the job is declared stalled",
            ".network.collectiveTimeoutSeconds",
        ),
        Rule(
            # A job naming its profile may take the volume from it: the door sees the job
            # before the merge, and the merge checks the volume is then there (api/profile.py).
            "self.resources.nodes == 1 || has(self.checkpoint.volume) || has(self.profile)",
            lambda s: (
                s.resources.nodes == 1 or s.checkpoint.volume is not None or s.profile is not None
            ),
            "more than one node needs a shared checkpoint.volume (a ReadWriteMany claim) so "
            "that every node writes its shards to one place; set it, or name a spec.profile "
            "whose defaults give one",
            ".checkpoint.volume",
        ),
        Rule(
            promotion.cel_rule(),
            lambda s: (
                s.output.promote_when is None
                or promotion.valid(s.output.promote_when, s.training.objective)
            ),
            "output.promoteWhen must be METRIC OP NUMBER clauses joined by ' and ', e.g. "
            "'evalLoss < 1.8', with metrics that training.objective evaluates: "
            + "; ".join(f"{o}: {', '.join(promotion.eval_metrics(o))}" for o in OBJECTIVES),
            ".output.promoteWhen",
        ),
        Rule(
            "!has(self.output.promoteWhen) || (has(self.output.push) && "
            "(has(self.dataset.evalFraction) || has(self.dataset.evalSplit)))",
            lambda s: (
                s.output.promote_when is None
                or (
                    s.output.push is not None
                    and (s.dataset.eval_fraction is not None or s.dataset.eval_split is not None)
                )
            ),
            "output.promoteWhen gates output.push on the final evaluation: set output.push and "
            "dataset.evalFraction or dataset.evalSplit",
            ".output.promoteWhen",
        ),
        Rule(
            "!has(self.output.push) || !self.output.push.exists(p, p.startsWith('hf://')) "
            "|| has(self.secrets.huggingFaceToken)",
            lambda s: (
                not any(is_hub(p) for p in s.output.push or [])
                or s.secrets.hugging_face_token is not None
            ),
            "output.push to the Hub needs secrets.huggingFaceToken: a Secret key holding a Hub "
            "token that may write to the repository (ftjob run reads HF_TOKEN from its "
            "environment)",
            ".output.push",
        ),
        Rule(
            f"!self.env.exists(e, {_RESERVED_CEL})",
            lambda s: not any(_reserved(e.name) for e in s.env),
            "env may not set variables ftjob manages (PET_*, FTJOB_*, TORCHELASTIC_*, "
            "MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, HF_TOKEN)",
            ".env",
        ),
    )

    # ------------------------------------------------------------------ derived values

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step: training.gradientAccumulation where it is set;
        unset, 1, and for GRPO the fewest that make the step's completions whole groups (so
        TRL's defaults, 8 completions a prompt, run as they are on one GPU)."""
        t = self.training
        if t.gradient_accumulation is not None:
            return t.gradient_accumulation
        if t.grpo is None:
            return 1
        per_micro = t.micro_batch_size * self.resources.world_size
        return t.grpo.num_generations // math.gcd(per_micro, t.grpo.num_generations)

    @property
    def global_batch_size(self) -> int:
        return self.training.micro_batch_size * self.accumulation * self.resources.world_size

    @property
    def sequences_per_example(self) -> int:
        """Sequences one example of microBatchSize is: 2 for a DPO pair (chosen and rejected
        run in the same forward), else 1."""
        return 2 if self.training.objective == "dpo" else 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step, every sequence maxSeqLength long."""
        return self.global_batch_size * self.sequences_per_example * self.dataset.max_seq_length

    def compile_enabled(self, on_gpu: bool) -> bool:
        """Whether the trainer compiles the decoder layers: training.compile when set; unset,
        off on CPU, and on GPUs only once compile has been verified there."""
        if self.training.compile is not None:
            return self.training.compile
        # float8's casts and scales are fast only fused into the matmuls around them: torchao
        # and torchtitan train fp8 compiled (eager fp8 can be slower than bf16).
        return on_gpu and (COMPILE_VERIFIED_ON_GPU or self.training.precision == "fp8")

    def compute_precision(self) -> str:
        """bf16, fp32 or fp8 (auto resolved; auto never picks fp8: it changes numerics)."""
        if self.training.precision != "auto":
            return self.training.precision
        return "bf16" if self.resources.gpus_per_node > 0 else "fp32"

    def bf16_compute(self) -> bool:
        """Whether the ops outside float8 matmuls compute in bf16 (precision bf16 and fp8)."""
        return self.compute_precision() in ("bf16", "fp8")


def parse_spec(data: Any, path: str = "spec") -> FineTuneJobSpec:
    return parse(FineTuneJobSpec, data, path)


def validate_update(old: FineTuneJobSpec, new: FineTuneJobSpec) -> None:
    errors = check_update(old, new)
    if errors:
        raise SpecError(errors)


# The headless Service takes the job's name, so it is a DNS-1035 label (it starts with a
# letter); pod names add "-node-<rank>" (up to 10 characters): 52 leaves room for both.
NAME_PATTERN = kv.DNS_1035_LABEL
NAME_MAX = 52
NAME_HINT = (
    f"must be at most {NAME_MAX} lowercase letters, digits and '-', starting with a letter and "
    "ending with a letter or digit (it names the job's Service and pods)"
)


def _metadata_errors(meta: Any) -> list[FieldError]:
    """What the API server checks of the job's own metadata: name, namespace, labels."""
    if not isinstance(meta, dict):
        return [FieldError("metadata", f"must be an object with a name, got {meta!r}")]
    errors = []
    name = meta.get("name", "")
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name) or len(name) > NAME_MAX:
        errors.append(FieldError("metadata.name", f"{NAME_HINT}; got {name!r}"))
    namespace = meta.get("namespace")
    if namespace is not None and not (isinstance(namespace, str) and kv.is_dns_label(namespace)):
        errors.append(FieldError("metadata.namespace", f"must {DNS_LABEL_HINT}; got {namespace!r}"))
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        errors.append(FieldError("metadata.labels", "must be a map of label keys to values"))
        labels = {}
    for key, value in labels.items():
        if not kv.is_qualified_name(str(key)):
            errors.append(FieldError(f"metadata.labels.{key}", f"key must {LABEL_KEY_HINT}"))
        if not isinstance(value, str) or not kv.is_label_value(value):
            errors.append(
                FieldError(f"metadata.labels.{key}", f"must {LABEL_VALUE_HINT}, got {value!r}")
            )
    return errors


def parse_resource(doc: Any, strict: bool = False) -> tuple[str, FineTuneJobSpec]:
    """Check a whole FineTuneJob document (kind, metadata, spec); return its name and spec.

    ``strict``: a job file as a person wrote it, whose every top-level key must be known (a
    record that adds keys of its own, as the job folder's spec.json does, is read without)."""
    errors = []
    if not isinstance(doc, dict):
        raise SpecError([FieldError("(document)", "must be a FineTuneJob object")])
    if doc.get("apiVersion") != API_VERSION:
        errors.append(
            FieldError("apiVersion", f"must be {API_VERSION}, got {doc.get('apiVersion')!r}")
        )
    if doc.get("kind") != KIND:
        errors.append(FieldError("kind", f"must be {KIND}, got {doc.get('kind')!r}"))
    errors.extend(_metadata_errors(doc.get("metadata") or {}))
    # Every key the document cannot hold, each named: kubectl's strict decoder names them all.
    errors.extend(
        FieldError(str(key), unknown_field(str(key), list(DOCUMENT_KEYS)), unknown=True)
        for key in doc
        if strict and key not in DOCUMENT_KEYS
    )
    if doc.get("spec") is None:  # a null spec is pruned by the API server: missing
        errors.append(FieldError("spec", "is required"))
    try:
        spec = parse_spec(doc.get("spec"))
    except SpecError as e:
        errors.extend(e.errors)
        spec = None
    if errors:
        raise SpecError(errors)
    return doc["metadata"]["name"], spec


def ineffective(spec: FineTuneJobSpec, raw: dict[str, Any]) -> list[str]:
    """PURE: settings that are valid but cannot do what they say, as warnings (``raw``: the
    spec as written, to tell a field the job sets from its default)."""
    out = []
    t, ds = spec.training, spec.dataset
    steps = t.max_steps
    if steps is not None and t.warmup_steps(steps) >= steps:
        out.append(
            f"spec.training.warmup: {t.warmup} is {t.warmup_steps(steps)} steps of warmup with "
            f"maxSteps {steps}: the learning rate never reaches its peak; lower warmup (e.g. "
            '"3%") or raise maxSteps'
        )
    if t.precision == "fp8" and spec.resources.gpus_per_node == 0:
        out.append(
            "spec.training.precision: fp8 on CPU is emulated (float8 rounding without float8 "
            "speed): it tests what fp8 does to a job's numerics; train with fp32 or bf16"
        )
    written = (raw.get("training") or {}) if isinstance(raw, dict) else {}
    held_out = ds.eval_fraction is not None or ds.eval_split is not None
    if written.get("evalEvery") is not None and t.eval_every > 0 and not held_out:
        out.append(
            f"spec.training.evalEvery: {t.eval_every}, but no eval data is held out: the job "
            "never evaluates; set dataset.evalFraction (e.g. 0.05) or dataset.evalSplit"
        )
    return out
