"""training.precision fp8: the decoder layers' linear layers compute in float8 (torchao).

torchtitan's float8 converter, for a Hugging Face model: every ``nn.Linear`` inside a decoder
layer becomes torchao's ``Float8Linear`` on the meta device, before sharding; the embedding
and the output projection (``lm_head``, outside the decoder layers) stay in bf16, as do
LoRA's adapters (rank-r matmuls gain nothing from float8). A ``Float8Linear`` keeps its
high-precision weight under the same name and casts it (and the input, and the gradient) to
float8 for each matmul, so checkpoints and exports are those of a bf16 run.

Under LoRA the frozen base linears are converted: their forward and their input gradient
run in float8, and they need no weight gradient. Under a sharded full fine-tune with
tensorwise scaling, FSDP2 all-gathers the weights in float8 (half of bf16's bytes), with
the scales computed for all weights in one all-reduce after each optimizer step.

On CPU torchao emulates float8 (``emulate=True``): the values are rounded to float8 and
scaled exactly as on a GPU, the matmul then runs in high precision. That is what CI tests;
it is no faster than bf16.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from ftjob.api.contract import BAD_SPEC, TrainerError
from ftjob.api.hardware import FP8_MIN_CAPABILITY
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.plan.limits import float8_all_gather, fp8_problem


def convertible(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers fp8 converts, by name: inside the decoder layers, not adapters."""
    from ftjob.trainer.model.parallel import decoder_layers

    prefix = {id(m): n for n, m in model.named_modules()}
    found = {}
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if type(module) is nn.Linear and "lora_" not in name:
                found[f"{prefix[id(layer)]}.{name}"] = module
    return found


def config(spec: FineTuneJobSpec):
    """torchao's configuration for the job's recipe, emulated on CPU."""
    from torchao.float8 import Float8LinearConfig

    recipe = Float8LinearConfig.from_recipe_name(spec.training.fp8_scaling())
    return dataclasses.replace(
        recipe,
        emulate=not spec.resources.on_gpu,
        enable_fsdp_float8_all_gather=float8_all_gather(spec),
        # A batch's token count is the inner dimension of the weight gradient's matmul; it
        # varies with the longest row, and float8 matmuls take only multiples of 16.
        pad_inner_dim=True,
    )


def convert(model: nn.Module, spec: FineTuneJobSpec) -> list[str]:
    """Swap the decoder's linear layers for Float8Linear (on the meta device, before
    sharding); returns their names (none when precision is not fp8). Refuses shapes float8
    cannot take, naming the layer, and a GPU without float8 tensor cores."""
    if spec.training.fp8_scaling() is None:
        return []
    targets = convertible(model)
    shapes = {name: tuple(m.weight.shape) for name, m in targets.items()}
    problem = fp8_problem(spec, shapes) or _device_problem(spec)
    if problem:
        where = problem.path.removeprefix("spec")
        raise TrainerError(problem.message, reason=BAD_SPEC, where=where, fix=problem.fix)
    from torchao.float8 import convert_to_float8_training

    names = set(targets)
    convert_to_float8_training(
        model, config=config(spec), module_filter_fn=lambda _, fqn: fqn in names
    )
    return sorted(names)


def _device_problem(spec: FineTuneJobSpec):
    """A GPU job on a device without float8 tensor cores (gpuType unset or wrong)."""
    if not spec.resources.on_gpu or not torch.cuda.is_available():
        return None
    found = torch.cuda.get_device_capability()
    if found >= FP8_MIN_CAPABILITY:
        return None
    from ftjob.api.schema import FieldError

    name = torch.cuda.get_device_name()
    return FieldError(
        "spec.training.precision",
        f"fp8: this node's GPU ({name}, CUDA capability {found[0]}.{found[1]}) has no float8 "
        f"tensor cores (capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} and up)",
        fix="use precision bf16, or schedule the job on Ada, Hopper or Blackwell GPUs",
    )


def rescale_after_each_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, spec: FineTuneJobSpec
) -> None:
    """With float8 all-gathers: the weights' scales, computed for all of them in one
    all-reduce after each optimizer step (torchao's precompute), not one per weight in
    every all-gather. Installed after any checkpoint is loaded (set_state_dict takes an
    optimizer step to initialise the moments: scales computed then would be those of the
    weights before the load); the first step computes them in its gathers, to the same values
    (the largest magnitude of each weight, whichever way it is reduced)."""
    if not float8_all_gather(spec):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def like(own: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``own`` (weights read from the files) in the float8 all-gather wrapper ``local`` (a
    sharded parameter's local tensor) carries, so that FSDP2 keeps gathering it in float8.
    No job imported torchao's wrapper: no weight carries it (and torchao stays unimported)."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    wrapper = getattr(fsdp_utils, "WeightWithDynamicFloat8CastTensor", None)
    if wrapper is None or not isinstance(local, wrapper):
        return own
    return wrapper(own, local._linear_mm_config, local._dtype)


def words(spec: FineTuneJobSpec, converted: list[str]) -> str:
    """The run's log line: what computes in float8, how, and where it is emulated."""
    how = "emulated on CPU: float8 rounding without float8 speed"
    if spec.resources.on_gpu:
        how = "on float8 tensor cores"
    gathers = "; FSDP all-gathers them in float8" if float8_all_gather(spec) else ""
    return (
        f"precision fp8: {len(converted)} linear layers of the decoder in float8, "
        f"{spec.training.fp8_scaling()} scaling, {how}{gathers}; the embedding, output "
        "projection and adapters in bf16"
    )
