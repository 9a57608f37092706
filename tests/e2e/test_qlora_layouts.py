"""QLoRA's 4-bit base under the other layouts: hybrid sharding (2 replicas x 2 shards, 4 real
CPU processes) with and without cpuOffload.

    python -m pytest tests/e2e/test_qlora_layouts.py -q

A probe under torchrun (this file's ``__main__``) builds the model the trainer's way, checks
what each rank holds, compares the loss with the unsharded NF4 reference, then takes one
optimizer step with gradient clipping (the collective that cpuOffload runs on CPU tensors) and
records the loss after it: every replica must agree, and the step must lower it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_qlora import RUN_TIMEOUT, job, make_base, nf4_reference, nf4_whole

LAYOUTS = {
    "hybrid": {"sharding": "hybrid"},
    "hybrid-offload": {"sharding": "hybrid", "cpuOffload": True},
}

# The slow tier (tests/deadline.py): QLoRA's other layouts, after full sharding's (test_qlora.py).
pytestmark = pytest.mark.slow


def probe(base: Path, out: Path) -> None:
    import torch.distributed as dist
    from torchao.quantization import NF4Tensor

    from ftjob.api.jobspec import parse_spec
    from ftjob.trainer.data import batches as data
    from ftjob.trainer.model import load as model
    from ftjob.trainer.model import parallel
    from ftjob.trainer.objectives.loss import token_loss

    results, d = {}, None
    row = {"input_ids": list(range(10, 70)), "labels": list(range(10, 70))}
    batch = data.collate([{**row, "seq_lengths": [60]}], 0)
    for label, layout in LAYOUTS.items():
        doc = job("p", base, "qlora", resources={"nodes": 2, "processesPerNode": 2},
                  parallelism=layout, checkpoint={"volume": {"claimName": "shared"}})  # fmt: skip
        spec = parse_spec(doc["spec"])
        d = d or parallel.init(spec)
        built = model.build(spec, model.load_tokenizer(spec))
        mesh = parallel.mesh(spec, d, "hybrid")
        shards = parallel.shard_group_size(mesh)
        model.check_shardable(built, shards)
        net = parallel.shard(built.model, spec, mesh, "hybrid", model.left_whole(built, shards))
        model.materialize(built, d, spec.parallelism.cpu_offload)
        nf4 = [p for p in net.parameters() if isinstance(p.to_local(), NF4Tensor)]
        shares = [p.to_local().quantized_data.numel() / nf4_whole(p)["quantized_data"].numel()
                  for p in nf4]  # fmt: skip
        reference = model._adapters(nf4_reference(base, model.frozen_dtype(spec)), spec)
        with torch.no_grad():
            loss, count = token_loss(net, batch, d.device)
            ref_loss, _ = token_loss(reference, batch, d.device)
        trained = [p for p in net.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-2)
        step_loss, n = token_loss(net, batch, d.device)
        (step_loss / n).backward()
        norm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        with torch.no_grad():
            after, _ = token_loss(net, batch, d.device)
        results[label] = {
            "nf4": len(nf4),
            "shares": shares,
            "loss": float(loss / count),
            "reference_loss": float(ref_loss / count),
            "grad_norm": float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm),
            "after": float(after / count),
        }
    (out / f"rank{d.rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("qlora-layouts")
    make_base(folder / "base")
    out = folder / "probe"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", __file__, str(folder / "base"), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_each_rank_holds_half_of_every_4bit_weight_with_hybrid_sharding(ranks, label):
    for rank in ranks:
        assert rank[label]["nf4"] == 14  # 2 layers x 7 linear weights
        assert rank[label]["shares"] == [0.5] * 14  # the shard group is 2 of the 4 ranks


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_hybrid_qlora_equals_the_reference_and_its_replicas_step_together(ranks, label):
    for rank in ranks:
        case = rank[label]
        assert case["loss"] == pytest.approx(case["reference_loss"], abs=1e-5)
        assert case["after"] < case["loss"]  # one clipped AdamW step at lr 1e-2
    # Replicas average their gradients: every rank sees the same norm and the same new loss.
    for key in ("grad_norm", "after"):
        values = [rank[label][key] for rank in ranks]
        assert max(values) - min(values) <= 1e-5 * abs(values[0]), (key, values)


if __name__ == "__main__":
    from ftjob.trainer.__main__ import exit_now

    probe(Path(sys.argv[1]), Path(sys.argv[2]))
    exit_now(0)  # as the trainer leaves: torch.distributed's teardown can abort a done rank
