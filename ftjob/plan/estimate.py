"""Will it fit? A pure memory and throughput estimate for a FineTuneJob.

From the model's shape (its config.json, or a table of well-known models for hf:// sources
that cannot be read offline) and the spec, :func:`estimate` gives per-GPU memory (weights,
gradients, optimizer states, activations, temporaries), CPU memory while loading, checkpoint
size, step time and network traffic. :mod:`ftjob.plan.options` adds what would fit instead,
:mod:`ftjob.plan.describe` the words.

It models what ftjob's trainer does, not an ideal FSDP:
* full fine-tuning keeps fp32 weights (the optimizer's master copy), computed in bf16 on GPUs;
  LoRA and QLoRA keep the frozen base in the compute precision (bf16 on GPUs) and only the
  adapters in fp32; gradients are reduced in fp32; AdamW keeps two fp32 moments;
* QLoRA stores the decoder layers' linear weights in NF4 (~4.1 bits each), sharded by FSDP
  like everything else, and gathers one layer (plus the next) of 4-bit weights at a time;
* gradients are reduce-scattered after every micro-batch and accumulate sharded (fp32), so
  gradient accumulation adds nothing beyond the gradient shard always counted (measured:
  one shard more than at accumulation 1, where it never meets the activations); hybrid
  (and none) all-reduce across replicas once per step, full and grad-op gather and
  reduce-scatter every micro-batch;
* parallelism.sharding auto is the fastest layout that fits (:mod:`ftjob.plan.layout`, timed
  by :mod:`ftjob.plan.traffic`); under none with adapters the frozen base is left whole on
  every process and nothing is gathered;
* activation checkpointing every N layers: a checkpointed layer keeps only its input, the
  others everything, and one layer at a time is recomputed; ``auto`` takes the fastest
  setting that fits (:func:`checkpoint_stride`);
* the loss computes logits LOSS_CHUNK_TOKENS tokens at a time, with the gradients of the
  hidden states and of the head taken chunk by chunk in the forward;
* every rank reads its own rows of each tensor from the memory-mapped safetensors files (the
  4-bit weights whole, as their NF4 scales span all of it), one tensor at a time: a rank's own
  memory grows by its shards plus the tensor being read (measured: bench --suite loading); the
  files' pages pass through the page cache, which is reclaimable and not counted;
* checkpoints hold the trainable parameters' weights and AdamW moments (fp32).
* DPO (training.objective dpo): a pair is two sequences in one forward (with the trainer's
  packed attention their prompt runs once: planned as two whole sequences all the same, the
  case of a one-token prompt; GRPO's completions of a prompt share it likewise), and its
  log-probabilities go through the head LOSS_CHUNK_TOKENS tokens at a time too (each chunk's
  logits recomputed in the backward; each token's fp32 log-normaliser kept); LoRA and QLoRA
  run a reference
  forward with the adapters off each micro-batch (time, no weights, no kept activations); a
  full fine-tune runs one forward over every pair before training and stores 8 bytes a pair
  (two fp32 log-probabilities) on the volume.
* GRPO's KL term (beta > 0): LoRA and QLoRA run the reference forward with the adapters off;
  a full fine-tune holds a frozen copy of the starting model in the compute precision, laid
  out as the policy (sharded over its group, or whole), counted as :attr:`Estimate.reference`.

MFU counts model FLOPs only (:func:`ftjob.plan.modelshape.model_flops`), as the trainer's live
figure does; the step time also counts the recomputed forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftjob.api.hardware import GIB, GPUS, Gpu, node_bandwidth
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import FieldError, quantity
from ftjob.plan import datasize
from ftjob.plan.limits import (
    ddp,
    float8_all_gather,
    fp8_problem,
    plain_module,
    qlora_problem,
    shard_group,
)
from ftjob.plan.modelshape import LOSS_CHUNK_TOKENS, ModelShape, flops_per_token
from ftjob.plan.saving import checkpoint_bytes
from ftjob.plan.traffic import context_layer_bytes, context_traffic, exposed, traffic

FP32 = 4
# Measured on the GPUs we have run: CUDA context, NCCL buffers and the caching allocator.
GPU_RESERVED_BYTES = 1.5 * GIB
FRAGMENTATION = 1.10  # the caching allocator rarely packs activations tighter than this
FIT_LIMIT = 1.0  # the margins are in FRAGMENTATION and GPU_RESERVED_BYTES
TIGHT = 0.90  # above this share the estimate's error (~15%) could tip it: say so
# CPU memory of one training process before any model: Python, torch, transformers. Measured
# in `ftjob run examples/tiny.yaml` (a 0.2M-parameter model), peak RSS per rank after loading:
# 804-876 MiB with the registry's torch 2.13 (a CUDA build, running on CPU: what `pip install
# torch` gives), 409-411 MiB with the CPU-only wheel. The larger: an estimate errs high.
PROCESS_BASELINE_BYTES = 0.85 * GIB
# The same for a CUDA process (CUDA and NCCL libraries mapped in): not measured here.
GPU_PROCESS_BASELINE_BYTES = 3 * GIB
# Loading's allowance beyond the shards a rank keeps and the tensor it is reading: the
# allocator and Python's objects. Measured (bench --suite loading, 2026-11-24, 0.2B and 1B
# bf16 checkpoints, 2 CPU processes): full and LoRA grow -5 to 25 MiB beyond their shards,
# the tensor being read included.
LOAD_SLACK_BYTES = 64 * 2**20
# QLoRA in CPU memory (a CPU job; a GPU job quantizes on the GPU) also holds torchao's
# quantization working memory: to_nf4 finds the nearest of 16 levels for 2^20 values at a
# time, a (2^20 x 16) tensor in the weight's dtype (32 MiB in bf16) and its absolute value.
# Measured (that run and a --quick rerun): 0.2B QLoRA grows 84-88 MiB beyond its shards, the
# 5.5 MiB weight read whole included: more than that weight and the slack (69.5 MiB); with
# one such tensor, 101.5 MiB. The plan is then 1.10-1.21x the loading peak of every case of
# that run (1.21x: 1B QLoRA, which grew 50-51 MiB): an upper bound.
NF4_SEARCH_VALUES = 2**20 * 16
# training.compile on a GPU is counted as the eager step: an upper bound. On one H100
# (bench/RESULTS.md, 2026-12-05) compiled peaks were 0.61-0.85x that count (1.1B every-2 in
# bf16 and fp8, 3.2B all recomputed): the fused layers keep less for backward and no
# autocast copy of the weights. The factor of 4.31x fitted to one H200 run before the bf16
# residual fix planned those peaks 1.5-3.7x too high, and auto recomputed layers it need not.
# Share of the peak the GPUs are assumed to spend on matmuls, recomputed ones included
# (hardware FLOPs utilisation): the step time divides model + recomputed FLOPs by it. Without
# recomputation it equals MFU; the plan's MFU is it x model / (model + recomputed) FLOPs.
ASSUMED_HFU = {"full": 0.40, "lora": 0.35, "qlora": 0.25}
# precision fp8: the decoder's linear layers run at the GPU's float8 peak, at this share of the
# utilisation bf16 matmuls reach (the casts, amax reductions and scales are memory-bound work
# around them). Calibrated on the one published pair at hand, not measured here: torchtitan's
# Llama 3.1 8B on 8xH100, compiled, 6,667 tok/s per GPU in bf16 and 8,532 in float8
# (benchmarks/llama3_h100_202412_torchtitan.md): with 72% of its forward FLOPs in the decoder's
# linear layers at seq 8192 (fp8_speedup's count), 8,532/6,667 = 1 / (0.28 + 0.72 / (2 x 0.72))
# on the H100 SXM's peaks. The GPU kit's fp8 rows measure ftjob's own (bench/gpu_kit).
FP8_EFFICIENCY = 0.72

# activationCheckpointing: auto tries these strides, fastest first (0: none, 1: every layer).
AUTO_STRIDES = (0, 4, 3, 2, 1)
OFFLOAD_SLOWDOWN = 0.5  # CPU offload roughly halves throughput (PCIe copies each step)
# torchao NF4: 4 bits a value, an int8 scale per 64 values, a scale of scales per 256 scales.
NF4_BITS_PER_PARAM = 4 + 8 / 64 + 16 / (64 * 256)


@dataclass
class Estimate:
    """Bytes and seconds for one configuration; per GPU (or per process on CPU)."""

    params: int
    trainable: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    temporaries: float
    reserved: float
    device_bytes: float | None  # one GPU's memory (None: CPU job or unknown GPU)
    pod_memory: float | None  # resources.memory of a pod (None: not set)
    cpu_phases: dict[str, float]  # per pod, the busiest (rank 0's): each phase's peak (PHASES)
    page_cache_per_node: float  # checkpoint bytes a node's ranks read (reclaimable, not counted)
    checkpoint_bytes: float
    flops_per_token: float  # model FLOPs (MFU's), every document maxSeqLength long
    recomputed_flops_per_token: float  # the forward that activation checkpointing repeats
    checkpoint_stride: int  # 0 none, 1 every layer, N every Nth (auto resolved)
    compute_seconds: float | None  # the step's FLOPs at the assumed utilisation (no GPU: None)
    network_bytes_per_node: float
    network_seconds: float | None  # the collectives' share between nodes (in collective_seconds)
    notes: list[str] = field(default_factory=list)
    problem: FieldError | None = None  # why the job cannot run at all, whatever the memory
    # The assumed share of peak behind step_seconds (ASSUMED_HFU; None without a GPU type).
    hardware_utilisation: float | None = None
    on_gpu: bool = True  # a GPU job fits only if its GPUs and its pods' CPU memory both do
    # DPO with adapters: the reference forward with them off (not model FLOPs: MFU leaves it out).
    reference_flops_per_token: float = 0.0
    sharding: str = "full"  # parallelism.sharding in force (auto resolved)
    sharding_reason: str = ""  # what auto chose and why, in one line ("" when set explicitly)
    context_parallel: int = 1  # processes that split each sequence (contextParallel, resolved)
    context_reason: str = ""  # what contextParallel auto chose and why ("" when it stayed 1)
    context_layer_bytes: float = 0.0  # one layer's forward all-to-alls, sent per process
    context_seconds: float = 0.0  # the step's all-to-alls (in collective_seconds)
    # The step's collectives (gathers, reduce-scatters, all-reduces) as if none overlapped
    # compute, but for DDP's all-reduce, which overlaps the backward (its exposed part): what
    # sets the layouts apart (ftjob.plan.traffic).
    collective_seconds: float = 0.0
    # GRPO: the step's share of sampling its completions (generation_seconds; 0 otherwise).
    generation_seconds: float = 0.0
    # GRPO's frozen reference of a full fine-tune (beta > 0): its weights on a device (0
    # otherwise, and where cpuOffload keeps its shards in CPU memory).
    reference: float = 0.0

    @property
    def per_device(self) -> float:
        return (
            self.weights
            + self.reference
            + self.gradients
            + self.optimizer
            + self.activations
            + self.temporaries
            + self.reserved
        )

    @property
    def step_seconds(self) -> float | None:
        """The one step time every line quotes (the throughput, the sharding, the options,
        auto's comparison): compute plus the step's collectives, counted as not overlapped
        (an upper bound: FSDP overlaps much of them; DDP's are its exposed part). None
        without a GPU type."""
        if self.compute_seconds is None:
            return None
        return self.compute_seconds + self.collective_seconds + self.generation_seconds

    @property
    def mfu(self) -> float | None:
        """The MFU the step time implies: model FLOPs only, as the trainer reports it (GRPO's
        sampling is in the step's time, not in its model FLOPs)."""
        if self.hardware_utilisation is None or not self.step_seconds:
            return None
        work = self.flops_per_token + self.recomputed_flops_per_token
        work += self.reference_flops_per_token
        at_peak = self.hardware_utilisation * self.flops_per_token / work
        return at_peak * self.compute_seconds / self.step_seconds

    @property
    def cpu_per_node(self) -> float:
        """The steady state (training): offloaded states and per-process baselines."""
        return self.cpu_phases["training"]

    @property
    def load_cpu_per_node(self) -> float:
        """While loading: what each rank keeps + the tensor it reads."""
        return self.cpu_phases["loading"]

    @property
    def cpu_peak_per_node(self) -> float:
        """The most CPU memory a pod needs, in whichever phase needs most."""
        return self.cpu_phases[self.cpu_peak_phase]

    @property
    def cpu_peak_phase(self) -> str:
        """The phase that sets the pod's peak (the first of equals, in PHASES' order)."""
        return max(PHASES, key=lambda phase: self.cpu_phases[phase])

    @property
    def fits_device(self) -> bool | None:
        if self.device_bytes is None:
            return None
        return self.per_device <= FIT_LIMIT * self.device_bytes

    @property
    def fits_pod(self) -> bool | None:
        if self.pod_memory is None:
            return None
        return self.cpu_peak_per_node <= self.pod_memory

    @property
    def fits(self) -> bool | None:
        """False if any check fails; True only if every check was made (a GPU job's GPU
        memory and, for every job, the pod's CPU memory against resources.memory); else None:
        a job is never said to fit on memory nobody checked."""
        if self.problem:
            return False
        checks = [self.fits_pod] + ([self.fits_device] if self.on_gpu else [])
        if False in checks:
            return False
        return None if None in checks else True


def stride_name(stride: int) -> str:
    """A checkpoint stride as activationCheckpointing spells it."""
    return {0: "none", 1: "all"}.get(stride, f"every-{stride}")


def stride_of(setting: str) -> int | None:
    """The stride an explicit activationCheckpointing names; None for auto."""
    if setting == "auto":
        return None
    named = {"none": 0, "all": 1}
    return named[setting] if setting in named else int(setting.removeprefix("every-"))


def checkpointed(layer: int, stride: int) -> bool:
    """Whether decoder layer ``layer`` (0-based) is recomputed at ``stride``: every
    ``stride``-th layer, counting from 1 (stride 2: layers 1, 3, 5, ...; 0: none)."""
    return stride > 0 and (layer + 1) % stride == 0


def checkpoint_stride(
    spec: FineTuneJobSpec, shape: ModelShape, device_bytes: int | None, sharding: str
) -> int:
    """training.activationCheckpointing as a layer stride under ``sharding`` (resolved):
    0 none, 1 every layer, N every Nth (:func:`checkpointed` says which).

    ``auto`` is the fastest of AUTO_STRIDES whose estimate stays within TIGHT of
    ``device_bytes`` (one GPU's memory), leaving room for the estimate's error: a job that
    runs out of memory mid-run costs more than a recomputed layer. Where nothing fits, and on
    CPU or an unknown GPU (``device_bytes`` None), every layer.
    """
    explicit = stride_of(spec.training.activation_checkpointing)
    if explicit is not None:
        return explicit
    if device_bytes is None or not spec.resources.on_gpu:
        return 1
    for stride in AUTO_STRIDES[:-1]:
        e = estimate_at(spec, shape, stride, device_bytes, sharding)
        if e.per_device <= TIGHT * device_bytes:
            return stride
    return AUTO_STRIDES[-1]


def estimate_at(
    spec: FineTuneJobSpec,
    shape: ModelShape,
    stride: int,
    device_bytes: int | None,
    sharding: str,
) -> Estimate:
    """The estimate at a given checkpoint stride and sharding (both resolved) on a GPU of
    ``device_bytes`` (None: CPU or an unknown GPU); :func:`estimate` resolves them."""
    r, t, method = spec.resources, spec.training, spec.method.type
    act_bytes = 2 if spec.bf16_compute() else FP32
    lora = spec.method.lora_settings()
    adapter = shape.lora_params(lora.r, lora.target_modules) if lora else 0
    trainable = shape.params if method == "full" else adapter
    # Bytes of what FSDP shards: the base, then the trained weights with their gradients and
    # two AdamW moments.
    base_bytes, frozen_bytes = _frozen_base(spec, shape, act_bytes)
    sharded_weights = base_bytes + trainable * FP32
    state_bytes = sharded_weights + 3 * trainable * FP32
    group = shard_group(spec, sharding)
    offload = spec.parallelism.cpu_offload
    # The rule validate and the trainer apply; every decoder layer has the same weights.
    problem = qlora_problem(spec, shape.linear_shapes(), group)
    problem = problem or fp8_problem(spec, shape.linear_shapes())
    states_on_device = 0.0 if offload else 1.0
    # A group of one leaves the frozen base whole (trainer/model/load.py left_whole), and on
    # the device even under cpuOffload (load.py home): FSDP offloads only what it shards.
    whole_base = base_bytes if group == 1 else 0.0
    weights = whole_base + (sharded_weights - whole_base) / group * states_on_device
    held = frozen_copy_bytes(spec, shape, act_bytes)
    reference = held / group * states_on_device
    gradients = trainable * FP32 / group * states_on_device
    optimizer = 2 * trainable * FP32 / group * states_on_device

    # A context-parallel group's ranks hold S/N tokens each of every sequence (padded to a
    # multiple of N); attention's all-to-alls give each all S tokens of heads/N: the same bytes.
    length = -(-spec.dataset.max_seq_length // spec.context_parallel)
    tokens = t.micro_batch_size * spec.sequences_per_example * length
    activations = _activations(spec, shape, tokens, act_bytes, stride) * FRAGMENTATION
    temporaries = _temporaries(spec, shape, sharding, group, act_bytes)
    temporaries += float8_copies(spec, shape, tokens)
    # What FSDP gathers for one forward: nothing where a group of one leaves the frozen base
    # whole (trainer/model/load.py left_whole; the adapters' copies are negligible).
    gathered = 0.0 if group == 1 else base_bytes + trainable * act_bytes
    if group > 1 and float8_all_gather(spec):
        gathered -= shape.linear_params * (act_bytes - 1)  # the linear weights: 1 byte each
    # GRPO samples before the step's forward, with the whole model gathered once (not once a
    # token: trainer/objectives/generate.py) beside the KV cache; that and the step's
    # activations are never held at once, and the larger counts.
    sampling = kv_cache_bytes(spec, shape, act_bytes)
    if sampling:
        activations = max(activations, (sampling + gathered) * FRAGMENTATION)
    reserved = GPU_RESERVED_BYTES if r.on_gpu else PROCESS_BASELINE_BYTES

    device_total = weights + reference + gradients + optimizer + activations + temporaries
    device_total += reserved
    # The reference's shards are read and kept beside the policy's (in CPU memory offloaded).
    shards = ((state_bytes + held) / group, (sharded_weights + held) / group)
    cpu = _cpu_memory(spec, shape, group, trainable, shards, device_total, frozen_bytes)
    saved = checkpoint_bytes(trainable)
    notes = _notes(spec, sharding, group, frozen_bytes, cpu.staging)
    return Estimate(
        params=shape.params,
        trainable=trainable,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        temporaries=temporaries,
        reserved=reserved,
        device_bytes=device_bytes if r.on_gpu else None,
        pod_memory=quantity(r.memory) if r.memory else None,
        cpu_phases=cpu.phases,
        page_cache_per_node=cpu.page_cache,
        checkpoint_bytes=saved,
        checkpoint_stride=stride,
        notes=notes,
        problem=problem,
        on_gpu=r.on_gpu,
        sharding=sharding,
        context_parallel=spec.context_parallel,
        reference=reference,
        **_speed(spec, shape, adapter, stride, sharding, trainable, gathered),
    )


def frozen_copy_bytes(spec: FineTuneJobSpec, s: ModelShape, act_bytes: int) -> float:
    """GRPO's frozen reference of a full fine-tune with beta > 0 (trainer/objectives/
    kl_reference.py): every weight once more, in the compute precision; 0 otherwise."""
    grpo = spec.training.grpo_settings()
    if grpo is None or not grpo.beta or spec.method.type != "full":
        return 0.0
    return s.params * act_bytes


def _frozen_base(spec: FineTuneJobSpec, shape: ModelShape, act_bytes: int) -> tuple[float, int]:
    """The frozen base's bytes (4-bit linear weights under QLoRA, the rest in the frozen
    dtype; 0 for a full fine-tune, where every weight trains), and a frozen weight's dtype
    size."""
    method = spec.method.type
    frozen_bytes = FP32 if method == "full" or act_bytes == FP32 else 2
    if method == "full":
        return 0.0, frozen_bytes
    quantized = shape.linear_params if method == "qlora" else 0
    stored = (shape.params - quantized) * frozen_bytes + quantized * NF4_BITS_PER_PARAM / 8
    return stored, frozen_bytes


def _speed(
    spec: FineTuneJobSpec,
    shape: ModelShape,
    adapter: int,
    stride: int,
    sharding: str,
    trainable: int,
    gathered: float,
) -> dict[str, float | None]:
    """The estimate's speed: FLOPs per token, the step's compute on the named GPUs at the
    assumed utilisation, the bytes each node sends per step over its fabric, and the
    step's collectives' time (``gathered``: the bytes one forward gathers)."""
    r, method = spec.resources, spec.method.type
    gpu = GPUS.get(r.gpu_type) if r.gpu_type else None
    flops, recomputed = _flops_per_token(spec, shape, adapter, stride)
    reference = _reference_flops_per_token(spec, shape)
    compute = hfu = None
    sampling = 0.0
    if gpu:
        hfu = ASSUMED_HFU[method] * (OFFLOAD_SLOWDOWN if spec.parallelism.cpu_offload else 1.0)
        hfu *= fp8_speedup(spec, shape, gpu)
        work = spec.tokens_per_step * (flops + recomputed + reference)
        compute = work / (r.world_size * gpu.peak_bf16_flops * hfu)
        sampling = generation_seconds(spec, shape, gpu.peak_bf16_flops)
    moved = traffic(spec, shape.layers, sharding, gathered, trainable)
    collectives = waited = moved.seconds(spec)
    if compute is not None and ddp(spec, sharding):
        # DDP: only the last micro-batch's backward all-reduces (model FLOPs' backward is 4
        # of their 6 per parameter; the recomputed forwards run in the backward too).
        backward = (2 / 3 * flops + recomputed) / (flops + recomputed + reference)
        window = compute * backward / spec.accumulation
        waited = exposed(collectives, window, shape.layers + 1)
    # Context parallelism's all-to-alls sit between a layer's projections and its attention:
    # nothing overlaps them.
    act_bytes = 2 if spec.bf16_compute() else FP32
    layer = context_layer_bytes(
        spec, shape.heads, shape.kv_heads, shape.hidden // shape.heads, act_bytes
    )
    passes = 2 * shape.layers + sum(checkpointed(n, stride) for n in range(shape.layers))
    split = context_traffic(spec, layer, passes).seconds(spec) if layer else 0.0
    waited += split
    net = moved.node_bytes
    bandwidth = node_bandwidth(
        spec.network.fabric, r.gpus_per_node, spec.network.efa_devices_per_node
    )
    # The nodes' share of the collectives the step waits for.
    between = net / bandwidth * (waited / collectives if collectives else 1.0)
    return dict(
        flops_per_token=flops,
        recomputed_flops_per_token=recomputed,
        reference_flops_per_token=reference,
        compute_seconds=compute,
        network_bytes_per_node=net,
        network_seconds=between if r.nodes > 1 else 0.0,
        hardware_utilisation=hfu,
        collective_seconds=waited,
        generation_seconds=sampling,
        context_layer_bytes=layer,
        context_seconds=split,
    )


def fp8_speedup(spec: FineTuneJobSpec, s: ModelShape, gpu: Gpu) -> float:
    """How much faster the step's compute is in fp8 than in bf16 on ``gpu``: the decoder's
    linear layers (their share of the forward's FLOPs) at the float8 peak, times
    FP8_EFFICIENCY; the rest (attention, the output projection, adapters) at bf16's. 1 for
    other precisions. Utilisation stays quoted against the bf16 peak, as MFU is."""
    if spec.training.fp8_scaling() is None or not gpu.peak_fp8_flops:
        return 1.0
    forward = 2 * s.matmul_params + 4 * s.hidden * spec.dataset.max_seq_length * s.layers
    share = 2 * s.linear_params / forward
    faster = gpu.peak_fp8_flops * FP8_EFFICIENCY / gpu.peak_bf16_flops
    return 1 / (1 - share + share / faster)


def _temporaries(
    spec: FineTuneJobSpec, shape: ModelShape, sharding: str, group: int, act_bytes: int
) -> float:
    """FSDP gathers a layer (and prefetches the next) in compute precision and holds its
    unsharded fp32 gradient until the reduce-scatter; grad-op keeps every layer gathered
    from forward to backward. A plain module (one process) has nothing to gather, but a
    full fine-tune in bf16 computes under autocast, whose cache holds a bf16 copy of every
    fp32 weight until the forward ends (read from torch's autocast; not measured on a GPU)."""
    method, layer = spec.method.type, shape.layer_params
    if plain_module(spec):
        return shape.params * act_bytes if method == "full" and act_bytes < FP32 else 0.0
    if group == 1 and method != "full":
        return 0.0  # a group of one leaves the frozen base whole (load.py left_whole)
    gathered = (shape.params if sharding == "grad-op" else 2 * layer) * act_bytes
    if float8_all_gather(spec):  # the linear weights arrive in float8: 1 byte each
        linear = shape.linear_params * (1 if sharding == "grad-op" else 2 / shape.layers)
        gathered -= linear * (act_bytes - 1)
    if method == "qlora":
        # The gathered layers stay 4-bit; each linear weight is dequantized as it is used.
        layers = shape.params / shape.layer_params if sharding == "grad-op" else 2
        largest = max(r * c for r, c in shape.linear_shapes().values())
        gathered = layers * layer * NF4_BITS_PER_PARAM / 8 + largest * act_bytes
    return gathered + (layer if method == "full" else 0) * FP32


def float8_copies(spec: FineTuneJobSpec, s: ModelShape, tokens: int) -> float:
    """precision fp8: the float8 copies and scales of the largest linear layer's matmul,
    made in forward and again in backward (torchao 0.18 saves the bf16 input and weight for
    backward and casts them anew, so no float8 copy is kept across layers): the input, the
    weight and the output's gradient, a byte a value, and their fp32 scales (one a tensor,
    tensorwise; one a row, rowwise). 0 for other precisions."""
    recipe = spec.training.fp8_scaling()
    if recipe is None:
        return 0.0
    rows, cols = max(s.linear_shapes().values(), key=lambda shape: shape[0] * shape[1])
    values = tokens * (cols + rows) + rows * cols
    scales = 3 if recipe == "tensorwise" else 2 * tokens + rows + cols
    return values + scales * FP32


@dataclass
class _Cpu:
    page_cache: float  # per node: checkpoint bytes read through the page cache
    staging: float  # per process: asyncSave's copy
    phases: dict[str, float]  # per node, the busiest pod's (rank 0's): each phase's peak


# The phases a pod goes through, in order; the pod's memory must hold the peak of each.
PHASES = ("preparing", "loading", "training", "saving", "exporting")
# Why a phase peaks, in the verdict's words.
PHASE_WHY = {
    "preparing": "rank 0 tokenizes the data with its worker processes",
    "loading": "every rank reads only its part of the weights",
    "training": "the states each process keeps in CPU memory",
    "saving": "each process copies the tensor it writes to CPU memory",
}


def phase_why(spec: FineTuneJobSpec, phase: str) -> str:
    """What a phase holds in a pod's memory, in the verdict's words."""
    if phase != "exporting":
        return PHASE_WHY[phase]
    if spec.method.type == "full":
        return "rank 0 holds the whole model in fp32 to write the export"
    if spec.output.merge_adapter:
        return "rank 0 loads the base in fp32 to merge the adapters into it (output.mergeAdapter)"
    return "every rank gathers the trained adapters to write them"


def _cpu_memory(
    spec: FineTuneJobSpec,
    shape: ModelShape,
    group: int,
    trainable: int,
    shards: tuple[float, float],
    device_total: float,
    frozen_bytes: int,
) -> _Cpu:
    """A pod's CPU memory. ``shards``: one process's shard of all the states, and of the
    weights alone; ``device_total``: one process's device memory (a CPU job's whole memory);
    ``frozen_bytes``: bytes of a weight as training holds it."""
    nproc, on_gpu = spec.resources.nproc_per_node, spec.resources.on_gpu
    states, weights = shards
    offload = spec.parallelism.cpu_offload
    qlora = spec.method.type == "qlora"
    baseline = GPU_PROCESS_BASELINE_BYTES if on_gpu else PROCESS_BASELINE_BYTES
    # Background checkpoints copy each process's share of what they save (trained weights and
    # both moments) into CPU buffers that are kept for the whole run.
    staging = 3 * trainable * FP32 / group if spec.checkpoint.async_save else 0.0

    # Training: a GPU job's states live on the device unless offloaded to CPU memory; a CPU
    # job keeps everything in CPU memory (its baseline is in device_total).
    offloaded = states if offload else 0.0
    steady = (baseline + offloaded if on_gpu else device_total) + staging

    # Loading: the weights' shards (in CPU memory when offloaded or on CPU), and the tensor
    # being read in the training dtype (read into the GPU in a GPU job; counted all the same):
    # a rank's rows of the largest tensor, or a 4-bit weight read whole, whichever is larger.
    # Gradients, moments and activations do not exist yet.
    largest_rows = max(shape.vocab, shape.intermediate) * shape.hidden / group
    largest_4bit = max(o * i for o, i in shape.linear_shapes().values()) if qlora else 0
    kept = weights if offload or not on_gpu else 0.0
    reading = max(largest_rows, largest_4bit) * frozen_bytes
    quantizing = NF4_SEARCH_VALUES * frozen_bytes if qlora and not on_gpu else 0
    loading = baseline + kept + reading + quantizing + LOAD_SLACK_BYTES

    # What a node's ranks read from the files: their own rows (all of it where each holds
    # everything), and QLoRA's 4-bit weights whole on every rank (one copy in a node's cache).
    read_whole = shape.linear_params if qlora else 0
    own_share = min(1.0, nproc / group)
    read = ((shape.params - read_whole) * own_share + read_whole) * shape.checkpoint_bytes
    phases = {
        "preparing": _preparing(spec, baseline),
        "loading": nproc * loading,
        "training": nproc * steady,
        # A save copies each tensor it writes off the GPU (offloaded or CPU states are there).
        "saving": nproc * (steady + (largest_rows * FP32 if on_gpu and not offload else 0.0)),
        "exporting": nproc * steady + _exporting(spec, shape),
    }
    return _Cpu(read, staging, phases)


def _preparing(spec: FineTuneJobSpec, baseline: float) -> float:
    """Rank 0's pod while it prepares the data: its tokenizing processes (datasize, measured),
    rank 0 at least its baseline, and the pod's other ranks waiting at their baselines."""
    data = datasize.estimate(spec)
    workers = data.prepare_memory - datasize.PREPARE_BYTES_PER_PROCESS
    rank0 = max(baseline, datasize.PREPARE_BYTES_PER_PROCESS)
    return (spec.resources.nproc_per_node - 1) * baseline + rank0 + workers


def _exporting(spec: FineTuneJobSpec, shape: ModelShape) -> float:
    """What the export adds to rank 0's pod (trainer/state/export.py): a full fine-tune
    gathers every weight in fp32 into rank 0's CPU memory, then casts the model to the
    published dtype beside it; a merge loads the base in fp32 and casts it the same way; an
    adapter's trained weights are gathered whole, in fp32, by every rank of the pod."""
    cast = shape.params * shape.checkpoint_bytes if shape.checkpoint_bytes < FP32 else 0
    merged = shape.params * FP32 + cast if spec.output.merge_adapter else 0.0
    if spec.method.type == "full":
        return shape.params * FP32 + cast
    lora = spec.method.lora_settings()
    adapters = shape.lora_params(lora.r, lora.target_modules) * FP32 if lora else 0.0
    return spec.resources.nproc_per_node * adapters + merged


def _activations(
    spec: FineTuneJobSpec, s: ModelShape, tokens: int, nbytes: int, stride: int
) -> float:
    """Bytes saved for the backward pass of one micro-batch (Llama-style decoder), and the
    loss's working memory."""
    h, i = s.hidden, s.intermediate
    # Per token and layer, what autograd keeps (HF Llama, sdpa): each RMSNorm's normalised
    # value and output (2h) plus its fp32 input (4h bytes); q, k, v (repeated to all heads)
    # and the attention output (4h); o_proj's input (h); the MLP's gate, activation, up and
    # product (4i).
    per_layer = nbytes * (9 * h + 4 * i) + 2 * 4 * h
    lora = spec.method.lora_settings()
    if lora and lora.dropout > 0:
        # peft drops out each adapted layer's input separately and keeps the result and the
        # mask (1 byte) for backward: measured +230 MiB per rank on a 25M model at p=0.05.
        per_layer += (nbytes + 1) * s.adapted_input_width(lora.target_modules)
    if spec.model.attention == "eager":
        per_layer += 2 * s.heads * spec.dataset.max_seq_length * nbytes  # scores + softmax
    # A checkpointed layer keeps only its input; the others keep everything; the backward
    # recomputes one checkpointed layer at a time, which then holds everything too.
    recomputed = sum(checkpointed(n, stride) for n in range(s.layers))
    kept = (s.layers - recomputed) * per_layer + recomputed * h * nbytes
    stored = tokens * (kept + (per_layer if recomputed else 0))
    # The loss takes LOSS_CHUNK_TOKENS tokens at a time: that chunk's logits in compute
    # precision and fp32 (the upcast and its gradient) come and go; what stays is the
    # gradient of the hidden states, and under a full fine-tune the head's fp32 gradient.
    # DPO's log-probabilities take the same chunks (objectives/loss.py linear_logprobs) and
    # keep each token's fp32 log-normaliser for the backward, which recomputes the chunk.
    chunk = min(tokens, LOSS_CHUNK_TOKENS)
    loss = chunk * s.vocab * (nbytes + 2 * FP32) + tokens * h * nbytes
    if spec.training.objective == "dpo":
        loss += tokens * FP32
    if spec.method.type == "full":
        loss += s.vocab * h * FP32
    return stored + loss


def _flops_per_token(
    spec: FineTuneJobSpec, s: ModelShape, adapter: int, stride: int
) -> tuple[float, float]:
    """MFU's model FLOPs per token, and the forward that activation checkpointing repeats."""
    frozen = spec.method.type != "full"
    n = s.matmul_params  # the base model's; adapters are counted apart
    seq = spec.dataset.max_seq_length
    flops = flops_per_token(n, adapter if frozen else 0, s.layers, s.hidden, seq, frozen)
    recomputed = sum(checkpointed(k, stride) for k in range(s.layers))
    # One layer's forward: its weights (and adapters) 2 FLOPs each, attention 4·hidden·seq.
    layer_forward = 2 * (s.layer_params + adapter / s.layers) + 4 * s.hidden * seq
    return flops, recomputed * layer_forward


def _reference_flops_per_token(spec: FineTuneJobSpec, s: ModelShape) -> float:
    """Forwards beside the model FLOPs, per token (weights 2 FLOPs each, attention
    4·hidden·seq per layer): DPO's adapter-free reference; GRPO's reference when beta > 0 and
    its log-probabilities at sampling time when numIterations > 1 (once per generation
    batch); 0 for other objectives, and for DPO's full fine-tune (its reference is stored)."""
    forward = 2 * s.matmul_params + 4 * s.hidden * spec.dataset.max_seq_length * s.layers
    if spec.training.objective == "dpo":
        return forward if spec.method.type != "full" else 0.0
    grpo = spec.training.grpo_settings()
    if grpo is None:
        return 0.0
    # Both at sampling time: once a generation batch, numIterations steps.
    forwards = (1.0 if grpo.beta else 0.0) + (1.0 if grpo.num_iterations > 1 else 0.0)
    return forward * forwards / grpo.num_iterations


# Sampling one token at a time reads every weight for a few rows' worth of FLOPs: far below
# the training step's utilisation. Assumed, not measured (no GPU run of GRPO yet): what
# batched decoding with a KV cache reaches in transformers at small batches, ~3% of peak.
GENERATION_HFU = 0.03


def kv_cache_bytes(spec: FineTuneJobSpec, s: ModelShape, act_bytes: int) -> float:
    """GRPO: the KV cache of one sampled micro-batch, per process (keys and values of every
    layer, for the prompt and the whole completion); 0 for other objectives."""
    if spec.training.grpo_settings() is None:
        return 0.0
    rows, seq = spec.training.micro_batch_size, spec.dataset.max_seq_length
    return rows * seq * s.layers * 2 * s.kv_dim * act_bytes


def generation_seconds(spec: FineTuneJobSpec, s: ModelShape, peak: float) -> float:
    """GRPO: a step's share of sampling its completions (each rank its own, token by token,
    once per numIterations steps) at GENERATION_HFU of ``peak``; 0 for other objectives."""
    grpo = spec.training.grpo_settings()
    if grpo is None:
        return 0.0
    t = spec.training
    tokens = t.micro_batch_size * spec.accumulation * grpo.max_completion_length
    forward = 2 * s.matmul_params + 4 * s.hidden * spec.dataset.max_seq_length * s.layers
    return tokens * forward / (peak * GENERATION_HFU) / grpo.num_iterations


def reference_pass(spec: FineTuneJobSpec, s: ModelShape) -> tuple[float, float | None]:
    """A full fine-tune's one-time DPO reference pass: the bytes stored on the volume per pair
    (two fp32 log-probabilities), and the seconds per 1,000 pairs (None without a GPU type)."""
    gpu = GPUS.get(spec.resources.gpu_type) if spec.resources.gpu_type else None
    seconds = None
    if gpu:
        tokens = 1000 * spec.sequences_per_example * spec.dataset.max_seq_length
        forward = 2 * s.matmul_params + 4 * s.hidden * spec.dataset.max_seq_length * s.layers
        seconds = tokens * forward / (spec.resources.world_size * gpu.peak_bf16_flops
                                      * ASSUMED_HFU["full"])  # fmt: skip
    return 2 * FP32, seconds


def _notes(
    spec: FineTuneJobSpec, sharding: str, group: int, frozen_bytes: int, staging: float
) -> list[str]:
    """The shape row's words: the layout, how the base is held, what adds memory."""
    method = spec.method.type
    if ddp(spec, sharding):
        notes = [f"replicated (DDP) on {spec.resources.world_size} processes"]
    else:
        notes = [f"sharding {sharding} over {group} process{'es' if group > 1 else ''}"]
    if method == "qlora":
        notes.append("4-bit base sharded" if group > 1 else "4-bit base")
    elif method == "lora" and frozen_bytes == 2:
        notes.append("bf16 frozen base")
    if spec.training.fp8_scaling():
        gathers = ", gathered in float8" if float8_all_gather(spec) else ""
        notes.append(
            f"fp8 ({spec.training.fp8_scaling()}): the decoder's linear layers at the float8 "
            f"peak x{FP8_EFFICIENCY}{gathers}; their float8 copies and scales counted"
        )
    if _compiled_on_gpu(spec):
        notes.append("compiled: counted as eager, an upper bound (0.61-0.85x measured)")
    if staging:
        notes.append(f"asyncSave keeps a {gib(staging)} CPU copy per process")
    if spec.training.objective == "dpo":
        notes.append(_dpo_note(spec))
    if spec.training.objective == "grpo":
        notes.append(_grpo_note(spec))
    return notes


def _compiled_on_gpu(spec: FineTuneJobSpec) -> bool:
    return spec.resources.on_gpu and spec.compile_enabled(True)


def _dpo_note(spec: FineTuneJobSpec) -> str:
    if spec.method.type == "full":
        return "DPO: 2 sequences a pair, reference log-probs computed once and stored"
    return "DPO: 2 sequences a pair, reference forward with adapters off"


def _grpo_note(spec: FineTuneJobSpec) -> str:
    grpo = spec.training.grpo_settings()
    reference = ""
    if grpo.beta:
        reference = ", reference forward with adapters off"
        if spec.method.type == "full":
            reference = ", a frozen reference copy laid out as the policy"
    return (
        f"GRPO: {grpo.num_generations} completions a prompt sampled with a KV cache of "
        f"microBatchSize rows and the model gathered whole (the larger of them and the "
        f"activations counts){reference}"
    )


def gib(n: float) -> str:
    """Bytes as the plan prints them (MiB, GiB or TiB); the notes above use it too."""
    if n >= 1024 * GIB:
        return f"{n / 1024 / GIB:.1f} TiB"
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / 2**20:.1f} MiB"
