"""Reading the checkpoint into the model, in one process: which tensor each parameter is read
from (under peft's renaming too), what is refused before any read, and each rank's rows.

    python -m pytest tests/unit/test_weights.py -q

The sharded reads themselves (2 and 4 real processes) are in tests/e2e/test_trainer_parallel.py.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from ftjob.api.jobspec import parse_spec
from ftjob.trainer.model import load as model
from ftjob.trainer.model import parallel, weights

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-model"
ONE = parallel.Dist(rank=0, local_rank=0, world_size=1, local_world_size=1,
                    device=torch.device("cpu"))  # fmt: skip


def spec(source: Path, method: str = "full", targets: list[str] | None = None):
    raw = {"model": {"source": str(source)}, "dataset": {"source": "d.jsonl"},
           "method": {"type": method}, "training": {"maxSteps": 1}}  # fmt: skip
    if targets:
        raw["method"]["lora"] = {"targetModules": targets}
    return parse_spec(raw)


def copy_without(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    """The tiny model's config and tokenizer in ``folder``, with ``state`` as its weights."""
    folder.mkdir()
    for f in TINY.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    save_file(state, folder / "model.safetensors")
    return folder


def loaded(job) -> model.Built:
    built = model.build(job, model.load_tokenizer(job))
    model.materialize(built, ONE)
    return built


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_checkpoint_without_one_of_the_models_tensors_is_refused_before_any_read(
    tmp_path, method
):
    """Under a full fine-tune every weight trains: a missing one is not taken for an adapter
    to draw, it is refused, naming model.source and the tensor, with nothing read yet."""
    state = load_file(TINY / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    source = copy_without(tmp_path / "partial", state)
    job = spec(source, method)
    built = model.build(job, model.load_tokenizer(job))
    with pytest.raises(model.SourceError) as refused:
        model.materialize(built, ONE)
    message = str(refused.value)
    assert message.startswith(f"model.source {source}: the checkpoint has no tensor for 1 ")
    assert "model.layers.1.mlp.down_proj.weight" in message
    assert refused.value.where == "spec.model.source" and "checkpoint" in refused.value.fix
    assert all(p.is_meta for p in built.model.parameters())  # refused before any read
    assert built.read_bytes == 0


# peft renames each adapted module's weight to <module>.base_layer.weight; an embedding, the
# output head and every linear kind of a decoder layer, alone or together.
TARGETS = [["all-linear"], ["q_proj", "v_proj"], ["embed_tokens", "lm_head", "down_proj"]]


@pytest.mark.parametrize("targets", TARGETS, ids="+".join)
def test_every_base_weight_under_lora_is_read_from_its_own_checkpoint_tensor(targets):
    built = loaded(spec(TINY, "lora", targets))
    files = load_file(TINY / "model.safetensors")
    base, adapters = {}, {}
    for name, param in built.model.named_parameters():
        (adapters if "lora_" in name else base)[weights.base_name(name)] = param
    assert base.keys() == files.keys()  # one parameter for each tensor, under its name
    assert all(torch.equal(base[k], files[k].to(base[k].dtype)) for k in files)  # bf16 base
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert not any(p.requires_grad for p in base.values())


def test_a_checkpoint_saved_without_the_base_model_prefix_is_read_under_lora(tmp_path):
    """Some checkpoints name the decoder's tensors without ``model.``: transformers' prefix
    rule looks each key up among the base model's names, not peft's ``base_layer`` ones."""
    files = load_file(TINY / "model.safetensors")
    stripped = {k.removeprefix("model."): v for k, v in files.items()}
    source = copy_without(tmp_path / "stripped", stripped)
    built = loaded(spec(source, "lora", ["q_proj"]))
    state = {weights.base_name(n): p for n, p in built.model.named_parameters()}
    assert all(torch.equal(state[k], files[k].to(state[k].dtype)) for k in files)


@pytest.mark.parametrize(
    ("rows", "mesh_shape"), [(10, (3,)), (7, (4,)), (2, (3,)), (12, (4,)), (5, (2, 3))]
)
def test_each_rank_reads_its_torch_chunk_of_rows_even_when_they_do_not_divide(rows, mesh_shape):
    """The rows a rank reads are the ones FSDP2 keeps on it: ``torch.chunk``'s split over the
    shard dimension (the last of a hybrid mesh's two), a shorter last chunk, and none for a
    rank past the last (2 rows over 3 ranks)."""
    world = math.prod(mesh_shape)
    whole = torch.arange(rows * 3).reshape(rows, 3)
    chunks = list(torch.chunk(whole, mesh_shape[-1]))
    chunks += [whole[:0]] * (mesh_shape[-1] - len(chunks))
    placements = [Replicate()] * (len(mesh_shape) - 1) + [Shard(0)]
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
            expected = chunks[mesh.get_local_rank(len(mesh_shape) - 1)]
            with torch.device("meta"):
                like = DTensor.from_local(torch.empty(expected.shape), mesh, placements,
                                          run_check=False, shape=whole.shape,
                                          stride=whole.stride())  # fmt: skip
            assert torch.equal(whole[model._rows(like)], expected), rank
        finally:
            dist.destroy_process_group()


def test_a_shard_stays_where_it_was_read_when_the_mesh_is_on_another_device():
    """cpuOffload reads each shard into CPU memory under a GPU mesh; the shard must stay there
    (FSDP refuses offloaded parameters on the GPU). A mesh named for CUDA on this CPU machine
    shows it: any move towards the mesh's device fails here. ``DTensor.from_local`` made that
    move, and the first run on a GPU failed so."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
        with torch.device("meta"):
            like = DTensor.from_local(torch.empty(4, 3), mesh, [Shard(0)], run_check=False)
        own = torch.arange(12.0).reshape(4, 3)
        placed = model._placed(own, like)
        assert placed.to_local().device.type == "cpu"
        assert (placed.shape, placed.placements) == (like.shape, like.placements)
        assert torch.equal(placed.to_local(), own)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["full", "lora"])
def test_every_parameter_and_buffer_lands_on_the_ranks_device(method):
    """One process trains a plain module, DDP a replicated one: nothing moves the parameters
    after loading, so each must be made on the rank's device, adapters too (drawn on CPU for
    the same values on every rank). The meta device stands in for a GPU here: a tensor left in
    CPU memory shows as cpu. An H100 ran LoRA on one GPU with the adapters in CPU memory:
    the first LoRA matmul failed on the device mix."""
    job = spec(TINY, method, ["q_proj", "v_proj"] if method == "lora" else None)
    built = model.build(job, model.load_tokenizer(job))
    gpu = parallel.Dist(rank=0, local_rank=0, world_size=1, local_world_size=1,
                        device=torch.device("meta"))  # fmt: skip
    model.materialize(built, gpu)
    where = {n: t.device.type for n, t in built.model.state_dict(keep_vars=True).items()}
    assert set(where.values()) == {"meta"}, {n: w for n, w in where.items() if w != "meta"}
    if method == "lora":
        assert any("lora_A" in n for n in where)


def test_under_cpu_offload_only_fsdps_shards_live_in_cpu_memory():
    """cpuOffload: FSDP moves its shards (DTensors) to the GPU a layer at a time, so they are
    read into CPU memory; a weight it leaves whole (the frozen base of a group of one) is never
    moved by it and must be read onto the GPU. An H200 ran QLoRA with cpuOffload on one GPU
    with the whole base in CPU memory: the embedding's lookup failed on the device mix."""
    gpu = torch.device("cuda", 0)  # only named: nothing is allocated
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
        with torch.device("meta"):
            shard = DTensor.from_local(torch.empty(4, 3), mesh, [Shard(0)], run_check=False)
            whole = torch.empty(4, 3)
        assert model.home(shard, gpu, cpu_offload=True) == torch.device("cpu")
        assert model.home(whole, gpu, cpu_offload=True) == gpu
        assert model.home(shard, gpu, cpu_offload=False) == gpu
    finally:
        dist.destroy_process_group()
