"""Context parallelism (trainer/model/context.py, trainer/data/context_slice.py): a micro-batch
cut over 2 or 4 ranks trains to the loss and gradients of one rank.

    python -m pytest tests/unit/test_context_parallel.py -q

The cut is pure and tested in-process. The all-to-alls need a group: one start of 4 gloo
processes runs the real step (trainer/step.py's train_step) at context parallel 4 (one group,
two micro-batches accumulated, DDP over the gang) and at 2 (two groups, each a data-parallel
replica with its own micro-batch, FSDP over the gang), and each rank computes the one-rank
loss and gradients to compare with. The tiny Llama has 4 query heads and 2 K/V heads: at 4
its K/V heads are repeated before the all-to-all. Measured (CPU, fp32): losses within 5e-8
relative, gradients within 1.5e-8 absolute of one rank's; the mutants (targets shifted after
the cut, each rank's loss over its own tokens, tokens out of order after the all-to-all,
positions restarting at each slice) miss by 4e-6 to 2e-3 in the loss and 5e-4 to 7e-2 in
the gradients.
"""

from __future__ import annotations

import copy
import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from ftjob.trainer import step
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import context_slice
from ftjob.trainer.data.batches import IGNORE
from ftjob.trainer.model import attention, context, parallel
from ftjob.trainer.objectives import loss
from ftjob.trainer.objectives.next_token import NextToken

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
PAD = 0
# Two micro-batches of two rows of packed documents; rows shorter than the longest end in
# padding. A: 29 tokens a row (to 30 at 2 ranks, 32 at 4: slices of 15 and 8 tokens, and the
# 13-token document crosses two slice boundaries); B: 25 (to 26 and 28).
DOCS = {"A": [[7, 13, 5, 4], [11, 9]], "B": [[6, 19], [2, 12, 8, 3]]}


def micro_batch(name: str) -> data.Batch:
    g = torch.Generator().manual_seed(len(name) + ord(name))
    rows = []
    for lengths in DOCS[name]:
        ids, labels = [], []
        for i, n in enumerate(lengths):
            doc = torch.randint(3, 1000, (n,), generator=g).tolist()
            ids += doc
            unlabelled = 3 if i == 1 else 1  # the second document has a prompt
            labels += [IGNORE] * min(unlabelled, n) + doc[unlabelled:]
        rows.append({"input_ids": ids, "labels": labels, "seq_lengths": lengths})
    return data.collate(rows, PAD)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_the_slices_are_the_padded_sequence_with_its_own_targets_and_positions(n):
    batch = micro_batch("A")
    whole = context_slice.padded(batch, n, PAD)
    assert whole.input_ids.shape[1] % n == 0 and whole.input_ids.shape[1] - 29 < n
    slices = [context_slice.cut(batch, r, n, PAD) for r in range(n)]
    joined = {k: torch.cat([getattr(s, k) for s in slices], dim=1)
              for k in ("input_ids", "labels", "position_ids", "targets")}  # fmt: skip
    assert torch.equal(joined["input_ids"], whole.input_ids)
    assert torch.equal(joined["labels"], whole.labels)
    # The sequence's own positions (RoPE), and its targets shifted before the cut: a slice's
    # last token predicts the next slice's first label.
    assert torch.equal(joined["position_ids"], whole.position_ids)
    assert torch.equal(joined["targets"], data.next_tokens(whole.labels))
    for before, after in zip(slices, slices[1:], strict=False):
        assert torch.equal(before.targets[:, -1], after.labels[:, 0])
    # The counts add up to the micro-batch's; the boundaries are the whole sequence's.
    assert sum(s.labelled for s in slices) == batch.labelled
    assert sum(s.tokens for s in slices) == batch.tokens
    assert sum(s.attention_sq for s in slices) == batch.attention_sq
    for s in slices:
        assert torch.equal(s.cu_seqlens, whole.cu_seqlens) and s.lengths == whole.lengths


def test_padding_is_a_document_of_its_own_with_no_labels():
    batch = micro_batch("A")  # rows of 29: [7, 13, 5, 4] and [11, 9] + 9 of padding
    assert context_slice.padded(batch, 29, PAD) is batch  # nothing to pad
    whole = context_slice.padded(batch, 4, PAD)
    assert whole.lengths == (7, 13, 5, 4, 3, 11, 9, 9, 3)
    assert whole.cu_seqlens.tolist() == [0, 7, 20, 25, 29, 32, 43, 52, 61, 64]
    assert whole.position_ids[:, 29:].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert (whole.labels[:, 29:] == IGNORE).all() and (whole.input_ids[:, 29:] == PAD).all()
    assert whole.labelled == batch.labelled and whole.tokens == batch.tokens
    # The padded rows run through the model as the rows do: the same attention boundaries.
    assert context_slice.row_documents(whole.lengths, 32) == [[7, 13, 5, 4, 3], [11, 9, 9, 3]]
    with pytest.raises(ValueError, match="crosses the end of a row"):
        context_slice.row_documents((20, 20), 29)


def test_k_v_heads_are_repeated_only_as_far_as_the_ranks_need():
    assert context.kv_repeats(2, 2) == 1  # the tiny Llama at 2: one K/V head a rank
    assert context.kv_repeats(2, 4) == 2  # at 4: each K/V head to two ranks
    assert context.kv_repeats(8, 16) == 2 and context.kv_repeats(1, 4) == 4
    assert context.kv_repeats(8, 4) == 1


class _Recorder:
    """The step's optimizer, standing in to keep the gradients it is handed."""

    def __init__(self, net: torch.nn.Module):
        self.net, self.grads = net, {}

    def step(self) -> None:
        self.grads = {n: _whole(p.grad) for n, p in self.net.named_parameters()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.net.zero_grad(set_to_none=set_to_none)


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """A gradient whole: FSDP's are this rank's shards (DTensors)."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()


class _NoCheckpoint:
    def before_update(self) -> None:
        pass


def _tiny() -> torch.nn.Module:
    attention.register()
    net = AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float32, attn_implementation=attention.NAME
    )
    assert loss.install(net)  # the trainer's chunked loss head
    return net.train()


def _one_rank(base: torch.nn.Module, micro: list[data.Batch]) -> dict:
    """Loss and gradients of one rank over the micro-batches: summed token losses / tokens."""
    net = copy.deepcopy(base)
    total = sum(loss.token_loss(net, b, torch.device("cpu"))[0] for b in micro)
    (total / sum(b.labelled for b in micro)).backward()
    mean = total.item() / sum(b.labelled for b in micro)
    return {"loss": mean, "grads": {n: p.grad.clone() for n, p in net.named_parameters()}}


def _gang(base: torch.nn.Module, sharding: str) -> tuple[torch.nn.Module, parallel.ReduceLast]:
    """The model as a gang of every rank trains it: DDP (none) or FSDP (full), as
    trainer/model/parallel.py wraps it (fp32, no activation checkpointing)."""
    net = copy.deepcopy(base)
    if sharding == "none":
        from torch.distributed._composable.replicate import replicate

        net = replicate(net, init_sync=False, gradient_as_bucket_view=True)
        return net, net.set_requires_gradient_sync
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    for layer in parallel.decoder_layers(net):
        parallel.fully_shard(layer, mesh=mesh)
    return parallel.fully_shard(net, mesh=mesh, reshard_after_forward=False), None


def _context_parallel(base, micro: list[data.Batch], cp: context.Group, d, sharding: str):
    """The gang's real step over this rank's slices, the gradients reduced over every rank."""
    net, reduce_last = _gang(base, sharding)
    run = step.Run(net=net, weights=list(net.parameters()), optimizer=_Recorder(net),
                   scheduler=None, ckpt=_NoCheckpoint(), params=0, trainable=0,
                   sharding=sharding, reduce_last=reduce_last, speed=None,
                   flops=lambda tokens, attention_sq: 0.0, read_bytes=0,
                   load_seconds=0.0)  # fmt: skip
    slices = [context_slice.cut(b, cp.rank, cp.size, PAD) for b in micro]
    with context.parallel(cp):
        share, _, _ = step.train_step(run, slices, d, 0.0, NextToken())
    dist.all_reduce(share)  # the step's loss, as Tally.reduce sums the ranks' shares
    return {"loss": share.item(), "grads": run.optimizer.grads,
            "widths": [s.input_ids.shape[1] for s in slices],
            "sharded": all(hasattr(p, "full_tensor") for p in net.parameters())}  # fmt: skip


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)  # four processes on CI's two cores
    dist.init_process_group("gloo", store=dist.FileStore(store, 4), rank=rank, world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    d = parallel.Dist(rank, rank, 4, 4, torch.device("cpu"))
    base = _tiny()
    a, b = micro_batch("A"), micro_batch("B")
    results = {"one": _one_rank(base, [a, b])}
    # 4: one group of 4 ranks, the step's two micro-batches accumulated, DDP.
    results[4] = _context_parallel(base, [a, b], context.Group.of(None), d, "none")
    # 2: two groups of 2, each a data-parallel replica with its own micro-batch, FSDP.
    pair = context.Group.of(pairs[rank // 2])
    results[2] = _context_parallel(base, [(a, b)[rank // 2]], pair, d, "full")
    torch.save(results, f"{out}-{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("context")
    # A fork server imports torch, transformers' Llama and this module once, and forks the
    # four ranks from it: spawned, each imported them anew (5 s of CPU a rank, on 2 cores).
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [__name__, "transformers.models.llama.modeling_llama", "torch.distributed.fsdp"]
    )
    torch.multiprocessing.start_processes(
        _rank, args=(str(folder / "store"), str(folder / "out")), nprocs=4,
        start_method="forkserver",
    )  # fmt: skip
    return [torch.load(folder / f"out-{r}.pt") for r in range(4)]


@pytest.mark.parametrize("n", [4, 2])
def test_context_parallel_trains_to_one_rank_s_loss_and_gradients(ranks, n):
    one = ranks[0]["one"]
    assert len(one["grads"]) == 2 * 9 + 3  # every parameter of the tiny Llama
    for rank, got in enumerate(ranks):
        # Each rank ran its own slice: S/N tokens of each micro-batch (A 29, B 25, padded).
        widths = {4: [8, 7], 2: [[15], [13]][rank // 2]}[n]
        assert got[n]["widths"] == widths
        assert got[n]["sharded"] == (n == 2)  # FSDP at 2, DDP at 4
        assert got[n]["loss"] == pytest.approx(one["loss"], rel=1e-6, abs=0)
        for name, want in one["grads"].items():
            assert want.abs().sum() > 0, name
            torch.testing.assert_close(got[n]["grads"][name], want, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name: f"{name} at {n}: {m}")  # fmt: skip
