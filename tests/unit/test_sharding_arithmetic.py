"""Per-rank bytes of FSDP2's sharded states against `ftjob plan`, at 8 and 16 GPUs, without one.

The trainer's own code lays the model out: ``model.build`` (meta device, adapters applied),
``parallel.mesh`` (1-D for full and grad-op, 2-D (replicate, shard) for hybrid),
``parallel.shard`` (``fully_shard`` per decoder layer, then the root) and ``model.materialize``
(each rank reads its rows; QLoRA's linear weights read whole and quantized to torchao NF4
first). It runs as
rank 0 of a fake process group (``FakeStore``) of world 8 or 16, with the weights, the forward,
the backward and AdamW's step under ``FakeTensorMode``: shapes and dtypes are real, no byte is
allocated and no collective moves data. torchao's ``to_nf4`` runs under FakeTensorMode on CPU,
so the NF4 layout is checked the same way.

Measured on rank 0 and compared with ``ftjob.plan.estimate``'s per-GPU figures:
* weights: the local shard of every parameter (an NF4 weight: its 4-bit data, int8 scales and
  scale factors, what the plan's 4.13 bits per value stand for);
* gradients: each trainable parameter's sharded ``.grad`` after a fake forward and backward;
* optimizer: AdamW's two moments after a fake ``optimizer.step()`` (its step counters, one
  scalar per tensor, are not in the plan).

The model has Llama-3-8B's widths and vocabulary (GQA, 128k vocabulary; dimensions divide by 16,
so FSDP pads nothing and every rank holds the same bytes) but 2 of its 32 decoder layers: each
layer is sharded alike, so the layer count only multiplies, and the test stays fast.
What only a GPU shows (NCCL, CUDA memory, speed) is left to tests/gpu/.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchao.quantization import NF4Tensor
from transformers import LlamaConfig

from ftjob.api.jobspec import parse_spec
from ftjob.plan.layout import estimate
from ftjob.plan.modelshape import known_model
from ftjob.trainer.model import load as model
from ftjob.trainer.model import parallel

SHAPE = dataclasses.replace(known_model("hf://meta-llama/Meta-Llama-3-8B"), layers=2)
# The parts of an NF4 weight that scale with its size (what the plan counts), and the two it
# holds once per weight: the scales' mean and the 16-entry lookup table.
NF4_BLOCKWISE = ("quantized_data", "quantized_scalers", "quantization_factor")
NF4_CONSTANT = ("scaler_mean", "nf4")

# (method, sharding, nodes, GPUs per node): world 8 and 16 for each layout.
LAYOUTS = {
    "full-8": ("full", "full", 1, 8),
    "full-16": ("full", "full", 2, 8),
    "grad-op-16": ("full", "grad-op", 2, 8),
    "hybrid-8": ("full", "hybrid", 2, 4),
    "hybrid-16": ("full", "hybrid", 2, 8),
    "qlora-nf4-8": ("qlora", "full", 1, 8),
    "qlora-nf4-16": ("qlora", "full", 2, 8),
}


@pytest.fixture
def model_dir(tmp_path):
    """A model folder holding only config.json: the trainer builds from it, reads no weight."""
    LlamaConfig(
        hidden_size=SHAPE.hidden,
        intermediate_size=SHAPE.intermediate,
        num_hidden_layers=SHAPE.layers,
        num_attention_heads=SHAPE.heads,
        num_key_value_heads=SHAPE.kv_heads,
        vocab_size=SHAPE.vocab,
        tie_word_embeddings=SHAPE.tied,
        max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture
def fake_world():
    """Rank 0 of a fake process group of the given size; torn down after the test."""
    yield lambda world: dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if dist.is_initialized():
        dist.destroy_process_group()


def job_spec(source, method: str, sharding: str, nodes: int, gpus: int):
    spec = {
        # eager: ftjob's packed attention reads each document's boundaries on the host, which
        # fake tensors do not have; the bytes checked here do not depend on the attention.
        "model": {"source": str(source), "attention": "eager"},
        "dataset": {"source": "data.jsonl", "format": "text", "maxSeqLength": 64},
        "method": {"type": method},
        "training": {"maxSteps": 1},
        "resources": {"nodes": nodes, "gpusPerNode": gpus},
        "parallelism": {"sharding": sharding},
        "checkpoint": {"volume": {"claimName": "shared"}},
    }
    if method == "qlora":
        spec["method"] |= {"lora": {"r": 16, "targetModules": ["all-linear"]},
                           "quantization": {"type": "nf4"}}  # fmt: skip
    return parse_spec(spec)


def nbytes(t: torch.Tensor) -> int:
    """Bytes of one local tensor; of an NF4 tensor, its block-wise parts."""
    if isinstance(t, NF4Tensor):
        return sum(nbytes(getattr(t, part)) for part in NF4_BLOCKWISE)
    return t.numel() * t.element_size()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_rank_bytes_equal_the_plan(layout, model_dir, fake_world, monkeypatch):
    method, sharding, nodes, gpus = LAYOUTS[layout]
    world = nodes * gpus
    spec = job_spec(model_dir, method, sharding, nodes, gpus)
    fake_world(world)
    d = parallel.Dist(rank=0, local_rank=0, world_size=world, local_world_size=gpus,
                      device=torch.device("cpu"))  # fmt: skip

    built = model.build(spec, types.SimpleNamespace(pad_token_id=0))
    # The plan counts from the shape alone; here its counts are exact.
    total, trainable = model.count_parameters(built.model)
    adapters = SHAPE.lora_params(16, ["all-linear"]) if method == "qlora" else 0
    assert (total - adapters, trainable) == (SHAPE.params, adapters or SHAPE.params)
    mesh = parallel.mesh(spec, d, sharding)
    shards = parallel.shard_group_size(mesh)
    model.check_shardable(built, shards)
    net = parallel.shard(built.model, spec, mesh, sharding, model.left_whole(built, shards))

    # Every rank "reads" its rows of the checkpoint: an empty tensor of the rows' shape.
    class Files:
        read_bytes = 0

        def __init__(self, folder, source, base):
            state = base.state_dict().items()
            self.shapes = {
                model.weights.base_name(n): t.shape for n, t in state if "lora_" not in n
            }

        def find(self, names):
            return next((n for n in names if n in self.shapes), None)

        def tensors(self, names):
            return ((n, self.shapes[n]) for n in names)

        def read(self, shape, rows, dtype, device):
            return torch.empty([r.stop - r.start for r in rows] if rows else shape, dtype=dtype)

    monkeypatch.setattr(model.weights, "Checkpoint", Files)
    # torch's shard offsets are computed with a tensor, which FakeTensorMode would make fake:
    # the rows (host ints) are computed outside it, by the trainer's own function.
    rows = model._rows

    def real_rows(like):
        with unset_fake_temporarily():
            return rows(like)

    monkeypatch.setattr(model, "_rows", real_rows)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.materialize(built, d)
        params = list(net.parameters())
        weights = sum(nbytes(local(p)) for p in params)
        ids = torch.randint(0, SHAPE.vocab, (2, 64))
        positions = torch.arange(64).expand(2, 64)
        net(input_ids=ids, position_ids=positions, use_cache=False).logits.float().sum().backward()
        trained = [p for p in params if p.requires_grad]
        gradients = sum(nbytes(local(p.grad)) for p in trained)
        optimizer = torch.optim.AdamW(trained, lr=1e-4)
        optimizer.step()
        states = [optimizer.state[p] for p in trained]
        moments = sum(nbytes(local(s[k])) for s in states for k in ("exp_avg", "exp_avg_sq"))

    planned = estimate(spec, SHAPE)
    assert planned.notes[0].startswith(f"sharding {sharding} over {shards} ")
    assert (weights, gradients, moments) == (planned.weights, planned.gradients, planned.optimizer)
    # What the plan leaves out is tiny: a step counter per trained tensor.
    assert all(local(s["step"]).numel() == 1 for s in states)

    # The layout behind those numbers: full and grad-op split every parameter over all ranks;
    # hybrid over a node's GPUs, replicated across the nodes.
    expected = (Shard(0),) if sharding != "hybrid" else (Replicate(), Shard(0))
    assert {p.placements for p in params} == {expected}
    assert tuple(mesh.shape) == ((nodes, gpus) if sharding == "hybrid" else (world,))
    if method == "qlora":
        quantized = [local(p) for p in params if isinstance(local(p), NF4Tensor)]
        assert len(quantized) == len(built.quantized) == 7 * SHAPE.layers
        # Every inner tensor of NF4 is counted above or is one of its per-weight constants.
        for q in quantized:
            assert set(q.__tensor_flatten__()[0]) == {*NF4_BLOCKWISE, *NF4_CONSTANT}
            assert sum(nbytes(getattr(q, c)) for c in NF4_CONSTANT) <= 64
    else:
        assert weights == SHAPE.params * 4 / shards  # fp32 masters, no padding


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_auto_leaves_a_lora_base_whole_on_8_gpus(model_dir, fake_world, monkeypatch):
    """8 x A100-80GB, LoRA: auto picks none (ftjob/plan/layout.py), and the trainer's layout
    for it is DDP: every weight whole on each rank (nothing to gather, no DTensor), the
    adapters' gradients all-reduced after the last micro-batch: the plan's per-GPU weights."""
    spec = parse_spec(
        {
            "model": {"source": str(model_dir), "attention": "eager"},
            "dataset": {"source": "data.jsonl", "format": "text", "maxSeqLength": 64},
            "method": {"type": "lora", "lora": {"r": 16, "targetModules": ["all-linear"]}},
            "training": {"maxSteps": 1},
            "resources": {"nodes": 1, "gpusPerNode": 8, "gpuType": "A100-80GB"},
        }
    )
    planned = estimate(spec, SHAPE)
    assert planned.sharding == "none" and spec.parallelism.sharding == "auto"
    fake_world(8)
    d = parallel.Dist(rank=0, local_rank=0, world_size=8, local_world_size=8,
                      device=torch.device("cpu"))  # fmt: skip
    built = model.build(spec, types.SimpleNamespace(pad_token_id=0))
    assert parallel.shard_group(spec, d, planned.sharding) == 1
    net, reduce_last = parallel.wrap(built.model, spec, d, planned.sharding)
    assert type(net).__name__ == "DDPPeftModelForCausalLM"  # torch's composable replicate
    assert reduce_last == net.set_requires_gradient_sync
    params = list(net.parameters())
    assert not any(hasattr(p, "placements") for p in params)
    assert [p for p in params if p.requires_grad] and [p for p in params if not p.requires_grad]
    held = sum(nbytes(local(p)) for p in params)  # meta tensors: shapes and dtypes only
    assert held == planned.weights
