"""How often a DPO step (LoRA) gathers the weights, under each layout: the reference forward
(adapters off) shares the policy's gathers under grad-op and needs none with the base whole.

    python -m pytest tests/e2e/test_dpo_gathers.py -q

A probe under torchrun (this file's ``__main__``, 2 CPU processes) builds the tiny model the
trainer's way for each layout, runs the trainer's own DPO loss (``Dpo.loss``: the reference
forward, then the policy's) and its backward on one batch of pairs, and counts the
all-gathers FSDP2 issues (``torch.distributed.all_gather_single``, what its default
all-gather calls) and their bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hangs
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LAYOUTS = ("none", "grad-op", "full")
LAYERS = 2  # the tiny model's decoder layers


def spec_for(sharding: str):
    from ftjob.api.jobspec import parse_spec

    return parse_spec({
        "model": {"source": str(EXAMPLES / "tiny-model")},
        "dataset": {"source": "pairs.jsonl", "format": "preference", "maxSeqLength": 64},
        "method": {"type": "lora", "lora": {"r": 8, "dropout": 0.0}},
        "training": {"objective": "dpo", "maxSteps": 1},
        "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2},
        "parallelism": {"sharding": sharding},
    })  # fmt: skip


def probe(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from ftjob.trainer.model import load as model
    from ftjob.trainer.model import parallel
    from ftjob.trainer.objectives.dpo import Dpo

    counted = {"calls": 0, "bytes": 0}
    gather = dist.all_gather_single

    def counting(output, *args, **kwargs):
        counted["calls"] += 1
        counted["bytes"] += output.numel() * output.element_size()
        return gather(output, *args, **kwargs)

    dist.all_gather_single = counting
    pair = {"prompt_ids": list(range(10, 40)), "chosen_ids": [5, 6, 7], "rejected_ids": [8, 9]}
    results, d = {}, None
    for sharding in LAYOUTS:
        spec = spec_for(sharding)
        d = d or parallel.init(spec)
        built = model.build(spec, model.load_tokenizer(spec))
        whole = model.left_whole(built, parallel.shard_group(spec, d, sharding))
        net, _ = parallel.wrap(built.model, spec, d, sharding, whole)  # none: DDP
        model.materialize(built, d)
        objective = Dpo.of(spec)
        batch = objective.collate([pair], 0)
        torch.manual_seed(0)
        objective.loss(net, batch, d.device)[0].backward()  # a first step: FSDP's set-up
        net.zero_grad()
        counted.update(calls=0, bytes=0)
        loss, _ = objective.loss(net, batch, d.device)
        forward = dict(counted)
        loss.backward()
        results[sharding] = {"forward": forward, "step": dict(counted), "loss": float(loss)}
    (out / f"rank{d.rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gathers")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(out)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hangs.RUN)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((out / "rank0.json").read_text())


def test_with_the_base_whole_a_dpo_step_gathers_nothing(counts):
    assert counts["none"]["step"] == {"calls": 0, "bytes": 0}


def test_under_grad_op_the_reference_shares_the_policys_gather(counts):
    # Each layer once (the reference forward), kept for the policy's forward and backward;
    # the root (embeddings, norm, head) once.
    assert counts["grad-op"]["forward"]["calls"] == LAYERS + 1
    assert counts["grad-op"]["step"] == counts["grad-op"]["forward"]


def test_under_full_each_layer_is_gathered_three_times(counts):
    # The reference forward, the policy's forward, the backward; the root stays gathered.
    assert counts["full"]["forward"]["calls"] == 2 * LAYERS + 1
    assert counts["full"]["step"]["calls"] == 3 * LAYERS + 1
    # Each pass beyond grad-op's one gathers the same decoder layers' bytes again.
    full, grad_op = counts["full"], counts["grad-op"]
    layers_once = full["step"]["bytes"] - full["forward"]["bytes"]  # the backward's
    assert layers_once > 0
    assert full["forward"]["bytes"] - grad_op["forward"]["bytes"] == layers_once
    assert grad_op["step"]["bytes"] == grad_op["forward"]["bytes"]


def test_every_layout_computes_the_same_loss(counts):
    losses = [counts[s]["loss"] for s in LAYOUTS]
    assert losses == pytest.approx([losses[0]] * len(LAYOUTS), rel=1e-6)


if __name__ == "__main__":
    from ftjob.trainer.__main__ import exit_now

    probe(Path(sys.argv[1]))
    # As the trainer leaves: torch.distributed's teardown at interpreter exit now and then
    # aborts a rank whose work is written ("terminate called without an active exception").
    exit_now(0)
