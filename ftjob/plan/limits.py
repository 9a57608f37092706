"""What makes a job impossible on its model, whatever the memory: one rule for every command.

``ftjob validate`` and ``ftjob plan`` (through :func:`ftjob.cli.validate.check`), the
operator's Planned condition (:func:`ftjob.plan.describe.planned_condition`) and the trainer
(``trainer/model/load.py`` ``check_shardable`` and ``trainer/model/float8.py`` ``convert``,
with the weights it actually built) all ask :func:`qlora_problem` and :func:`fp8_problem`, so
a job one of them refuses is refused by all with the same field and words. Pure: no torch.
"""

from __future__ import annotations

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import FieldError
from ftjob.plan.modelshape import NF4_BLOCK, NF4_SCALE_BLOCK, nf4_splits

# The shard group FSDP splits every parameter over, by sharding (as trainer/model/parallel.py
# builds its mesh): all processes, the processes of one node, or none.
_GROUP = {"full": "world", "grad-op": "world", "hybrid": "node", "none": "one"}


def shard_group(spec: FineTuneJobSpec, sharding: str) -> int:
    """How many processes share each parameter under ``sharding`` (auto already resolved)."""
    r = spec.resources
    return {"world": r.world_size, "node": r.nproc_per_node, "one": 1}[_GROUP[sharding]]


def plain_module(spec: FineTuneJobSpec) -> bool:
    """Whether the job trains as a plain module, no FSDP (trainer/model/parallel.py ``plain``):
    one rank in all, whose states stay on its device (cpuOffload is FSDP's)."""
    return spec.resources.world_size == 1 and not spec.parallelism.cpu_offload


def ddp(spec: FineTuneJobSpec, sharding: str) -> bool:
    """Whether the job trains replicated as DDP (trainer/model/parallel.py ``wrap``): ``none``
    over more than one process (the spec refuses none with cpuOffload)."""
    return sharding == "none" and not plain_module(spec)


def float8_all_gather(spec: FineTuneJobSpec) -> bool:
    """Whether FSDP2 gathers the float8 linear layers' weights in float8 (trainer/model/float8.py):
    tensorwise scaling (one scale a weight: torchao's only float8 all-gather), a full
    fine-tune (the weights FSDP gathers are the ones that train and are rescaled each step)
    and a job that is sharded (not a plain module)."""
    return (
        spec.training.fp8_scaling() == "tensorwise"
        and spec.method.type == "full"
        and not plain_module(spec)
    )


def qlora_problem(
    spec: FineTuneJobSpec, weights: dict[str, tuple[int, int]], shards: int
) -> FieldError | None:
    """Why this QLoRA job cannot store ``weights`` (name: (rows, cols), the linear weights to
    quantize) in 4 bits split over ``shards`` processes; None if it can or is not QLoRA.

    torchao's NF4 stores values in blocks of NF4_BLOCK and their scales, quantized again, in
    blocks of NF4_SCALE_BLOCK; FSDP2 splits the NF4 storage along the first dimension without
    padding, so every shard must hold whole scale blocks.
    """
    q = spec.method.quantization_settings()
    if q is None:
        return None
    if q.type != "nf4":
        return FieldError(
            "spec.method.quantization.type",
            f"qlora: {q.type} is not supported: ftjob stores the 4-bit base as nf4 only",
            fix="set type nf4 (or remove the quantization block)",
        )
    if not q.double_quant:
        return FieldError(
            "spec.method.quantization.doubleQuant",
            "qlora: false is not supported: ftjob's NF4 always quantizes the scales (0.13 bit "
            "a weight)",
            fix="remove doubleQuant or set it true",
        )
    for full_name, (rows, cols) in weights.items():
        if nf4_splits(rows, cols, shards):
            continue
        name = module_name(full_name)
        if not nf4_splits(rows, cols, 1):
            return FieldError(
                "spec.method.type",
                f"qlora: {name} ({rows}x{cols}) has {rows * cols} values, not a multiple of "
                f"{NF4_BLOCK * NF4_SCALE_BLOCK}: this model cannot be stored in NF4",
                # Where to get one: sizes that are multiples of 128 give whole NF4 blocks.
                fix="use method.type lora, or a model whose hidden and intermediate sizes are "
                "multiples of 128, as most released models' are (e.g. hf://Qwen/Qwen2.5-0.5B); "
                "to try QLoRA on CPU: ftjob run examples/tiny-qlora.yaml (its base, "
                "tiny-qlora-model, is a small Llama of hidden size 256 that NF4 can store)",
            )
        good = [n for n in range(1, 17) if all(nf4_splits(r, c, n) for r, c in weights.values())]
        counts = ", ".join(str(n) for n in good[:-1]) + (" or " if len(good) > 1 else "")
        return FieldError(
            "spec.resources",
            f"qlora: {name} ({rows}x{cols}) cannot be split into {shards} equal 4-bit shards",
            fix=f"the shard group (resources.processesPerNode / gpusPerNode, or nodes with "
            f"hybrid sharding) must be {counts}{good[-1]} processes",
        )
    return None


# torch._scaled_mm, under torchao's float8 matmuls, takes only dimensions that divide by 16 (the
# tokens of a batch, an inner dimension in the weight's gradient, are padded by torchao).
FP8_MULTIPLE = 16


def fp8_problem(spec: FineTuneJobSpec, weights: dict[str, tuple[int, int]]) -> FieldError | None:
    """Why the decoder's linear ``weights`` (name: (rows, cols)) cannot compute in float8;
    None if they can or precision is not fp8."""
    if spec.training.fp8_scaling() is None:
        return None
    for full_name, (rows, cols) in weights.items():
        if rows % FP8_MULTIPLE or cols % FP8_MULTIPLE:
            return FieldError(
                "spec.training.precision",
                f"fp8: {module_name(full_name)} ({rows}x{cols}) has a dimension that does not "
                f"divide by {FP8_MULTIPLE}, which float8 matmuls need",
                fix="use precision bf16, or a model whose hidden, intermediate and attention "
                f"head sizes are multiples of {FP8_MULTIPLE}, as released models' are",
            )
    return None


def module_name(weight: str) -> str:
    """``model.layers.0.self_attn.q_proj.base_layer.weight`` (the trainer's name, under peft)
    -> ``q_proj`` (the planner's): every decoder layer has the same, so the messages agree."""
    parts = [p for p in weight.split(".") if p not in ("weight", "base_layer")]
    return parts[-1] if parts else weight
