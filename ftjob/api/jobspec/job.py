"""The FineTuneJob: its spec (every concern's block, and the rules across them), and the
parsing of a spec and of a whole document.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ftjob import __version__
from ftjob.api import kubevalidation as kv
from ftjob.api import promotion
from ftjob.api.hardware import FP8_GPU_TYPES
from ftjob.api.jobspec.checkpoint import CheckpointSpec
from ftjob.api.jobspec.data import DatasetSpec
from ftjob.api.jobspec.env import (
    RESERVED_ENV,
    RESERVED_ENV_PREFIXES,
    USER_ENV,
    EnvVar,
    PullSecret,
    SecretsSpec,
)
from ftjob.api.jobspec.fields import (
    DNS_LABEL_HINT,
    DNS_SUBDOMAIN_HINT,
    LABEL_KEY_HINT,
    LABEL_VALUE_HINT,
)
from ftjob.api.jobspec.method import MethodSpec
from ftjob.api.jobspec.model import ModelSpec
from ftjob.api.jobspec.output import OutputSpec
from ftjob.api.jobspec.resources import NetworkSpec, ParallelismSpec, ResourcesSpec
from ftjob.api.jobspec.run_policy import BudgetSpec, PlanSpec, PreflightSpec, RunPolicySpec
from ftjob.api.jobspec.scheduling import SchedulingSpec
from ftjob.api.jobspec.storage import StorageSpec
from ftjob.api.jobspec.tracking import TrackingSpec
from ftjob.api.jobspec.training import TrainingSpec
from ftjob.api.objectives import OBJECTIVES
from ftjob.api.schema import (
    FieldError,
    Rule,
    SpecError,
    api_field,
    check_update,
    parse,
    unknown_field,
)

GROUP, VERSION, KIND, PLURAL = "ftjob.dev", "v1alpha1", "FineTuneJob", "finetunejobs"
API_VERSION = f"{GROUP}/{VERSION}"
# What a FineTuneJob document holds at its top (a status is allowed and ignored, as by kubectl).
DOCUMENT_KEYS = ("apiVersion", "kind", "metadata", "spec", "status")
# The release's trainer image name: a placeholder (nothing is published under it), used only
# when neither spec.image nor the operator's --default-image names one.
DEFAULT_IMAGE = f"ghcr.io/ftjob/trainer:{__version__}"
_FP8_CEL = "[" + ", ".join(f"'{name}'" for name in FP8_GPU_TYPES) + "]"
# Whether compile: unset turns torch.compile on for GPU jobs. GPU runs have shown compiled layers
# train to the same losses, 1.34-1.74x faster (bench/RESULTS.md); `ftjob plan` counts them as
# eager, 1.2-1.6x their measured peaks (an H100, 2026-12-05): on once the plan is within 15%.
COMPILE_VERIFIED_ON_GPU = False


_RESERVED = [f"e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES] + [
    f"e.name == '{n}'" for n in RESERVED_ENV
]
_USER = ", ".join(f"'{n}'" for n in USER_ENV)
_RESERVED_CEL = f"({' || '.join(_RESERVED)}) && !(e.name in [{_USER}])"
# The same, in words: env's description and its rule's message.
_WIRED = ", ".join([f"{p}*" for p in RESERVED_ENV_PREFIXES] + list(RESERVED_ENV))

# The processes of a job, in CEL (ResourcesSpec.world_size), and a step's completions (GRPO).
_WORLD_CEL = (
    "self.resources.nodes * (self.resources.gpusPerNode > 0 ? self.resources.gpusPerNode : "
    "(has(self.resources.processesPerNode) ? self.resources.processesPerNode : 1))"
)
# Processes per node (ResourcesSpec.nproc_per_node) and contextParallel (an int or a string).
_NPROC_CEL = (
    "self.resources.gpusPerNode > 0 ? self.resources.gpusPerNode : "
    "(has(self.resources.processesPerNode) ? self.resources.processesPerNode : 1)"
)
_CP_CEL = "self.parallelism.contextParallel"
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
        "env: extra environment variables of the training processes; not those ftjob wires "
        f"them with ({_WIRED}) but {', '.join(USER_ENV)} (N: profile N steps).",
        factory=list,
        max_items=64,
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
            "lora settings need method.type lora or qlora; remove method.lora for a full fine-tune",
            ".method.lora",
        ),
        Rule(
            "self.method.type == 'qlora' || !has(self.method.quantization)",
            "quantization is only for method.type qlora; remove it or set type qlora",
            ".method.quantization",
        ),
        Rule(
            "!self.output.mergeAdapter || self.method.type != 'full'",
            "mergeAdapter needs an adapter (method.type lora or qlora); remove it for a full "
            "fine-tune",
            ".output.mergeAdapter",
        ),
        Rule(
            "self.training.objective != 'dpo' || self.dataset.format == 'preference'",
            "objective dpo trains on preference pairs: set dataset.format: preference (with "
            "prompt, chosen and rejected fields), or objective sft",
            ".dataset.format",
        ),
        Rule(
            "self.dataset.format != 'preference' || self.training.objective == 'dpo'",
            "preference data trains with training.objective: dpo; set it, or use a format for "
            "next-token training (text, chat or instruction)",
            ".training.objective",
        ),
        Rule(
            "!has(self.training.dpo) || !has(self.training.dpo.labelSmoothing) || "
            "!has(self.training.dpo.lossType) || self.training.dpo.lossType == 'sigmoid'",
            "labelSmoothing applies to lossType sigmoid only; remove it, or set lossType: sigmoid",
            ".training.dpo.labelSmoothing",
        ),
        Rule(
            "self.training.objective == 'dpo' || !has(self.training.dpo)",
            "dpo settings need training.objective: dpo; set it, or remove training.dpo",
            ".training.dpo",
        ),
        Rule(
            "self.training.objective != 'grpo' || self.dataset.format == 'prompts'",
            "objective grpo samples completions of prompts: set dataset.format: prompts (a "
            "prompt field, text or messages, plus what the rewards read)",
            ".dataset.format",
        ),
        Rule(
            "self.dataset.format != 'prompts' || self.training.objective == 'grpo'",
            "prompts data trains with training.objective: grpo; set it (with training.grpo."
            "rewards), or use a format for next-token training (text, chat or instruction)",
            ".training.objective",
        ),
        Rule(
            "self.training.objective == 'grpo' || !has(self.training.grpo)",
            "grpo settings need training.objective: grpo; set it, or remove training.grpo",
            ".training.grpo",
        ),
        Rule(
            "self.training.objective != 'grpo' || (has(self.training.grpo) && "
            "has(self.training.grpo.rewards) && size(self.training.grpo.rewards) > 0)",
            "objective grpo learns from rewards: list at least one in training.grpo.rewards "
            "(e.g. {type: exactMatch, field: answer})",
            ".training.grpo.rewards",
        ),
        Rule(
            # Unset, gradientAccumulation is derived to hold whole groups (accumulation).
            "!has(self.training.grpo) || !has(self.training.gradientAccumulation) || "
            f"({_COMPLETIONS_CEL}) % self.training.grpo.numGenerations == 0",
            "the completions of a step (microBatchSize x gradientAccumulation x processes) "
            "must divide by training.grpo.numGenerations, so each prompt's whole group trains "
            "in the same step; change numGenerations or the batch, or leave "
            "gradientAccumulation unset to have it derived",
            ".training.grpo.numGenerations",
        ),
        Rule(
            "!has(self.training.grpo) || self.training.grpo.maxCompletionLength < "
            "self.dataset.maxSeqLength",
            "a sequence is the prompt and its completion: training.grpo.maxCompletionLength "
            "must be below dataset.maxSeqLength; raise maxSeqLength or lower the completion",
            ".training.grpo.maxCompletionLength",
        ),
        Rule(
            "has(self.training.maxSteps) != has(self.training.epochs)",
            "set exactly one of training.maxSteps and training.epochs",
            ".training",
        ),
        Rule(
            "!(has(self.dataset.evalFraction) && has(self.dataset.evalSplit))",
            "set evalFraction or evalSplit, not both",
            ".dataset.evalSplit",
        ),
        Rule(
            "self.parallelism.sharding != 'hybrid' || self.resources.nodes >= 2",
            "hybrid sharding needs resources.nodes >= 2; use full on one node",
            ".parallelism.sharding",
        ),
        Rule(
            "!self.parallelism.cpuOffload || self.parallelism.sharding != 'none'",
            "cpuOffload needs sharding (auto, full, hybrid or grad-op), not none",
            ".parallelism.cpuOffload",
        ),
        Rule(
            # A group's all-to-alls run in every layer: inside a node (NVLink), never across.
            f"string({_CP_CEL}) == 'auto' || (int(string({_CP_CEL})) >= 1 && "
            f"({_NPROC_CEL}) % int(string({_CP_CEL})) == 0)",
            "contextParallel must divide the processes of a node (resources.gpusPerNode, or "
            "processesPerNode on CPU), so that each group's all-to-alls stay inside a node; "
            "use a divisor of it (1, 2, 4, 8 on 8 GPUs), or auto",
            ".parallelism.contextParallel",
        ),
        Rule(
            f"string({_CP_CEL}) in ['1', 'auto'] || self.model.attention == 'sdpa'",
            "contextParallel > 1 runs ftjob's packed attention over the whole sequence after an "
            "all-to-all over heads; only model.attention sdpa has it: set attention sdpa, or "
            "contextParallel 1",
            ".parallelism.contextParallel",
        ),
        Rule(
            f"string({_CP_CEL}) in ['1', 'auto'] || self.training.objective == 'sft'",
            "contextParallel > 1 trains objective sft only: dpo and grpo sum each sequence's "
            "log-probabilities (a pair's, a completion's), which a split sequence would need "
            "reduced over its group; use contextParallel 1, or objective sft",
            ".parallelism.contextParallel",
        ),
        Rule(
            "self.network.fabric == 'tcp' || self.resources.gpusPerNode > 0",
            "fabric efa and infiniband need GPUs (resources.gpusPerNode > 0); use tcp on CPU",
            ".network.fabric",
        ),
        Rule(
            "(self.network.fabric == 'efa') == has(self.network.efaDevicesPerNode)",
            "fabric efa needs network.efaDevicesPerNode (p4d: 4, p5: 32), and only efa takes it",
            ".network.efaDevicesPerNode",
        ),
        Rule(
            "self.resources.gpusPerNode == 0 || !has(self.resources.processesPerNode)",
            "processesPerNode is for CPU jobs; GPU jobs run one process per GPU",
            ".resources.processesPerNode",
        ),
        Rule(
            "self.resources.gpusPerNode > 0 || !self.model.attention.startsWith('flash')",
            "flash attention needs GPUs; use sdpa on CPU",
            ".model.attention",
        ),
        Rule(
            "self.training.precision != 'fp8' || self.method.type != 'qlora'",
            "precision fp8 casts each high-precision weight to float8 for its matmul; QLoRA's "
            "base is 4-bit NF4, so every step would dequantize it to bf16 and quantize again "
            "to float8 (slower than bf16, and rounded twice): use precision bf16 with qlora, or "
            "fp8 with method.type lora or full",
            ".training.precision",
        ),
        Rule(
            "self.training.precision == 'fp8' || !has(self.training.fp8Recipe)",
            "fp8Recipe is for precision fp8; remove it or set precision fp8",
            ".training.fp8Recipe",
        ),
        Rule(
            f"self.training.precision != 'fp8' || !has(self.resources.gpuType) || "
            f"self.resources.gpuType in {_FP8_CEL}",
            "precision fp8 needs float8 tensor cores (CUDA capability 8.9: Ada, Hopper, "
            f"Blackwell), which resources.gpuType lacks; use precision bf16, or a gpuType of "
            f"{', '.join(FP8_GPU_TYPES)}",
            ".training.precision",
        ),
        Rule(
            "self.resources.gpusPerNode > 0 || !has(self.resources.gpuType)",
            "gpuType names the GPU of a GPU job; remove it when gpusPerNode is 0",
            ".resources.gpuType",
        ),
        Rule(
            # A CPU job spends node time only (operator/cost.py): a GPU-hour or money budget
            # would never be reached, and so never stop it.
            "self.resources.gpusPerNode > 0 || "
            "(!has(self.budget.gpuHours) && !has(self.budget.amount))",
            "a CPU job (gpusPerNode 0) spends no GPU-hours or money, so a budget in gpuHours or "
            "amount would never stop it; set budget.nodeHours instead",
            ".budget",
        ),
        Rule(
            "self.network.collectiveTimeoutSeconds < self.runPolicy.stallTimeoutSeconds",
            "collectiveTimeoutSeconds must be shorter than runPolicy.stallTimeoutSeconds, so a "
            "hung collective fails before the job is declared stalled",
            ".network.collectiveTimeoutSeconds",
        ),
        Rule(
            # A job naming its profile may take the volume from it: the door sees the job
            # before the merge, and the merge checks the volume is then there (api/profile.py).
            "self.resources.nodes == 1 || has(self.checkpoint.volume) || has(self.profile)",
            "more than one node needs a shared checkpoint.volume (a ReadWriteMany claim) so "
            "that every node writes its shards to one place; set it, or name a spec.profile "
            "whose defaults give one",
            ".checkpoint.volume",
        ),
        Rule(
            promotion.cel_rule(),
            "output.promoteWhen must be METRIC OP NUMBER clauses joined by ' and ', e.g. "
            "'evalLoss < 1.8', with metrics that training.objective evaluates: "
            + "; ".join(f"{o}: {', '.join(promotion.eval_metrics(o))}" for o in OBJECTIVES),
            ".output.promoteWhen",
        ),
        Rule(
            "!has(self.output.promoteWhen) || (has(self.output.push) && "
            "(has(self.dataset.evalFraction) || has(self.dataset.evalSplit)))",
            "output.promoteWhen gates output.push on the final evaluation: set output.push and "
            "dataset.evalFraction or dataset.evalSplit",
            ".output.promoteWhen",
        ),
        Rule(
            "!has(self.output.push) || !self.output.push.exists(p, p.startsWith('hf://')) "
            "|| has(self.secrets.huggingFaceToken)",
            "output.push to the Hub needs secrets.huggingFaceToken: a Secret key holding a Hub "
            "token that may write to the repository (ftjob run reads HF_TOKEN from its "
            "environment)",
            ".output.push",
        ),
        Rule(
            f"!self.env.exists(e, {_RESERVED_CEL})",
            f"env may not set variables ftjob manages ({_WIRED}); of ftjob's own it takes "
            f"{', '.join(USER_ENV)}",
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
    def context_parallel(self) -> int:
        """Processes that split each sequence: parallelism.contextParallel, auto read as 1
        until resolved (ftjob.plan.layout.resolve_context writes the number it chose)."""
        return self.parallelism.context_split() or 1

    @property
    def data_parallel(self) -> int:
        """Processes, or context-parallel groups of them, that train different sequences."""
        return self.resources.world_size // self.context_parallel

    @property
    def global_batch_size(self) -> int:
        return self.training.micro_batch_size * self.accumulation * self.data_parallel

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
        return "bf16" if self.resources.on_gpu else "fp32"

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
    if t.precision == "fp8" and not spec.resources.on_gpu:
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
