"""QLoRA end to end: a 4-bit (torchao NF4) base sharded by FSDP2 over 2 real CPU processes.

    python -m pytest tests/e2e/test_qlora.py -q

The base is a small Llama built here in bf16 (the committed tiny model's weights are too small
to split into whole NF4 blocks over two ranks). `ftjob run` trains it with QLoRA and with
LoRA; a probe under torchrun (this file's ``__main__``) builds the QLoRA model the trainer's
way and records what each rank holds. In the slow tier the QLoRA job, trained in this process
as a gang of one, resumes from a checkpoint to the same losses (tests/in_process.py's
``resumed_in_process``, which the other methods' resume tests share).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from in_process import resumed_in_process
from test_trainer_run import (
    RUN_TIMEOUT,
    eval_loss_of,
    final,
    losses,
    start,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def make_base(folder: Path) -> None:
    """A 2-layer Llama, hidden 256: every linear weight is a multiple of 2 x 64 x 256 values."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(EXAMPLES / "tiny-model").save_pretrained(folder)


def job(name: str, base: Path, method: str, **changes) -> dict:
    spec = {
        "model": {"source": str(base)},
        "dataset": {
            "source": str(EXAMPLES / "data" / "tiny-text.jsonl"),
            "maxSeqLength": 128,
            "evalFraction": 0.02,
        },  # fmt: skip
        "method": {
            "type": method,
            "lora": {"r": 16, "alpha": 16, "dropout": 0.0, "targetModules": TARGETS},
        },  # fmt: skip
        "training": {
            "maxSteps": 12,
            # At 1e-2 the LoRA run of this tiny model spikes at one step (6.4 vs 4.5) with
            # packed batches while QLoRA does not: an unstable rate, not a 4-bit effect.
            "learningRate": 5e-3,
            "warmup": 2,
            "microBatchSize": 2,
            "logEvery": 1,
            "evalEvery": 0,
        },  # fmt: skip
        "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2},
        "parallelism": {"sharding": "full"},
        "checkpoint": {"every": 4, "keep": 2},
        "output": {"mergeAdapter": True},
    }
    if method == "qlora":
        spec["method"]["quantization"] = {"type": "nf4"}
    for section, values in changes.items():
        spec.setdefault(section, {}).update(values)
    return {"apiVersion": "ftjob.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def run(doc: dict, workdir: Path) -> str:
    proc = start(doc, workdir)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, out
    return out


def nf4_reference(base: Path, dtype: torch.dtype):
    """Unsharded QLoRA, in one process: every decoder linear weight quantized whole."""
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), False)
    return model


def test_qlora_lowers_the_loss_and_tracks_lora_on_the_same_base(qlora, lora):
    q, ref = losses(qlora[0]), losses(lora)
    assert sorted(q) == list(range(1, 13))
    assert sum(q[s] for s in (10, 11, 12)) / 3 < q[1] - 1.0, q
    # The 4-bit base shifts the loss a little; the two curves must stay together.
    gaps = [abs(q[s] - ref[s]) / ref[s] for s in q]
    assert max(gaps) < 0.05, (q, ref)


def test_qlora_export_reloads_with_the_trained_eval_loss(qlora, qlora_runs):
    """The adapter on the base as published, and the merged model in the base's dtype (bf16).

    Training evaluated on the NF4 base; the export is used on the original bf16 base (the merge
    re-reads it). The two differ by what 4-bit rounding changes: the untrained base's loss gap
    between bf16 and NF4, measured here. The reloaded loss must lie within that gap (x2, plus
    bf16 rounding of the merged weights) of the trained one.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    workdir, _ = qlora
    export, base = workdir / "model", qlora_runs / "base"
    trained = json.loads((workdir / "progress.json").read_text())["evalLoss"]
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gap = abs(
        eval_loss_of(plain, workdir) - eval_loss_of(nf4_reference(base, torch.float32), workdir)
    )
    adapted = PeftModel.from_pretrained(plain, export)
    assert eval_loss_of(adapted, workdir) == pytest.approx(trained, abs=2 * gap + 1e-3)
    merged = AutoModelForCausalLM.from_pretrained(export / "merged")
    assert merged.dtype == torch.bfloat16  # the base's original dtype
    assert eval_loss_of(merged.float(), workdir) == pytest.approx(trained, abs=2 * gap + 5e-3)


@pytest.mark.slow  # tests/deadline.py: an exact resume is also LoRA DPO's (adapters) and GRPO's
def test_qlora_resumes_exactly_from_a_checkpoint(qlora_runs, tmp_path):
    """The adapters and their optimizer state over the 4-bit base: resumed from step 4's
    checkpoint, steps 5-8 log the uninterrupted run's losses exactly. (No eval and no merged
    export: neither is what a resume restores, and each costs both runs seconds.)"""
    doc = job("qlora", qlora_runs / "base", "qlora", training={"maxSteps": 8},
              dataset={"evalFraction": None}, output={"mergeAdapter": False})  # fmt: skip
    first, again, out = resumed_in_process(doc, tmp_path, 4)
    assert "(step 4)" in out, out
    resumed, uninterrupted = losses(again), losses(first)
    assert sorted(resumed) == list(range(5, 9))
    assert [resumed[s] for s in resumed] == [uninterrupted[s] for s in resumed]


def test_qlora_on_weights_that_cannot_split_is_refused_before_loading(tmp_path):
    """The tiny model's 64x64 weights are a quarter of one NF4 scale block."""
    doc = job("bad", EXAMPLES / "tiny-model", "qlora")
    proc = start(doc, tmp_path / "bad")
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode != 0
    assert "cannot be stored in NF4" in out and "fix: use method.type lora" in out, out
    assert "step 1" not in out


# ---------------------------------------------------------------------------------- probe

NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")


def nf4_whole(p) -> dict[str, torch.Tensor]:
    """The parts of a sharded 4-bit weight, whole: each rank's shard of each part gathered over
    the shard group (a plain, blocking all-gather). Not ``p.full_tensor()``: torchao's NF4 path
    through the functional all-gather now and then corrupted the heap on CPU (gloo):
    ``malloc(): unaligned tcache chunk detected`` in its wait, 3 probe runs in 28 beside a CI run.
    The trainer never gathers a 4-bit weight that way (FSDP2 gathers its plain parts)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    (dim,) = [i for i, s in enumerate(p.placements) if isinstance(s, Shard)]
    group = p.device_mesh.get_group(dim)
    whole = {}
    for part in NF4_PARTS:
        mine = getattr(p.to_local(), part)
        pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, mine, group=group)
        whole[part] = torch.cat(pieces)
    return whole


def probe(base: Path, out: Path) -> None:
    """Under torchrun: build the QLoRA model the trainer's way; record what this rank holds."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchao.quantization import NF4Tensor

    from ftjob.api.jobspec import parse_spec
    from ftjob.trainer.data import batches as data
    from ftjob.trainer.model import load as model
    from ftjob.trainer.model import parallel
    from ftjob.trainer.objectives.loss import token_loss

    results, d = {}, None
    cases = {"fp32": {}, "bf16": {}, "offload": {"parallelism": {"cpuOffload": True}}}
    for precision, extra in cases.items():
        training = {"precision": "bf16" if precision == "bf16" else "fp32"}
        spec = parse_spec(job("p", base, "qlora", training=training, **extra)["spec"])
        d = d or parallel.init(spec)
        tok = model.load_tokenizer(spec)
        built = model.build(spec, tok)
        mesh = parallel.mesh(spec, d, "full")
        model.check_shardable(built, parallel.shard_group_size(mesh))
        net = parallel.shard(built.model, spec, mesh, "full")
        model.materialize(built, d, spec.parallelism.cpu_offload)
        nf4 = {n: p for n, p in net.named_parameters() if isinstance(p.to_local(), NF4Tensor)}
        shares = []
        wholes = {n: nf4_whole(p) for n, p in nf4.items()}
        for n, p in nf4.items():
            held = sum(getattr(p.to_local(), part).nbytes for part in NF4_PARTS)
            shares.append(held / sum(t.nbytes for t in wholes[n].values()))
        row = {"input_ids": list(range(10, 70)), "labels": list(range(10, 70))}
        batch = data.collate([{**row, "seq_lengths": [60]}], 0)
        reference = model._adapters(nf4_reference(base, model.frozen_dtype(spec)), spec)
        ref_weights = dict(reference.named_parameters())
        bit_equal = all(
            torch.equal(whole[part], getattr(ref_weights[n], part))
            for n, whole in wholes.items()
            for part in NF4_PARTS
        )
        with torch.no_grad():
            loss, count = token_loss(net, batch, d.device)
            ref_loss, _ = token_loss(reference, batch, d.device)
        # DCP round trip of the whole sharded state, 4-bit weights included.
        saved = {k: v for k, v in net.state_dict().items()}
        dcp.save(saved, checkpoint_id=str(out / f"dcp-{precision}"))
        reread = {k: copy.deepcopy(v) for k, v in saved.items()}
        for v in reread.values():  # wipe the copy, so that only the load can restore it
            local = v.to_local()
            (local.quantized_data if isinstance(local, NF4Tensor) else local).zero_()
        dcp.load(reread, checkpoint_id=str(out / f"dcp-{precision}"))
        exact = all(torch.equal(reread[k].to_local().quantized_data, v.to_local().quantized_data)
                    if isinstance(v.to_local(), NF4Tensor) else torch.equal(reread[k], v)
                    for k, v in saved.items())  # fmt: skip
        results[precision] = {
            "quantized": sorted(built.quantized),
            "nf4_params": sorted(nf4),
            "nf4_shares": shares,
            "nf4_dtypes": sorted({str(p.dtype) for p in nf4.values()}),
            "frozen_dtypes": sorted(
                {str(p.dtype) for p in net.parameters() if not p.requires_grad}
            ),
            "trained_dtypes": sorted({str(p.dtype) for p in net.parameters() if p.requires_grad}),
            "loss": float(loss / count),
            "reference_loss": float(ref_loss / count),
            "dcp_exact": exact,
            "nf4_bit_equal": bit_equal,
            "read_bytes": built.read_bytes,
        }
    # Hybrid over 2 nodes x 1 process: a shard group of one, where the 4-bit weights stay whole
    # (outside FSDP) on each rank and only the replicas' gradients are averaged.
    raw = job(
        "p",
        base,
        "qlora",
        resources={"nodes": 2, "processesPerNode": 1},
        parallelism={"sharding": "hybrid"},
        checkpoint={"volume": {"claimName": "x"}},
    )
    spec = parse_spec(raw["spec"])  # fmt: skip
    built = model.build(spec, model.load_tokenizer(spec))
    mesh = parallel.mesh(spec, d, "hybrid")
    shards = parallel.shard_group_size(mesh)
    net = parallel.shard(built.model, spec, mesh, "hybrid", model.left_whole(built, shards))
    model.materialize(built, d)
    reference = model._adapters(nf4_reference(base, torch.float32), spec)
    loss, count = token_loss(net, batch, d.device)
    (loss / count).backward()  # gradients flow through the whole 4-bit weights
    with torch.no_grad():
        ref_loss, _ = token_loss(reference, batch, d.device)
    grads = [p.grad is not None for p in net.parameters() if p.requires_grad]
    results["hybrid"] = {
        "shards": shards,
        "whole_nf4": sum(isinstance(p, NF4Tensor) for p in net.parameters()),
        "loss": float(loss / count),
        "reference_loss": float(ref_loss / count),
        "all_adapters_have_grads": all(grads),
    }
    (out / f"rank{d.rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(qlora_runs) -> list[dict]:
    out = qlora_runs / "probe"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, str(qlora_runs / "base"), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_each_rank_holds_half_of_every_4bit_weight(ranks, qlora_runs):
    from safetensors.torch import load_file

    for rank in ranks:
        case = rank["fp32"]
        # every decoder linear weight (2 layers x 7) is NF4, and nothing else is
        assert len(case["quantized"]) == 14
        assert case["nf4_params"] == case["quantized"]
        assert case["nf4_shares"] == [0.5] * 14
    # Both ranks read the files: the 4-bit weights whole (each one's NF4 scales span all of
    # it), and their own half of the rest.
    tensors = load_file(qlora_runs / "base" / "model.safetensors")
    names = [n.removeprefix("base_model.model.").replace(".base_layer", "")
             for n in ranks[0]["fp32"]["quantized"]]  # the files' names  # fmt: skip
    whole = sum(t.nbytes for k, t in tensors.items() if k in names)
    half = sum(t.nbytes for k, t in tensors.items() if k not in names) / 2
    assert [r["fp32"]["read_bytes"] for r in ranks] == [whole + half] * 2


def test_sharded_qlora_equals_the_unsharded_nf4_reference(ranks):
    for rank in ranks:
        # the gathered shards are the 4-bit weights quantized whole, bit for bit
        assert all(rank[p]["nf4_bit_equal"] for p in ("fp32", "bf16", "offload"))
        for label in ("fp32", "offload"):  # CPU offload: FSDP's CPUOffloadPolicy over NF4
            case = rank[label]
            assert case["loss"] == pytest.approx(case["reference_loss"], abs=1e-5)
            assert case["nf4_shares"] == [0.5] * 14


def test_a_bf16_job_holds_its_base_in_bf16_and_trains_fp32_adapters(ranks):
    for rank in ranks:
        assert rank["bf16"]["nf4_dtypes"] == ["torch.bfloat16"]  # NF4 dequantizes to bf16
        assert rank["bf16"]["frozen_dtypes"] == ["torch.bfloat16"]
        assert rank["bf16"]["trained_dtypes"] == ["torch.float32"]
        assert rank["fp32"]["frozen_dtypes"] == ["torch.float32"]
        # bf16 arithmetic: within 1% of the same reference computed in bf16
        bf16 = rank["bf16"]
        assert bf16["loss"] == pytest.approx(bf16["reference_loss"], rel=1e-2)


def test_hybrid_with_one_process_per_node_keeps_the_4bit_weights_whole(ranks):
    for rank in ranks:
        case = rank["hybrid"]
        assert case["shards"] == 1 and case["whole_nf4"] == 14
        assert case["loss"] == pytest.approx(case["reference_loss"], abs=1e-5)
        assert case["all_adapters_have_grads"]


def test_dcp_round_trip_of_the_sharded_4bit_state_is_exact(ranks):
    assert all(rank[p]["dcp_exact"] for rank in ranks for p in ("fp32", "bf16", "offload"))


if __name__ == "__main__":
    from ftjob.trainer.__main__ import exit_now

    probe(Path(sys.argv[1]), Path(sys.argv[2]))
    exit_now(0)  # as the trainer leaves: torch.distributed's teardown can abort a done rank


def test_the_cpu_qlora_example_trains_and_its_export_loads(tmp_path, monkeypatch):
    """examples/tiny-qlora.yaml as a new user runs it (2 processes, its bundled base): the loss
    drops, and the adapter export loads with plain transformers from another folder."""
    from transformers import AutoModelForCausalLM

    for name in ("tiny-qlora-model", "data"):  # the example's relative sources
        (tmp_path / name).symlink_to(EXAMPLES / name)
    doc = yaml.safe_load((EXAMPLES / "tiny-qlora.yaml").read_text())
    doc["spec"]["training"]["logEvery"] = 1  # step 1's loss is the untrained adapters'
    workdir = tmp_path / "tiny-qlora"
    run(doc, workdir)
    curve = losses(workdir)
    assert sorted(curve) == list(range(1, 41))
    assert sum(curve[s] for s in (38, 39, 40)) / 3 < curve[1] - 1.5, curve
    trained = final(workdir)["evalLoss"]

    monkeypatch.chdir(tmp_path.parent)  # the adapter's base must resolve from anywhere
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.peft_config  # base + adapter
    base = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-qlora-model", dtype=torch.float32)
    untrained, reloaded = eval_loss_of(base, workdir), eval_loss_of(model, workdir)
    # Trained on the 4-bit base, reloaded on the bf16 one: close, and far below the base's.
    assert reloaded == pytest.approx(trained, abs=0.1), (reloaded, trained)
    assert reloaded < untrained - 1.5, (reloaded, untrained)
