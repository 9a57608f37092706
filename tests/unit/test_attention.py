"""trainer/model/attention.py: packed documents never see each other, on every implementation the
spec offers, at micro-batch 1 and 4, with no S x S mask on the default path.

    python -m pytest tests/unit/test_attention.py -q

The tiny Llama in examples/ has grouped-query attention (4 query heads, 2 K/V heads). The
flash kernels need CUDA: here transformers' flash path and torch's varlen kernel run with
stand-ins computing the same attention, which checks what ftjob hands them, not the kernels.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers.modeling_flash_attention_utils as flash_utils
from transformers import AutoModelForCausalLM

from ftjob.api.jobspec import parse_spec
from ftjob.trainer.data import batches as data
from ftjob.trainer.data.batches import IGNORE
from ftjob.trainer.model import attention, parallel
from ftjob.trainer.model import load as model
from ftjob.trainer.state import export

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
PAD = 0
# Four rows of packed documents (lengths); rows shorter than the longest end in padding.
DOCS = [[5, 17, 9], [30], [3, 3, 12, 1, 4], [20, 8]]


def make_rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for lengths in DOCS:
        ids, labels = [], []
        for n in lengths:
            doc = torch.randint(3, 1000, (n,), generator=g).tolist()
            ids += doc
            labels += [IGNORE, *doc[1:]]  # a document's first token follows another document
        rows.append({"input_ids": ids, "labels": labels, "seq_lengths": lengths})
    return rows


ROWS = make_rows()


def tiny(implementation: str):
    attention.register()  # as attention.implementation("sdpa") does for a job's build
    return AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.float32, attn_implementation=implementation
    ).eval()


@pytest.fixture(scope="module")
def models() -> dict:
    return {}


def get(models: dict, implementation: str):
    if implementation not in models:
        models[implementation] = tiny(implementation)
    return models[implementation]


def per_token_losses(net, rows, kwargs) -> torch.Tensor:
    """The losses of the labelled next-token targets, row by row, in order."""
    batch = data.collate(rows, PAD)
    extra = kwargs(batch) if callable(kwargs) else kwargs
    with torch.no_grad():
        logits = net(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **extra
        ).logits
    target = batch.labels[:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].transpose(1, 2), target, ignore_index=IGNORE, reduction="none"
    )
    return loss[target != IGNORE]


@pytest.fixture(scope="module")
def alone(models) -> torch.Tensor:
    """Every document run by itself (a batch of one, plain causal attention), in order."""
    net, losses = get(models, "sdpa"), []
    for row in ROWS:
        start = 0
        for n in row["seq_lengths"]:
            doc = {k: row[k][start : start + n] for k in ("input_ids", "labels")}
            losses.append(per_token_losses(net, [{**doc, "seq_lengths": [n]}], {}))
            start += n
    return torch.cat(losses)


def packed(net, micro_batch: int, kwargs) -> torch.Tensor:
    groups = [ROWS[i : i + micro_batch] for i in range(0, len(ROWS), micro_batch)]
    return torch.cat([per_token_losses(net, g, kwargs) for g in groups])


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ each implementation


@pytest.mark.parametrize("micro_batch", [1, 4])
@pytest.mark.parametrize("spec_attention", ["sdpa", "eager"])
def test_packed_loss_equals_the_documents_run_one_by_one(
    models, alone, spec_attention, micro_batch
):
    net = get(models, attention.implementation(spec_attention))
    kwargs = lambda b: attention.model_kwargs(b, attention.implementation(spec_attention))  # noqa: E731
    close(packed(net, micro_batch, kwargs), alone)


def test_the_varlen_kernel_path_flattens_and_restores_the_batch(models, alone, monkeypatch):
    """The CUDA path (torch's varlen_attn on [B*S, H, D]) with a stand-in kernel on CPU."""
    seen = []

    def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                    scale=None, window_size=(-1, -1)):  # fmt: skip
        seen.append((tuple(query.shape), max_q))
        assert window_size == (-1, 0)
        return attention.per_document(query, key, value, cu_seq_q, scale)

    monkeypatch.setattr(attention, "_kernel", lambda q: attention.adapt_varlen(varlen_2_11))
    net = get(models, attention.NAME)
    kwargs = lambda b: attention.model_kwargs(b, attention.NAME)  # noqa: E731
    close(packed(net, 4, kwargs), alone)
    width = max(sum(d) for d in DOCS)
    assert seen == [((4 * width, 4, 16), 30)] * 2  # both layers, the whole micro-batch at once


def test_a_plain_modules_bf16_compute_reaches_the_kernel_in_bf16(monkeypatch):
    """One process trains a plain module: fp32 weights under autocast (parallel.plain). Its
    fp32 rotary tables turn q and k back into fp32 after their bf16 projections; attention
    must still compute in bf16, else the flash kernel is missed (an H200 ran per-document
    SDPA, 30x slower). A stand-in kernel that runs where the real one does (half precision)
    records what reaches it."""
    seen = []

    def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                    scale=None, window_size=(-1, -1)):  # fmt: skip
        seen.append({query.dtype, key.dtype, value.dtype})
        return attention.per_document(query, key, value, cu_seq_q, scale)

    monkeypatch.setattr(attention, "_VARLEN", attention.adapt_varlen(varlen_2_11))
    monkeypatch.setattr(attention, "_varlen_runs", lambda device, dtype: dtype == torch.bfloat16)
    spec = parse_spec(
        {
            "model": {"source": str(TINY)},
            "dataset": {"source": "unused.jsonl"},
            "method": {"type": "full"},
            "training": {"maxSteps": 1, "precision": "bf16"},
            "resources": {"gpusPerNode": 0},
        }
    )
    net = parallel.plain(tiny(attention.NAME), spec, torch.device("cpu"))
    losses = per_token_losses(net, ROWS, lambda b: attention.model_kwargs(b, attention.NAME))
    assert seen == [{torch.bfloat16}] * 2  # both layers, in bf16
    assert losses.isfinite().all()
    # The residual stream is bf16 from the embeddings on, as under FSDP's bf16 policy.
    batch = data.collate(ROWS, PAD)
    extra = attention.model_kwargs(batch, attention.NAME)
    with torch.no_grad():
        out = net(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                  output_hidden_states=True, **extra)  # fmt: skip
    assert {h.dtype for h in out.hidden_states[:-1]} == {torch.bfloat16}


def test_without_boundaries_the_position_ids_delimit_documents(models, alone):
    """A caller that passes only position ids (transformers' convention) is still exact."""
    close(packed(get(models, attention.NAME), 4, {}), alone)


def test_trl_padding_free_batches_are_exact(models, alone):
    """bench/trl_worker.py's baseline: TRL's padding-free collator (one flattened row with
    cu_seq_lens) into a model built with ftjob's packed attention."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)
    batch = collator([{k: r[k] for k in ("input_ids", "seq_lengths")} for r in ROWS])
    assert batch["input_ids"].shape[0] == 1 and "cu_seq_lens_q" in batch
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = get(models, attention.NAME)(**batch, use_cache=False).logits
    ours = torch.tensor([t for r in ROWS for t in r["labels"]])[None]
    assert torch.equal(labels != IGNORE, ours != IGNORE)  # the same targets as ftjob's
    target = ours[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), target, ignore_index=IGNORE,
                           reduction="none")  # fmt: skip
    close(loss[target != IGNORE], alone)


# ------------------------------------------------------------------ the control


def test_the_comparison_fails_when_documents_see_each_other(models, alone):
    """Each row as one document (the boundaries ignored): the same comparison must fail."""
    net = get(models, attention.NAME)

    def whole_rows(b):
        rows, width = b.input_ids.shape
        cu = torch.arange(0, rows * width + 1, width, dtype=torch.int32)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": width,
                "max_length_k": width}  # fmt: skip

    leaky = packed(net, 4, whole_rows)
    assert leaky.shape == alone.shape
    with pytest.raises(AssertionError):
        close(leaky, alone)
    assert (leaky - alone).abs().max() > 1e-2


# ------------------------------------------------------------------ transformers' flash path


@pytest.fixture
def flash(monkeypatch):
    """transformers' flash_attention_2 path with stand-in kernels (flash-attn needs CUDA):
    varlen computes per-document attention, the plain kernel causal attention per row."""
    calls = {"varlen": 0, "plain": 0}

    def flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     dropout_p=0.0, softmax_scale=None, causal=False):  # fmt: skip
        calls["varlen"] += 1
        assert causal and max_seqlen_q == max(max(d) for d in DOCS)
        return attention.per_document(q, k, v, cu_seqlens_q, softmax_scale)

    def flash_plain(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        calls["plain"] += 1
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, S, H, D] -> [B, H, S, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                             enable_gqa=True)  # fmt: skip
        return out.transpose(1, 2)

    monkeypatch.setattr(flash_utils, "_loaded_implementation", "flash_attention_2")
    monkeypatch.setattr(flash_utils, "_flash_fn", flash_plain)
    monkeypatch.setattr(flash_utils, "_flash_varlen_fn", flash_varlen)
    process = flash_utils._lazy_define_process_function(flash_varlen)
    monkeypatch.setattr(flash_utils, "_process_flash_kwargs_fn", process)
    net = tiny("sdpa")
    net.config._attn_implementation = "flash_attention_2"  # flash-attn itself is not installed
    return net, calls


def test_flash_attention_2_takes_the_varlen_branch_at_micro_batch_4(flash, alone):
    net, calls = flash
    batch = data.collate(ROWS, PAD)
    kwargs = attention.model_kwargs(batch, "flash_attention_2")
    assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"] is batch.cu_seqlens
    width = max(sum(d) for d in DOCS)
    ends, end = [0], 0
    for lengths in DOCS:
        for n in [*lengths, width - sum(lengths)]:
            if n:
                end += n
                ends.append(end)
    assert batch.cu_seqlens.tolist() == ends
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 30
    close(packed(net, 4, lambda b: attention.model_kwargs(b, "flash_attention_2")), alone)
    assert calls == {"varlen": 2, "plain": 0}


def test_flash_attention_2_without_boundaries_lets_documents_mix(flash, alone):
    """The bug model_kwargs fixes: transformers reads position ids as packed only at B == 1."""
    net, calls = flash
    leaky = packed(net, 4, {})
    assert calls == {"varlen": 0, "plain": 2}
    assert (leaky - alone).abs().max() > 1e-2


# ------------------------------------------------------------------ the default path


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The trainer's own path for a default spec (LoRA), in a world of one: build on meta,
    shard with FSDP2, read the weights."""
    spec = parse_spec(
        {
            "model": {"source": str(TINY)},
            "dataset": {"source": str(tmp_path_factory.mktemp("d") / "unused.jsonl")},
            "training": {"maxSteps": 1},
            "resources": {"gpusPerNode": 0},
            "output": {"mergeAdapter": True},  # the export then writes a config.json
        }
    )
    d = parallel.init(spec)
    try:
        tok = model.load_tokenizer(spec)
        built = model.build(spec, tok)
        net = parallel.shard(built.model, spec, parallel.mesh(spec, d, "full"), "full")
        model.materialize(built, d)
        yield spec, tok, net.eval()
    finally:
        dist.destroy_process_group()


def test_the_default_path_runs_per_document_sdpa_without_a_mask(job, alone, monkeypatch):
    spec, _, net = job
    assert spec.model.attention == "sdpa"  # the spec's default
    assert net.config._attn_implementation == attention.NAME
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((query.shape[-2], attn_mask, kwargs.get("is_causal")))
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    kwargs = lambda b: attention.model_kwargs(b, net.config._attn_implementation)  # noqa: E731
    close(packed(net, 4, kwargs), alone)
    assert calls, "the default path never reached scaled_dot_product_attention"
    assert all(mask is None for _, mask, _ in calls), "a dense mask on the default path"
    assert all(causal is True for _, _, causal in calls)
    # One call per document (padding runs included) per layer: the packed function ran.
    width = max(sum(d) for d in DOCS)
    docs = [n for lengths in DOCS for n in [*lengths, width - sum(lengths)] if n]
    assert [length for length, _, _ in calls] == docs * 2


def test_each_documents_sdpa_runs_a_fused_kernel_forward_and_backward():
    """per_document gives SDPA 4-D inputs, which its fused kernels need (3-D ones take the
    math path): on CPU the flash kernel runs forward and backward, grouped-query heads too."""
    q = torch.randn(40, 4, 8, requires_grad=True)
    k, v = (torch.randn(40, 2, 8, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    with torch.profiler.profile() as prof:
        attention.per_document(q, k, v, cu, None).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= names  # fmt: skip
    assert "aten::_scaled_dot_product_attention_math" not in names


def test_the_export_does_not_name_ftjobs_attention(job, tmp_path):
    spec, tok, net = job
    export.export(net, spec, tok, tmp_path / "model", rank=0)
    out = tmp_path / "model" / "merged"  # the adapter's base merged in: a whole model
    config = json.loads((out / "config.json").read_text())
    assert attention.NAME not in json.dumps(config)
    # A fresh interpreter without ftjob loads it and runs a forward.
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM; "
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}); "
        "m(input_ids=torch.tensor([[5, 6, 7]])); "
        "assert not any(n.startswith('ftjob') for n in sys.modules); "
        "print(m.config._attn_implementation)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"},
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "sdpa"


# ------------------------------------------------------------------ choices and refusals


def test_each_spec_choice_maps_to_an_implementation():
    assert attention.implementation("sdpa") == attention.NAME
    for name in ("eager", "flash_attention_2", "flash_attention_3"):
        assert attention.implementation(name) == name
    with pytest.raises(ValueError, match="model.attention 'flex'"):
        attention.implementation("flex")
    batch = data.collate(ROWS, PAD)
    assert attention.model_kwargs(batch, "eager") == {}


def test_what_packed_attention_cannot_do_is_refused_by_name():
    module = torch.nn.Module()
    q = torch.zeros(1, 4, 6, 16)
    kv = torch.zeros(1, 2, 6, 16)
    with pytest.raises(ValueError, match="attention dropout 0.1 .* attention_dropout to 0.0"):
        attention.packed_attention(module, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="KV cache"):
        attention.packed_attention(module, q[:, :, :1], kv, kv, None)
    with pytest.raises(ValueError, match="takes no attention mask"):
        attention.packed_attention(module, q, kv, kv, torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding window"):
        attention.packed_attention(module, q, kv, kv, None, sliding_window=4)


# ------------------------------------------------------------------ varlen_attn's versions


def reference(q, k, v, cu, causal: bool, scale):
    """Per-document attention on [T, H, D], causal or not (what a varlen kernel computes)."""
    bounds, outs = cu.tolist(), []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        doc = (t[a:b].transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(*doc, is_causal=causal, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def varlen_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
               return_aux=None):  # fmt: skip
    assert key.shape[1] == query.shape[1], "2.9 has no GQA: K/V heads must be repeated"
    return reference(query, key, value, cu_seq_q, is_causal, None)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):  # fmt: skip
    assert key.shape[1] == query.shape[1], "2.11 has no GQA: K/V heads must be repeated"
    assert window_size in ((-1, -1), (-1, 0))
    return reference(query, key, value, cu_seq_q, window_size == (-1, 0), scale)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):  # fmt: skip
    assert enable_gqa and key.shape[1] == 2, "2.12+ takes the K/V heads as they are"
    out = reference(query, key, value, cu_seq_q, window_size == (-1, 0), scale)
    return (out, None) if return_aux else out


@pytest.mark.parametrize("fn", [varlen_2_9, varlen_2_11, varlen_2_13])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_varlen_is_called_causally_on_every_torch_signature(fn, scale):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(40, 4, 16, generator=g)
    k, v = torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g)
    cu = torch.tensor([0, 7, 8, 30, 40], dtype=torch.int32)
    got = attention.adapt_varlen(fn)(q, k, v, cu, 22, scale)
    torch.testing.assert_close(got, attention.per_document(q, k, v, cu, scale))
    # And not what a non-causal call would give: the check can fail.
    assert (got - reference(q, k, v, cu, False, scale)).abs().max() > 1e-3


def test_a_varlen_without_a_causal_option_is_refused():
    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="no causal option"):
        attention.adapt_varlen(varlen)


def test_the_installed_torchs_varlen_signature_binds_the_adapted_call():
    """The kwargs the adapter picks for this torch's varlen_attn are ones it accepts."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    signature, bound = inspect.signature(varlen_attn), []

    def varlen(*args, **kwargs):
        bound.append(signature.bind(*args, **kwargs).arguments)
        return reference(args[0], args[1], args[2], args[3], True, kwargs.get("scale"))

    varlen.__signature__ = signature
    q, kv = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    attention.adapt_varlen(varlen)(q, kv, kv, cu, 6, 0.25)
    (arguments,) = bound
    assert arguments.get("window_size") == (-1, 0) or arguments.get("is_causal") is True


def test_the_trainer_names_the_kernel_its_attention_runs():
    """A GPU run's figures say which attention they come from: torch's varlen flash kernel on
    CUDA in half precision, per-document SDPA elsewhere, transformers' own otherwise."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    name = attention.kernel_name
    assert (
        name(attention.NAME, cuda, torch.bfloat16) == f"{attention.NAME}: torch varlen_attn (flash)"
    )
    assert name(attention.NAME, cuda, torch.float32).endswith(
        "scaled_dot_product_attention per document"
    )
    assert name(attention.NAME, cpu, torch.bfloat16).endswith("per document")
    assert name("flash_attention_2", cuda, torch.bfloat16) == "transformers' flash_attention_2"


# ------------------------------------------------------------------ under torch.compile


def test_a_compiled_layer_is_not_compiled_again_for_each_batch_of_documents(models):
    """training.compile compiles each decoder layer: every micro-batch packs documents of other
    lengths, and a trace of the per-document loop was specialised to them, so every step
    compiled the layer again. Dynamo's own tracing (the eager backend: no inductor) counts
    the compilations: the second layout may make the length dynamic; no later one compiles."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    layer = get(models, attention.implementation("sdpa")).model.layers[0]
    forward = torch.compile(layer.forward, backend=counter)
    net = get(models, attention.implementation("sdpa"))
    compiled_after = []
    for row in ROWS:  # four rows: four document layouts of their own
        batch = data.collate([row], PAD)
        hidden = net.model.embed_tokens(batch.input_ids)
        rope = net.model.rotary_emb(hidden, batch.position_ids)
        with torch.no_grad():
            forward(hidden, position_embeddings=rope, position_ids=batch.position_ids,
                    **attention.model_kwargs(batch, net.config._attn_implementation))  # fmt: skip
        compiled_after.append(counter.frame_count)
    torch._dynamo.reset()
    assert compiled_after[0] > 0
    assert compiled_after[-1] == compiled_after[1], compiled_after
