"""training.precision fp8, in one process: which modules compute in float8, what is refused,
and what stays as a bf16 run has it.

    python -m pytest tests/unit/test_float8.py -q

The 2-process runs (loss against fp32, kill and resume, crossing precisions, the export) are
in tests/e2e/test_fp8.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ftjob.api.contract import TrainerError
from ftjob.api.hardware import FP8_GPU_TYPES, GPUS
from ftjob.api.jobspec import parse_spec
from ftjob.api.schema import SpecError
from ftjob.plan.limits import float8_all_gather
from ftjob.trainer.model import float8, parallel
from ftjob.trainer.model import load as model

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-model"
ONE = parallel.Dist(rank=0, local_rank=0, world_size=1, local_world_size=1,
                    device=torch.device("cpu"))  # fmt: skip
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip


def spec(source: Path = TINY, method: str = "full", **training):
    raw = {"model": {"source": str(source)}, "dataset": {"source": "d.jsonl"},
           "method": {"type": method}, "training": {"maxSteps": 1, **training},
           "resources": {"gpusPerNode": 0}}  # fmt: skip
    return parse_spec(raw)


def built(job) -> model.Built:
    b = model.build(job, model.load_tokenizer(job))
    model.materialize(b, ONE)
    return b


def kinds(net) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in net.named_modules()}


def test_the_decoders_linear_layers_compute_in_float8_and_the_first_and_last_do_not():
    b = built(spec(precision="fp8"))
    found = kinds(b.model)
    layers = [f"model.layers.{i}.{name}" for i in range(2) for name in LINEARS]
    assert sorted(n for n, k in found.items() if k == "Float8Linear") == sorted(layers)
    assert b.converted == sorted(layers)
    assert found["model.embed_tokens"] == "Embedding"
    assert found["lm_head"] == "Linear"  # the output projection stays high precision
    # They are the weights the plan counts at the float8 peak (ModelShape.linear_params, its
    # share of the FLOPs) and whose float8 copies it counts (linear_shapes): shape for shape.
    from ftjob.plan.modelshape import ModelShape

    shape = ModelShape.from_config(json.loads((TINY / "config.json").read_text()))
    weights = {n: tuple(m.weight.shape) for n, m in b.model.named_modules() if n in layers}
    assert {n.rsplit(".", 1)[1]: s for n, s in weights.items()} == shape.linear_shapes()
    assert sum(r * c for r, c in weights.values()) == shape.linear_params


def test_an_fp8_model_holds_the_same_weights_under_the_same_names_as_a_bf16_one():
    """What checkpoints and exports are made of: a bf16 run's parameters, name for name."""
    fp8, bf16 = built(spec(precision="fp8")).model, built(spec(precision="bf16")).model
    a, b = fp8.state_dict(), bf16.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name


def test_float8_rounding_changes_the_logits_a_little_on_cpu():
    """Emulation rounds to float8 for real: the logits differ from bf16's, by little."""
    ids = torch.arange(1, 65).reshape(2, 32)
    fp8, bf16 = built(spec(precision="fp8")).model, built(spec(precision="bf16")).model
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        x, y = fp8(ids).logits.float(), bf16(ids).logits.float()
    gap = (x - y).abs().max().item()
    assert 0 < gap < 0.1 * y.abs().max().item(), gap


def test_lora_converts_the_frozen_base_and_leaves_the_adapters_in_high_precision():
    b = built(spec(method="lora", precision="fp8"))
    found = kinds(b.model)
    bases = [n for n, k in found.items() if k == "Float8Linear"]
    assert len(bases) == 14 and all(n.endswith(".base_layer") for n in bases), bases
    adapters = [n for n in found if ".lora_A." in n or ".lora_B." in n]
    assert adapters and all(found[n] == "Linear" for n in adapters)
    assert not float8_all_gather(b.spec)  # only a sharded full fine-tune does


def test_rowwise_scaling_runs_by_emulation_on_cpu():
    job = spec(precision="fp8", fp8Recipe="rowwise")
    b = built(job)
    config = float8.config(job)
    assert config.emulate and not config.enable_fsdp_float8_all_gather
    loss = b.model(torch.arange(1, 33).reshape(1, 32), labels=torch.arange(1, 33)[None]).loss
    loss.backward()
    assert b.model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_a_layer_whose_size_float8_cannot_take_is_refused_by_name_before_any_read(tmp_path):
    source = tmp_path / "odd"
    shutil.copytree(TINY, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"intermediate_size": 100}))
    job = spec(source, precision="fp8")
    with pytest.raises(TrainerError) as refused:
        model.build(job, model.load_tokenizer(job))
    assert "gate_proj (100x64)" in str(refused.value) and "divide by 16" in str(refused.value)
    assert refused.value.where == ".training.precision"
    assert "use precision bf16" in refused.value.fix
    model.build(spec(source, precision="bf16"), model.load_tokenizer(job))  # bf16 takes it


def test_auto_never_picks_fp8_and_fp8_compiles_on_gpus_only_unless_told():
    assert spec().compute_precision() == "fp32"
    job = spec(precision="fp8")
    assert job.compute_precision() == "fp8" and job.bf16_compute()
    assert job.training.fp8_scaling() == "tensorwise"
    assert job.compile_enabled(on_gpu=True) and not job.compile_enabled(on_gpu=False)
    assert not spec(precision="fp8", compile=False).compile_enabled(on_gpu=True)
    assert spec(precision="bf16").training.fp8_scaling() is None


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"method": {"type": "qlora"}}, "spec.training.precision", "4-bit NF4"),
        ({"resources": {"gpuType": "A100-80GB"}}, "spec.training.precision", "float8 tensor"),
        ({"training": {"precision": "bf16", "fp8Recipe": "rowwise"}}, "spec.training.fp8Recipe",
         "precision fp8"),
    ],
)  # fmt: skip
def test_fp8_where_it_cannot_run_is_refused_at_the_door(changes, field, words):
    raw = {"model": {"source": "hf://org/m"}, "dataset": {"source": "d.jsonl"},
           "method": {"type": "full"}, "training": {"maxSteps": 1, "precision": "fp8"},
           "resources": {"gpusPerNode": 1}}  # fmt: skip
    for section, values in changes.items():
        raw[section].update(values)
    with pytest.raises(SpecError) as refused:
        parse_spec(raw)
    assert [e.path for e in refused.value.errors] == [field]
    assert words in str(refused.value)


def test_fp8_is_accepted_on_every_gpu_with_float8_tensor_cores():
    assert set(FP8_GPU_TYPES) >= {"H100-SXM-80GB", "H100-80GB", "H200-141GB", "B200-180GB"}
    assert not {"A100-80GB", "A100-40GB", "A10G-24GB"} & set(FP8_GPU_TYPES)
    for name in FP8_GPU_TYPES:
        raw = {"model": {"source": "hf://org/m"}, "dataset": {"source": "d.jsonl"},
               "training": {"maxSteps": 1, "precision": "fp8"},
               "resources": {"gpusPerNode": 1, "gpuType": name}}  # fmt: skip
        parse_spec(raw)
        # Dense float8 is twice dense bf16 on Hopper and Blackwell boards (datasheets).
        if name.startswith(("H1", "H2", "B2")):
            assert GPUS[name].peak_fp8_flops == pytest.approx(2 * GPUS[name].peak_bf16_flops,
                                                              rel=0.01)  # fmt: skip


def test_a_job_folder_takes_a_change_of_precision_but_not_of_what_trains():
    """fp8 and bf16 checkpoints hold the same weights: a folder resumes across precisions,
    also one recorded before precision was a safe change (its record still lists it)."""
    from ftjob.job import folder

    old = folder.record("j", spec(precision="bf16"))
    old["training"]["training.precision"] = "bf16"
    old["fingerprint"] = folder.fingerprint(old["training"])
    assert folder.changes(old, spec(precision="fp8", fp8Recipe="rowwise")) == []
    assert folder.changes(old, spec(precision="fp8", learningRate=0.5)) == [
        "spec.training.learningRate: (unset) -> 0.5"
    ]


# ---------------------------------------------------------------------------------- plan

H100X8 = {"resources.gpuType": "H100-SXM-80GB", "dataset.maxSeqLength": 8192,
          "training.microBatchSize": 1, "training.compile": True}  # fmt: skip


def planned(precision: str, **changes):
    from example_jobs import example

    from ftjob.plan import layout
    from ftjob.plan.modelshape import known_model

    edits = H100X8 | {"training.precision": precision} | changes
    job = example("llama3-8b-full-40gb.yaml", **edits)
    shape = known_model(job.model.source)
    return layout.estimate(job, shape), shape, job


# Published configs (hidden, layers, key/value width, intermediate, vocab), counted here
# rather than by ModelShape: Llama 3 8B's head is 7% of its matmul FLOPs, Llama 2 7B's 2%.
LLAMA3_8B = ("hf://meta-llama/Meta-Llama-3-8B", 4096, 32, 1024, 14336, 128256)
LLAMA2_7B = ("hf://meta-llama/Llama-2-7b-hf", 4096, 32, 4096, 11008, 32000)
SHARES = [(LLAMA3_8B, 1024), (LLAMA3_8B, 8192), (LLAMA3_8B, 32768), (LLAMA2_7B, 4096)]


def test_the_plan_speeds_up_the_converted_layers_share_of_the_flops_and_nothing_else():
    """fp8 makes the decoder's linear layers faster, not attention or the head: the speedup
    follows Amdahl's law over those layers' share of the forward, so the float8 factor it
    implies is one whatever the share, which differs with the sequence length (attention) and
    the model (the head). Not asserted: that the plan gives torchtitan's 8B ratio
    (8,532/6,667), which FP8_EFFICIENCY was fitted to; it would only restate the constant."""
    implied = []
    for (source, h, layers, kv, inter, vocab), seq in SHARES:
        edits = {"dataset.maxSeqLength": seq, "model.source": source}
        (bf16, _, _), (fp8, _, _) = planned("bf16", **edits), planned("fp8", **edits)
        assert fp8.flops_per_token == bf16.flops_per_token  # the same model FLOPs
        speedup = bf16.compute_seconds / fp8.compute_seconds
        # MFU, quoted against the bf16 peak, rises by the same ratio.
        assert fp8.hardware_utilisation / bf16.hardware_utilisation == pytest.approx(speedup)
        linear = layers * (h * (2 * h + 2 * kv) + 3 * h * inter)
        share = 2 * linear / (2 * (linear + vocab * h) + 4 * h * seq * layers)
        assert 1 < speedup < 1 / (1 - share)  # never faster than if those layers took no time
        implied.append(share / (1 / speedup - (1 - share)))
    # The plan's forward also counts the norms' weights (3 in 100,000 of its FLOPs): rel 1e-4.
    assert implied == pytest.approx([implied[0]] * len(implied), rel=1e-4)
    peaks = GPUS["H100-SXM-80GB"]
    assert 1 < implied[0] < peaks.peak_fp8_flops / peaks.peak_bf16_flops
    assert any(n.startswith("fp8 (tensorwise)") and "gathered in float8" in n for n in fp8.notes)


def test_the_plan_counts_float8_copies_and_gathers_of_a_byte_a_weight():
    from ftjob.plan import estimate

    bf16, shape, _ = planned("bf16")
    fp8, _, job = planned("fp8")
    # Largest linear of Llama 3 8B: gate/up (14336x4096); 8192 tokens; three tensorwise scales.
    copies = 8192 * (4096 + 14336) + 14336 * 4096 + 3 * 4
    assert estimate.float8_copies(job, shape, 8192) == copies
    # FSDP gathers two layers at a time; their linear weights arrive in 1 byte, not 2.
    saved = 2 * shape.linear_params / shape.layers
    assert fp8.temporaries - bf16.temporaries == pytest.approx(copies - saved)
    assert fp8.activations == bf16.activations  # torchao saves the bf16 input, not a copy
    assert fp8.collective_seconds < bf16.collective_seconds  # the gathers move fewer bytes
    rowwise, _, job = planned("fp8", **{"training.fp8Recipe": "rowwise"})
    assert estimate.float8_copies(job, shape, 8192) == copies + 4 * (2 * 8192 + 14336 + 4096 - 3)
    # Rowwise has no float8 all-gather: it gathers what bf16 gathers.
    assert rowwise.collective_seconds == bf16.collective_seconds


def test_the_plan_refuses_fp8_on_a_model_whose_shapes_float8_cannot_take():
    from ftjob.plan import layout
    from ftjob.plan.modelshape import ModelShape

    _, _, job = planned("fp8")
    odd = ModelShape.from_config({"hidden_size": 4096, "num_hidden_layers": 2,
                                  "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "intermediate_size": 14330, "vocab_size": 1000})  # fmt: skip
    e = layout.estimate(job, odd)
    assert e.fits is False and e.problem.path == "spec.training.precision"
    assert "gate_proj (14330x4096)" in e.problem.message


def test_fp8_on_cpu_is_taken_with_a_warning_that_it_is_emulated():
    from ftjob.api.jobspec import ineffective

    job = spec(precision="fp8")
    assert any("fp8 on CPU is emulated" in w for w in ineffective(job, {}))
    assert not any("emulated" in w for w in ineffective(spec(precision="bf16"), {}))
