"""parallelism.sharding: auto picks the fastest layout that fits (ftjob/plan/layout.py)."""

import json
from pathlib import Path

import pytest
from example_jobs import example

from ftjob.api.hardware import GIB
from ftjob.plan import estimate, layout, traffic
from ftjob.plan.modelshape import ModelShape, known_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape.from_config(json.loads((ROOT / "examples/tiny-model/config.json").read_text()))
LLAMA_8B = known_model("hf://meta-llama/Meta-Llama-3-8B")
LLAMA_70B = known_model("hf://meta-llama/Llama-2-70b-hf")


def cpu_job(method="full", memory=None, **edits):
    """The tiny job's shape on CPU: 1 node x 2 processes."""
    more = {"resources.memory": memory} if memory else {}
    return example(
        "tiny.yaml",
        **{"resources.nodes": 1, "resources.processesPerNode": 2, "method.type": method},
        **more,
        **edits,
    )


def per_process(spec, shape, sharding, device=None):
    stride = estimate.checkpoint_stride(spec, shape, device, sharding)
    return estimate.estimate_at(spec, shape, stride, device, sharding).per_device


@pytest.mark.parametrize("method", ["full", "lora"])
def test_cpu_job_that_fits_is_replicated(method):
    spec = cpu_job(method, memory="8Gi")
    chosen = layout.choose(spec, TINY, layout.budget(spec, None))
    assert chosen.sharding == "none"
    assert chosen.reason.startswith("sharding auto -> none: ")
    assert "fits in 90% of 4.0 GiB per process (resources.memory 8Gi / 2)" in chosen.reason
    if method == "lora":
        assert "frozen base whole" in chosen.reason
    # Replicated sends less than any sharded layout here: it is the fastest, not the default.
    seconds = {
        s: estimate.estimate_at(spec, TINY, 0, None, s).collective_seconds
        for s in layout.candidates(spec)
    }
    assert min(seconds, key=seconds.get) == "none"


def test_cpu_job_that_does_not_fit_replicated_is_sharded():
    # The 8B model on a CPU pod of 2 processes, with memory between what full sharding and
    # grad-op need: only full fits.
    spec = cpu_job("full", memory="1Gi")
    full, grad_op, none = (per_process(spec, LLAMA_8B, s) for s in ("full", "grad-op", "none"))
    assert full < grad_op < none
    between = (full / estimate.TIGHT + grad_op / estimate.TIGHT) / 2 * 2  # for 2 processes
    spec = cpu_job("full", memory=str(int(between)))
    chosen = layout.choose(spec, LLAMA_8B, layout.budget(spec, None))
    assert chosen.sharding == "full"
    assert "fully sharded is the fastest that fits" in chosen.reason


def test_machine_memory_is_shared_by_every_process_of_ftjob_run():
    spec = example("tiny.yaml")  # 2 nodes x 1 process, no resources.memory: both run here
    b = layout.budget(spec, None, machine_bytes=24 * GIB)
    assert b.per_process == 12 * GIB
    assert b.source == "12.0 GiB per process (this machine's 24.0 GiB / 2)"
    assert layout.choose(spec, TINY, b).sharding == "none"


def test_nothing_fits_takes_the_layout_that_needs_least():
    spec = cpu_job("full", memory="1Gi")
    chosen = layout.choose(spec, LLAMA_8B, layout.budget(spec, None))
    assert chosen.sharding == "full"
    assert "nothing fits in 90% of 512.0 MiB per process" in chosen.reason


def test_unknown_memory_takes_the_layout_that_needs_least():
    spec = cpu_job("full")
    chosen = layout.choose(spec, LLAMA_8B, layout.budget(spec, None))
    assert chosen.sharding == "full"
    assert chosen.reason == "sharding auto -> full: no memory known (set resources.memory)"


def test_an_explicit_setting_is_obeyed():
    for setting in ("full", "grad-op", "none"):
        spec = cpu_job("full", memory="64Gi", **{"parallelism.sharding": setting})
        chosen = layout.choose(spec, TINY, layout.budget(spec, None))
        assert (chosen.sharding, chosen.reason) == (setting, "")


def test_8_gpus_lora_8b_leaves_the_base_whole():
    spec = example("llama3-8b-lora-efa.yaml", **{"resources.nodes": 1})
    e = layout.estimate(spec, LLAMA_8B)
    assert e.sharding == "none" and e.fits
    assert e.temporaries == 0  # nothing gathered
    assert "frozen base whole" in e.sharding_reason
    assert "of 80.0 GiB per GPU" in e.sharding_reason


def test_8_gpus_70b_full_is_sharded_across_16_gpus():
    spec = example("llama2-70b-full.yaml", **{"parallelism.sharding": "auto"})
    assert spec.resources.gpus_per_node == 8 and spec.resources.nodes > 1
    e = layout.estimate(spec, LLAMA_70B)
    # 70B's states (~1.1 TiB) fit one node's 8 GPUs neither whole nor sharded: full it is.
    assert e.sharding == "full"
    assert per_process(spec, LLAMA_70B, "hybrid", 80 * GIB) > 0.9 * 80 * GIB
    assert e.sharding_reason.startswith("sharding auto -> full: ")


def test_8_gpus_two_nodes_prefers_hybrid_when_the_states_fit_a_node_but_not_a_gpu():
    # 8B full fine-tune, 2 nodes x 8 x 40 GB: the whole states (~128 GiB) fit no GPU, a node's
    # shard of them fits; hybrid keeps the gathers inside each node.
    spec = example(
        "llama3-8b-full-40gb.yaml", **{"parallelism.sharding": "auto", "resources.nodes": 2}
    )
    assert spec.resources.nodes == 2 and spec.resources.gpus_per_node == 8
    e = layout.estimate(spec, LLAMA_8B)
    assert e.sharding == "hybrid"
    assert per_process(spec, LLAMA_8B, "none", 40 * GIB) > 40 * GIB


def test_dpo_reference_gathers_a_sharded_base_once_more_except_under_grad_op():
    spec = example("tiny-dpo.yaml")
    sft = example("tiny.yaml", **{"method.type": "lora"})
    moved = {
        (s.training.objective, sharding): traffic.traffic(s, 2, sharding, 1e6, 1000)
        for s in (spec, sft)
        for sharding in ("full", "grad-op")
    }
    share = (spec.resources.world_size - 1) / spec.resources.world_size
    grads = 4000 * share
    assert moved["dpo", "full"].process_bytes == pytest.approx(3e6 * share + grads)
    assert moved["sft", "full"].process_bytes == pytest.approx(2e6 * share + grads)
    assert moved["dpo", "grad-op"].process_bytes == moved["sft", "grad-op"].process_bytes


def test_hybrid_is_a_candidate_only_across_nodes_of_several_processes():
    # 2 nodes x 1 process: hybrid's shard group would be one process, none by another name.
    assert "hybrid" not in layout.candidates(example("tiny.yaml"))
    assert "hybrid" not in layout.candidates(cpu_job())  # one node
    two_by_two = example("tiny.yaml", **{"resources.processesPerNode": 2})
    assert "hybrid" in layout.candidates(two_by_two)
    assert "none" not in layout.candidates(cpu_job(**{"parallelism.cpuOffload": True}))


def test_any_group_of_one_plans_the_frozen_base_whole_as_the_trainer_leaves_it():
    """The trainer leaves frozen weights outside FSDP whenever a parameter's shard group is
    one process (load.py left_whole), hybrid on nodes of one process too: nothing gathered."""
    spec = example("tiny.yaml", **{"method.type": "lora", "parallelism.sharding": "hybrid"})
    assert spec.resources.nodes == 2 and spec.resources.nproc_per_node == 1  # groups of one
    for sharding in ("none", "hybrid"):
        assert estimate.estimate_at(spec, TINY, 0, None, sharding).temporaries == 0.0
    assert estimate.estimate_at(spec, TINY, 0, None, "full").temporaries > 0.0


def test_ddps_all_reduce_waits_only_for_what_outlasts_the_backward():
    # 10 s of all-reduce over 4 buckets' units: a 4 s backward hides 4 s of it; a 20 s
    # backward all but the last unit's share, which starts when the backward ends.
    assert traffic.exposed(10.0, 4.0, 4) == 6.0
    assert traffic.exposed(10.0, 20.0, 4) == 2.5


def test_a_replicated_gpu_job_is_ddp_and_its_plan_counts_the_overlap():
    """8 GPUs, LoRA on the 8B: auto picks none, which the plan names as DDP on 8 processes
    (not "over 1 process", as if one GPU ran), with only the exposed part of its all-reduce
    in the step time."""
    from ftjob.plan import describe, options

    spec = example("llama3-8b-lora-dpo.yaml", **{"parallelism.sharding": "none"})
    assert spec.resources.world_size == 8
    stride = estimate.checkpoint_stride(spec, LLAMA_8B, None, "none")
    e = estimate.estimate_at(spec, LLAMA_8B, stride, None, "none")
    r = spec.resources
    whole = traffic.traffic(spec, LLAMA_8B.layers, "none", 0.0, e.trainable).seconds(spec)
    assert whole / (LLAMA_8B.layers + 1) <= e.collective_seconds < whole
    lines = describe.describe(spec, options.plan(spec, LLAMA_8B))
    shape = next(line for line in lines if line.lstrip().startswith("shape"))
    assert f"replicated (DDP) on {r.world_size} processes" in shape, shape
    throughput = next(line for line in lines if line.lstrip().startswith("throughput"))
    assert "what DDP's all-reduce does not overlap with the backward" in throughput, throughput


def test_one_process_is_said_to_train_a_plain_module_not_ddp():
    """One process has no layout to choose: the line says what runs (the trainer's plain
    module), not a replicated layout that would be 'fastest' against others it cannot be."""
    spec = example("tiny.yaml", **{"resources.nodes": 1})
    chosen = layout.choose(spec, TINY, layout.budget(spec, None, machine_bytes=24 * GIB))
    assert chosen.sharding == "none"
    assert chosen.reason.endswith("; one process trains a plain module (no gathers, no all-reduce)")
    two = layout.choose(example("tiny.yaml"), TINY, layout.budget(spec, None, 24 * GIB))
    assert "replicated as DDP (no gathers) is the fastest that fits" in two.reason
