"""Packed attention: each packed document attends only to itself, at any micro-batch size.

A micro-batch (trainer/data/batches.py) is B rows of S tokens, each row several documents packed
back to back, then padding (a document of its own). Attention must stay inside documents.
transformers does not do that well by itself (transformers 5.23, read and checked on CPU):
``sdpa`` builds a dense [B, 1, S, S] boolean mask from the position ids, which on CUDA rules
out SDPA's flash kernel and its grouped-query path; ``flash_attention_2`` treats position ids
as packed only when B == 1 and otherwise lets documents of a row see each other.

So ``model.attention: sdpa`` (the default) builds the model with :data:`NAME`, registered
here with transformers' ``AttentionInterface``. It flattens the micro-batch to B*S tokens and
runs one varlen attention over the documents' boundaries (``Batch.cu_seqlens``):

* on CUDA in bf16/fp16: torch's flash kernel, ``torch.nn.attention.varlen.varlen_attn``
  (GQA without copying K/V where the torch version supports it);
* elsewhere (CPU; fp32 on CUDA): one ``F.scaled_dot_product_attention(is_causal=True)`` per
  document over the same flattened tensors and boundaries: exact, and no S x S mask.

:data:`NAME` is not one of transformers' mask functions, so transformers builds no mask at
all for it (nor reads the position ids on the host). It lives only in the training process:
a saved config never names it (``_attn_implementation`` is not serialised), and the export
loads with plain transformers.

``flash_attention_2``/``flash_attention_3`` stay transformers' own; :func:`model_kwargs`
hands them the same boundaries (``cu_seq_lens_q/k``, ``max_length_q/k``), which makes
transformers take its varlen branch at every batch size. ``eager`` is transformers'
reference: a dense block-diagonal mask from the position ids, slow; for checking only.

    python -c "from ftjob.trainer.model import attention; help(attention)"
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ftjob.trainer.model import context

NAME = "ftjob_packed"  # the attn_implementation the default (sdpa) builds with
SPEC_CHOICES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")

# (q [T, Hq, D], k [T, Hkv, D], v, cu_seqlens int32 [N+1], max_seqlen, scale) -> [T, Hq, D]
Varlen = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


def implementation(spec_attention: str) -> str:
    """The transformers ``attn_implementation`` to build a model with for spec.model.attention."""
    if spec_attention == "sdpa":
        register()
        return NAME
    if spec_attention in SPEC_CHOICES:
        return spec_attention
    raise ValueError(f"model.attention {spec_attention!r}: use one of {', '.join(SPEC_CHOICES)}")


def model_kwargs(batch, implementation: str) -> dict:
    """Extra forward kwargs for a ``data.Batch`` (already on the device) on a model built with
    ``implementation`` (:func:`implementation`'s answer; ``net.config._attn_implementation``):
    the documents' boundaries over the flattened micro-batch, for :data:`NAME` and
    transformers' flash path. Eager needs none (its mask comes from the position ids)."""
    if implementation == "eager":
        return {}
    if batch.lengths:
        _lengths[batch.cu_seqlens] = (batch.lengths, batch.stems)
    return {
        "cu_seq_lens_q": batch.cu_seqlens,
        "cu_seq_lens_k": batch.cu_seqlens,
        "max_length_q": batch.max_seqlen,
        "max_length_k": batch.max_seqlen,
    }


# Each batch's documents' lengths and shared prefixes as host ints (data.Batch.lengths and
# .stems), by its cu_seqlens tensor: what :func:`per_document` splits by, without reading the
# device (transformers passes only tensors through the model to the attention). Entries go
# with their tensors.
_lengths: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register() -> None:
    """Make :data:`NAME` known to transformers (idempotent; :func:`implementation` does)."""
    from transformers import AttentionInterface  # with the model classes: when they are built

    _prepare()
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_attention)


def _prepare() -> None:
    """What a forward calls, settled at the model's build: not at this module's import (the
    trainer's start; torch._dynamo, and the varlen kernel's FSDP, are seconds of it), and not
    inside a forward that torch.compile may trace. The eager :func:`per_document`, and torch's
    varlen kernel where a GPU could run it (:func:`_varlen` settles it elsewhere)."""
    global _eager_per_document
    if _eager_per_document is None:
        # transformers' model loading imports torch._dynamo anyway: this costs nothing more.
        _eager_per_document = torch.compiler.disable(per_document)
    if torch.cuda.is_available():
        _varlen()


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: q/k/v [B, H, S, D] -> ([B, S, H, D], None).

    Boundaries come from ``cu_seq_lens_q`` (ftjob's and TRL's padding-free batches), else from
    ``position_ids`` restarting at 0, else each row is one document. Inside a context-parallel
    group (:func:`context.parallel`), q/k/v hold this rank's slice of the sequence: all-to-alls
    give it all of the sequence for its share of the heads, and give the output back.
    """
    cp = context.active()
    if cp is not None:
        if cu_seq_lens_q is None:
            raise ValueError(f"{NAME}: context parallel needs the whole sequence's cu_seq_lens_q")
        query, key, value = context.heads_to_sequence(cp, query, key, value)
    b, heads, s, _ = query.shape
    _refuse_unsupported(module, query, key, attention_mask, dropout, is_causal, softcap, s_aux)
    if cu_seq_lens_k is not None and cu_seq_lens_k.shape != getattr(cu_seq_lens_q, "shape", None):
        # Self-attention without a cache: keys share the queries' boundaries. (Shapes only:
        # comparing values would wait for the device.)
        raise ValueError(f"{NAME}: cu_seq_lens_k must equal cu_seq_lens_q (self-attention)")
    if cu_seq_lens_q is not None:
        cu = cu_seq_lens_q
        longest = int(max_length_q) if max_length_q is not None else _longest(cu)
    else:
        cu, longest = _boundaries(position_ids, b, s, query.device)
    if sliding_window is not None and longest > sliding_window:
        raise ValueError(
            f"{NAME}: the model's sliding window ({sliding_window} tokens) is shorter than a "
            f"packed document ({longest}); use model.attention: flash_attention_2 (GPUs) or "
            "eager, or a dataset.maxSeqLength within the window"
        )
    # [B, H, S, D] -> [B*S, H, D]: one row of tokens, documents delimited by cu; in the
    # autocast dtype where autocast is on, as SDPA computes under it. A plain module's bf16
    # compute is autocast over fp32 weights, whose fp32 rotary tables turn q and k back into
    # fp32: they would miss the flash kernel and take per-document SDPA, 30x slower (an H200,
    # bench/RESULTS.md).
    dtype = compute_dtype(query)
    q, k, v = (
        t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3]).to(dtype)
        for t in (query, key, value)
    )
    kernel = _kernel(q)
    if kernel is not None and not _branched(cu):
        out = kernel(q, k, v, cu, longest, scaling)
    else:
        out = (_eager_per_document or per_document)(q, k, v, cu, scaling)
    out = out.view(b, s, heads, out.shape[-1])
    return (out if cp is None else context.sequence_to_heads(cp, out)), None


def _refuse_unsupported(module, query, key, attention_mask, dropout, is_causal, softcap, s_aux):
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(f"{NAME}: only causal (decoder) attention; use model.attention: eager")
    if query.shape[2] != key.shape[2]:
        # A KV cache (generation): training and evaluation run without one (use_cache=False).
        raise ValueError(
            f"{NAME}: queries ({query.shape[2]}) and keys ({key.shape[2]}) differ in length: "
            "a KV cache is in use; run with use_cache=False, or load the model with "
            "attn_implementation='sdpa' to generate"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{NAME}: takes no attention mask (documents are delimited by cu_seq_lens or "
            "position ids); pass none"
        )
    if dropout:
        raise ValueError(
            f"{NAME}: attention dropout {dropout} is not supported (flash varlen has none); "
            "set attention_dropout to 0.0 in the model's config.json, or use "
            "model.attention: eager"
        )
    if softcap is not None or s_aux is not None:
        raise ValueError(
            f"{NAME}: this model's attention has logit soft-capping or attention sinks; "
            "use model.attention: eager or flash_attention_2"
        )


# Eager under torch.compile (training.compile): the document lengths are read on the host,
# and a traced loop over them would be specialised to each batch's lengths, so every step
# compiled its layers again (a layer compiled once per new layout until dynamo's limit of 8;
# measured on CPU, tiny model). SDPA per document has nothing for inductor to fuse; the layer
# around it stays compiled, once. packed_attention calls this wrapped in
# torch.compiler.disable (:func:`_prepare`, at the model's build).
_eager_per_document: Callable | None = None


def per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Exact causal attention inside each document: one SDPA call per document, no mask;
    a branch (data.Batch.stems) also attends to its stem's shared prefix, through a mask.

    q [T, Hq, D], k/v [T, Hkv, D]; ``cu`` [N+1] with cu[-1] == T. The lengths come from the
    host (ftjob's batches, :func:`model_kwargs`), else from reading ``cu`` (a device wait).
    """
    lengths, stems = _documents(cu)
    if sum(lengths) != q.shape[0]:
        raise ValueError(
            f"{NAME}: cu_seqlens cover {sum(lengths)} tokens; the batch has "
            f"{q.shape[0]} tokens (B x S)"
        )
    gqa = k.shape[1] != q.shape[1]
    outs = []
    prefix = None  # the last plain document's keys and values: what a branch reads first
    # split, not a slice per document: split's backward is one cat, where each slice's would
    # write its gradient into a zeroed copy of the whole tensor (measured: 2x the time).
    docs = zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
    for (dq, dk, dv), stem in zip(docs, stems or [0] * len(lengths), strict=True):
        if not dq.shape[0]:
            continue
        mask = None
        if stem:
            dk, dv = torch.cat([prefix[0][:stem], dk]), torch.cat([prefix[1][:stem], dv])
            # Every prefix key, then causal over the branch: the lower-right triangle.
            mask = torch.ones(dq.shape[0], dk.shape[0], dtype=torch.bool, device=dq.device)
            mask = mask.tril(stem)
        else:
            prefix = (dk, dv)
        # [L, H, D] -> [1, H, L, D]: SDPA's (batch, heads, length, dim) layout. Its fused
        # kernels take only 4-D inputs: 3-D ones fall back to the math path (on CPU, the flash
        # kernel's forward and backward are ~25% faster than it over a packed 512-token row).
        out = F.scaled_dot_product_attention(
            *(t.transpose(0, 1).unsqueeze(0) for t in (dq, dk, dv)), attn_mask=mask,
            is_causal=mask is None, scale=scale, enable_gqa=gqa,
        )  # fmt: skip
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs)


def _documents(cu: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The documents' lengths and stems for ``cu``: the batch's host ints, else read from
    ``cu`` itself (no branches)."""
    known = _lengths.get(cu)
    if known is not None:
        return known
    bounds = cu.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{NAME}: cu_seqlens start at {bounds[0]}, not 0")
    return tuple(end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)), ()


def _branched(cu: torch.Tensor) -> bool:
    """Whether the batch of ``cu`` has branches: the flash kernel has no shared prefix, so
    those run per document (SDPA with a mask on GPUs too)."""
    known = _lengths.get(cu)
    return known is not None and bool(known[1])


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's on the query's device where it is on."""
    kind = query.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else query.dtype


def _kernel(query: torch.Tensor) -> Varlen | None:
    """torch's varlen flash kernel where it runs (CUDA, half precision), else None."""
    return _varlen() if _varlen_runs(query.device, query.dtype) else None


def _varlen_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def kernel_name(attn_implementation: str, device: torch.device, dtype: torch.dtype) -> str:
    """What computes attention for a model built with ``attn_implementation`` on ``device`` in
    ``dtype`` (the trainer logs it: a GPU run says which kernel its figures come from)."""
    if attn_implementation != NAME:
        return f"transformers' {attn_implementation}"
    if _varlen_runs(device, dtype) and _varlen() is not None:
        return f"{NAME}: torch varlen_attn (flash)"
    return f"{NAME}: scaled_dot_product_attention per document"


def adapt_varlen(fn: Callable) -> Varlen:
    """Call torch's ``varlen_attn`` causally whatever its version's signature:

    * 2.9: ``(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)``
    * 2.10/2.11: ``(..., *, return_aux=None, scale=None, window_size=(-1, -1))``; causal is
      ``window_size=(-1, 0)``
    * 2.12+: also ``enable_gqa``.

    Without ``enable_gqa`` the K/V heads are repeated to the query heads (as transformers'
    ``repeat_kv``: query head h reads K/V head h // groups); without ``scale`` a non-default
    scale is folded into the queries.
    """
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        raise TypeError(f"varlen_attn{inspect.signature(fn)}: no causal option (is_causal or "
                        "window_size); this torch version is not supported")  # fmt: skip
    has_gqa, has_scale = "enable_gqa" in params, "scale" in params

    def call(q, k, v, cu, max_seqlen, scale):
        extra = dict(causal)
        if k.shape[1] != q.shape[1]:
            if has_gqa:
                extra["enable_gqa"] = True
            else:
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if scale is not None:
            if has_scale:
                extra["scale"] = scale
            elif not math.isclose(scale, q.shape[-1] ** -0.5):
                q = q * (scale * math.sqrt(q.shape[-1]))  # the kernel scales by 1/sqrt(D)
        out = fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **extra)
        return out[0] if isinstance(out, tuple) else out

    return call


def _longest(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max())  # a device wait on CUDA: pass max_length_q instead


# The boundaries derived from position ids, for the last position_ids seen: transformers
# passes the same tensor to every layer, so a forward derives (and waits for) them once.
_derived: tuple[torch.Tensor, torch.Tensor, int] | None = None


def _boundaries(
    position_ids: torch.Tensor | None, b: int, s: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """cu_seqlens over the flattened batch from position ids: a document starts at every row
    start and wherever the position does not follow the previous one (a restart)."""
    global _derived
    if position_ids is None:  # each row one document, on the device the kernel reads it from
        return torch.arange(0, b * s + 1, s, dtype=torch.int32, device=device), s
    if _derived is not None and _derived[0] is position_ids:
        return _derived[1], _derived[2]
    pos = position_ids.expand(b, s)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    index = starts.reshape(-1).nonzero().flatten()
    end = torch.tensor([b * s], device=index.device, dtype=index.dtype)
    cu = torch.cat([index, end]).to(torch.int32)
    longest = _longest(cu)
    _derived = (position_ids, cu, longest)
    return cu, longest


def _torch_varlen() -> Varlen | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9: no varlen kernel; per-document SDPA is still exact
        return None
    return adapt_varlen(varlen_attn)


_UNSETTLED = object()
# torch's varlen kernel, adapted, or None: settled once, by the model's build where a GPU is
# visible (:func:`_prepare`), not inside a forward that torch.compile may trace. Its module
# imports FSDP and torch._dynamo: never at this module's import.
_VARLEN: Varlen | None | object = _UNSETTLED


def _varlen() -> Varlen | None:
    global _VARLEN
    if _VARLEN is _UNSETTLED:
        _VARLEN = _torch_varlen()
    return _VARLEN  # type: ignore[return-value]
