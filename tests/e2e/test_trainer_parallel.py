"""Sharding and parallel loading, checked inside 2 (and 4) real processes.

    python -m pytest tests/e2e/test_trainer_parallel.py -q

The test runs this same file under torchrun (the ``__main__`` block below): each rank builds
the tiny model the trainer's way (every rank reading its own rows of the mapped safetensors
files into its FSDP2 shards) for several sharding modes and checkpoint layouts, and writes what
it holds; the test then checks the files against ``from_pretrained`` in the same process.
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


def job(sharding: str, nodes: int, per_node: int, method: str = "full", **extra) -> dict:
    return {
        "model": {"source": extra.pop("source", str(EXAMPLES / "tiny-model"))},
        "dataset": {"source": str(EXAMPLES / "data" / "tiny-text.jsonl"), "maxSeqLength": 64},
        "method": {"type": method},
        "training": {"maxSteps": 1},
        "resources": {"nodes": nodes, "gpusPerNode": 0, "processesPerNode": per_node},
        "parallelism": {"sharding": sharding},
        "checkpoint": {"volume": {"claimName": "x"}} if nodes > 1 else {},
        **extra,
    }


# (label, spec, expected share of a decoder weight on each rank)
CASES = [
    ("full", job("full", 1, 2), 0.5),
    ("grad-op", job("grad-op", 1, 2), 0.5),
    ("none", job("none", 1, 2), 1.0),
    ("hybrid", job("hybrid", 2, 1), 1.0),  # 2 nodes x 1: shard within a node of one
    ("lora", job("full", 1, 2, "lora"), 0.5),
    # bf16 compute on CPU: the frozen base is held in bf16, the adapters in fp32
    ("lora-bf16", job("full", 1, 2, "lora", training={"maxSteps": 1, "precision": "bf16"}), 0.5),
    ("offload", job("full", 1, 2, parallelism={"sharding": "full", "cpuOffload": True}), 0.5),
    # a model with tied input/output embeddings and a tokenizer without a pad token
    ("tied", job("full", 1, 2, source="TIED"), 0.5),
    # bf16 weights in 3 files with an index, as published models are: cast to fp32 on read
    ("sharded-bf16", job("full", 1, 2, source="SHARDED"), 0.5),
    (
        "sharded-bf16-lora",
        job("full", 1, 2, "lora", source="SHARDED", training={"maxSteps": 1, "precision": "bf16"}),
        0.5,
    ),  # fmt: skip
]


# 4 processes as 2 nodes x 2: shards within a node, replicas across the two nodes; and 4 shards.
CASES_4 = [
    ("hybrid-2x2", job("hybrid", 2, 2), 0.5),
    ("lora-hybrid-2x2", job("hybrid", 2, 2, "lora"), 0.5),
    ("full-4", job("full", 1, 4), 0.25),
]


def make_tied(folder: Path) -> None:
    """The tiny model with tied embeddings, its tokenizer stripped of the pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model")
    model.lm_head.weight = model.get_input_embeddings().weight
    model.config.tie_word_embeddings, model.config.pad_token_id = True, None
    model.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(EXAMPLES / "tiny-model")
    tok.pad_token = None
    tok.save_pretrained(folder)


def make_sharded(folder: Path) -> None:
    """The tiny model in bf16, saved in several files with a model.safetensors.index.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model", dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="150KB")
    AutoTokenizer.from_pretrained(EXAMPLES / "tiny-model").save_pretrained(folder)


def local_fraction(param) -> float:
    """Share of a parameter this rank stores (1.0 when replicated)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() / max(param.numel(), 1)


def probe(out: Path, models: Path, cases: list) -> None:
    """Run under torchrun: build every case, record shard sizes and equality with the files."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ftjob.api.jobspec import parse_spec
    from ftjob.job import modelfiles
    from ftjob.trainer.data import batches as data
    from ftjob.trainer.model import load as model
    from ftjob.trainer.model import parallel
    from ftjob.trainer.objectives.loss import token_loss
    from ftjob.trainer.state import export

    results = {}
    d = None
    for label, raw, _ in cases:
        if raw["model"]["source"] in ("TIED", "SHARDED"):
            raw = {**raw, "model": {"source": str(models / raw["model"]["source"].lower())}}
        spec = parse_spec(raw)
        if d is None:
            d = parallel.init(spec)
        # fp32, whatever the files hold: the loss every case's is compared with
        reference = AutoModelForCausalLM.from_pretrained(
            raw["model"]["source"], dtype=torch.float32
        )
        ref_state = reference.state_dict()
        ref_buffers = dict(reference.named_buffers())
        tok = model.load_tokenizer(spec)
        built = model.build(spec, tok)
        sharding = spec.parallelism.sharding
        whole = model.left_whole(built, parallel.shard_group(spec, d, sharding))
        net, _ = parallel.wrap(built.model, spec, d, sharding, whole)  # the trainer's layouts
        model.materialize(built, d, spec.parallelism.cpu_offload)
        net.eval()
        # The adapters an unsharded build draws with the same seed: what every rank's shards
        # must add up to (gathered, they are the same on every rank whatever each drew).
        drawn = {}
        if spec.method.type != "full":
            alone = model.build(spec, tok)
            model.materialize(alone, d)
            drawn = {n: p for n, p in alone.model.state_dict().items() if "lora_" in n}
            del alone
        q = next(p for n, p in net.named_parameters() if "layers.0.self_attn.q_proj" in n)
        same, compared, adapters = True, 0, {}
        for name, param in net.state_dict().items():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            if key in ref_state:
                same &= torch.equal(full, ref_state[key].to(full.dtype))
                compared += 1
            elif "lora_" in name:  # gathered from every rank's shard
                adapters[name] = [float(full.abs().sum()), bool(torch.equal(full, drawn[name]))]
        buffers_equal = all(
            torch.equal(b, ref_buffers[n.replace("base_model.model.", "")])
            for n, b in net.named_buffers()
        )
        ids = list(range(10, 40))
        row = {"input_ids": ids, "labels": ids, "seq_lengths": [len(ids)]}
        batch = data.collate([row], tok.pad_token_id)
        with torch.no_grad():
            loss, count = token_loss(net, batch, d.device)
            ref_loss, _ = token_loss(reference, batch, d.device)
        # The tensors' bytes (no headers) in the files the model's index names, as safetensors
        # reads them.
        weights = modelfiles.weight_files(Path(raw["model"]["source"]))
        files = sum(t.nbytes for f in weights for t in load_file(f).values())
        results[label] = {
            "read_share": built.read_bytes / files,
            "compared": compared,
            "parameters": len(ref_state),
            "adapters": adapters,
            "q_proj_share": local_fraction(q),
            "dtypes": {
                "frozen": sorted({str(p.dtype) for p in net.parameters() if not p.requires_grad}),
                "trained": sorted({str(p.dtype) for p in net.parameters() if p.requires_grad}),
            },
            "weights_equal_files": bool(same),
            "buffers_equal": buffers_equal,
            "loss": float(loss / count),
            "reference_loss": float(ref_loss / count),
            "pad_token": tok.pad_token,
        }
        if label == "tied":
            export.export(net, spec, tok, out / "tied-export", d.rank)
            reloaded = AutoModelForCausalLM.from_pretrained(out / "tied-export")
            with torch.no_grad():
                exported, _ = token_loss(reloaded, batch, d.device)
            results[label]["export_loss"] = float(exported / count)
            results[label]["export_tied"] = reloaded.config.tie_word_embeddings
        del net, built
    (out / f"rank{d.rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_probe(out: Path, models: Path, processes: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(out)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(processes), __file__, str(out), str(models)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hangs.RUN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    make_tied(folder / "tied")
    make_sharded(folder / "sharded")
    assert len(list((folder / "sharded").glob("model-*.safetensors"))) >= 3
    return folder


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, models) -> list[dict]:
    return run_probe(tmp_path_factory.mktemp("probe"), models, 2)


@pytest.fixture(scope="module")
def ranks_4(tmp_path_factory, models) -> list[dict]:
    return run_probe(tmp_path_factory.mktemp("probe4"), models, 4)


@pytest.mark.parametrize(("label", "share"), [(c[0], c[2]) for c in CASES])
def test_each_rank_holds_its_share_of_the_weights(ranks, label, share):
    for rank in ranks:
        assert rank[label]["q_proj_share"] == pytest.approx(share)


# What each rank reads of the files: its own rows (1/2), or everything where it keeps
# everything (a shard group of one).
READ_SHARE = {"none": 1.0, "hybrid": 1.0}
BF16_COMPUTE = ("lora-bf16", "sharded-bf16-lora")


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_every_rank_reads_its_own_rows_and_holds_the_files_weights(ranks, label):
    for rank in ranks:
        assert rank[label]["read_share"] == pytest.approx(READ_SHARE.get(label, 0.5), abs=0.01)
        assert rank[label]["compared"] == rank[label]["parameters"]  # every tensor compared
        assert rank[label]["weights_equal_files"]
        assert rank[label]["buffers_equal"]  # rotary inv_freq is not in the state dict
        if label not in BF16_COMPUTE:  # bf16 arithmetic: compared with its tolerance below
            assert rank[label]["loss"] == pytest.approx(rank[label]["reference_loss"], abs=1e-6)


@pytest.mark.parametrize(
    ("label", "frozen", "trained"),
    [
        ("full", [], ["torch.float32"]),  # full fine-tuning keeps fp32 master weights
        ("lora", ["torch.float32"], ["torch.float32"]),  # fp32 compute: fp32 everywhere
        ("lora-bf16", ["torch.bfloat16"], ["torch.float32"]),
    ],
)
def test_the_frozen_base_is_held_in_the_compute_dtype(ranks, label, frozen, trained):
    for rank in ranks:
        assert rank[label]["dtypes"] == {"frozen": frozen, "trained": trained}
    # bf16 rounding of the weights and activations moves the loss by well under 1%
    for label in BF16_COMPUTE:
        case = ranks[0][label]
        assert case["loss"] == pytest.approx(case["reference_loss"], rel=1e-2)


@pytest.mark.parametrize("label", ["lora", "sharded-bf16-lora"])
def test_adapters_start_as_an_unsharded_build_with_the_same_seed_draws_them(ranks, label):
    """Each rank draws its shards on its own: gathered, they are the unsharded model's."""
    for rank in ranks:
        adapters = rank[label]["adapters"]
        assert len(adapters) == 2 * 2 * 7  # A and B of 7 linear layers in 2 decoder layers
        assert all(equal for _, equal in adapters.values())
        # peft's initialisation: B is zero (the adapted model starts as the base), A is not
        assert all((total == 0) == (".lora_B." in name) for name, (total, _) in adapters.items())


@pytest.mark.parametrize("label", [c[0] for c in CASES_4])
def test_4_ranks_hybrid_and_4_shards_read_their_rows_and_hold_the_files_weights(ranks_4, label):
    share = dict((c[0], c[2]) for c in CASES_4)[label]
    for rank in ranks_4:
        case = rank[label]
        assert case["q_proj_share"] == pytest.approx(share)
        assert case["read_share"] == pytest.approx(share, abs=0.01)  # its shard, read once
        assert case["weights_equal_files"] and case["buffers_equal"]
        assert case["loss"] == pytest.approx(case["reference_loss"], abs=1e-6)
        assert all(equal for _, equal in case["adapters"].values())  # as drawn unsharded


def test_tied_embeddings_and_a_missing_pad_token(ranks):
    tied = ranks[0]["tied"]
    assert tied["pad_token"] == "<|eos|>"  # eos stands in for the missing pad token
    assert tied["export_tied"] is True
    assert tied["export_loss"] == pytest.approx(tied["reference_loss"], abs=1e-6)


if __name__ == "__main__":
    from ftjob.trainer.__main__ import exit_now

    world = int(os.environ["WORLD_SIZE"])
    probe(Path(sys.argv[1]), Path(sys.argv[2]), CASES if world == 2 else CASES_4)
    exit_now(0)  # as the trainer leaves: torch.distributed's teardown can abort a done rank
