"""Normalized records -> token ids and labels, a batch at a time (run by ``datasets.map``).

Every document's first label is masked: alone it is never a target (the loss predicts token
k from tokens before it), and packed after another document it must not be predicted from
that document's last token. One rule, the same for single, packed and wrapped sequences.
"""

from __future__ import annotations

import re
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from ftjob.api.jobspec.data import DatasetSpec
from ftjob.trainer.data.records import DataError

if TYPE_CHECKING:  # imported by the phase that uses it: see ftjob/trainer/report/startup.py
    import pyarrow as pa
    from transformers import PreTrainedTokenizerBase

# pyarrow only where a function builds Arrow (the data phase): the loss and the objectives
# import IGNORE from here at the trainer's start.

IGNORE = -100  # label of tokens that are context only (prompts, user turns, padding)

# The block tag itself, with Jinja's whitespace-trim variants; a bare substring "generation"
# would also match add_generation_prompt, which every chat template has.
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and _GENERATION.search(template) is not None


def chat_template(tok: PreTrainedTokenizerBase, ds: DatasetSpec) -> str | None:
    """The template chat records render with; one with generation markers when masking.

    A model's own template rarely marks assistant turns; TRL ships marked training variants
    of the templates of known families (Llama 3, Qwen, Gemma, ...) and we use those.
    """
    if ds.format != "chat":
        return None
    template = tok.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise DataError(
            f"{ds.source}: format chat needs a chat template, and the model's tokenizer has "
            "none; use a model with a chat template, or format text or instruction"
        )
    if not ds.completion_only_loss or has_generation_markers(template):
        return template
    from trl.chat_template_utils import get_training_chat_template

    try:
        return get_training_chat_template(tok) or template
    except ValueError as e:
        raise DataError(
            f"{ds.source}: the model's chat template has no {{% generation %}} markers, so "
            "assistant turns cannot be told apart, and TRL has no training template for this "
            "family; add the markers to the tokenizer's chat_template (see TRL's "
            "chat_templates/*_training.jinja), or set dataset.completionOnlyLoss: false"
        ) from e


def batch(
    rows: pa.Table,
    *,
    tok: PreTrainedTokenizerBase,
    ds: DatasetSpec,
    name: str,
    template: str | None,
    limit: int | None = None,
) -> pa.Table:
    """``datasets.map(batched=True)`` over Arrow: a table of records -> input_ids and labels.

    Documents with no token to learn within their first ``limit`` tokens (all of them when
    None) are dropped here, once, rather than as whole sequences after packing.

    The columns are built as flat numpy arrays, not lists of Python lists: converting 24M
    Python ints to an int32 Arrow column (and copying them again for the labels) cost as much
    as the tokenizer itself.
    """
    import pyarrow as pa

    eos = tok.eos_token_id
    if ds.format == "chat":
        pairs = [
            _chat(messages, tok, ds, template, _where(name, line))
            for line, messages in zip(
                rows.column("line").to_pylist(), rows.column("messages").to_pylist(), strict=True
            )
        ]
        ids, offsets = _flat([i for i, _ in pairs])
        labels, _ = _flat([lab for _, lab in pairs])
    elif ds.format == "text":
        ids, offsets = _flat(_encode(tok, rows.column("text").to_pylist()), end=eos)
        labels = ids.copy()
    else:
        prompts = _encode(tok, rows.column("prompt").to_pylist())
        completions = _encode(tok, rows.column("completion").to_pylist(), special=False)
        ids, offsets = _flat([p + c for p, c in zip(prompts, completions, strict=True)], end=eos)
        labels = ids.copy()
        if ds.completion_only_loss:
            prompt = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
            labels[_within(offsets, prompt)] = IGNORE
    # Mask every document's first token; empty documents have none.
    starts = offsets[:-1][offsets[1:] > offsets[:-1]]
    labels[starts] = IGNORE
    lists = pa.list_(pa.int32())
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, ids, type=lists),
            "labels": pa.ListArray.from_arrays(offsets, labels, type=lists),
        }
    )
    return table.filter(learnable(table, limit))


def learnable(table: pa.Table, limit: int | None = None) -> pa.Array:
    """Which rows have a label to learn within their first ``limit`` tokens (any, if None)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    labels = table.column("labels").combine_chunks()
    if limit is not None:
        labels = pc.list_slice(labels, 0, limit)
    values, rows = pc.list_flatten(labels), pc.list_parent_indices(labels)
    learned = pc.not_equal(values, IGNORE).to_numpy(zero_copy_only=False)
    return pa.array(np.bincount(rows.to_numpy()[learned], minlength=len(table)) > 0)


def _encode(tok, texts: list[str], special: bool = True) -> list[list[int]]:
    return tok(texts, add_special_tokens=special, return_attention_mask=False)["input_ids"]


def _flat(lists: list[list[int]], end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lists -> (values, offsets) as int32 arrays, with ``end`` appended to each."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    values = np.fromiter(chain.from_iterable(lists), dtype=np.int32, count=int(lengths.sum()))
    if end is not None:
        values = np.insert(values, np.cumsum(lengths), end)
        lengths += 1
    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return values, offsets


def _within(offsets: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """A mask of the first ``heads[i]`` values of each document i."""
    lengths = np.diff(offsets)
    doc = np.repeat(np.arange(len(lengths)), lengths)
    return np.arange(int(offsets[-1])) - offsets[doc] < heads[doc]


def _chat(messages, tok, ds, template, where) -> tuple[list[int], list[int]]:
    try:
        enc = tok.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=ds.completion_only_loss,
        )
    except Exception as e:  # noqa: BLE001 - jinja raises anything; name the record instead
        raise DataError(f"{where}: the chat template refused it: {e}") from e
    ids = list(enc["input_ids"])
    if not ds.completion_only_loss:
        return ids, list(ids)
    mask = enc["assistant_masks"]
    return ids, [t if m else IGNORE for t, m in zip(ids, mask, strict=True)]


def _where(name: str, line: int) -> str:
    kind = "line" if name.endswith((".jsonl", ".json")) else "record"
    return f"{name} {kind} {line}"
