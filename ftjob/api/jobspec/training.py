"""training: the optimisation loop, and the settings of its objectives (dpo, grpo)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from ftjob.api.rewards import UNIQUE_NAMES, RewardSpec
from ftjob.api.schema import IntOrString, Rule, api_field

# A share of all steps: 0% to 100%.
WARMUP = r"^([0-9]+|([0-9]{1,2}([.][0-9]+)?|100([.]0+)?)%)$"
# activationCheckpointing: auto, all, none or every-N (N >= 2; N = 1 is all).
CHECKPOINTING_PATTERN = r"^(auto|all|none|every-([2-9]|[1-9][0-9]{1,2}))$"


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
        "reference model. Above 0 the reference is the network with its adapters off "
        "(lora, qlora) or, for a full fine-tune, a frozen copy of the starting model held "
        "in the compute precision and laid out as the policy (ftjob plan counts it).",
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
    repetition_penalty: float = api_field(
        "repetitionPenalty: divide the logit of every token already in the prompt or the "
        "completion by it (multiply where negative) before sampling, as TRL's "
        "repetition_penalty (transformers' CTRL penalty); above 1 discourages repeats, 1 "
        "keeps the logits as they are.",
        1.0,
        minimum=0,
        exclusive_minimum=True,
        maximum=10,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.epsilonHigh) || self.epsilonHigh >= self.epsilon",
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
