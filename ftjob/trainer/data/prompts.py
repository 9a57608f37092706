"""Prompts records (objective grpo) -> tokenized prompts, each with its record for the rewards.

A prompt is stored as its token ids, the chat template's generation prompt included for
conversations (TRL renders them so), and the record as the source had it (JSON), whose fields
the rewards read. A prompt longer than dataset.maxSeqLength minus the completion's room
(training.grpo.maxCompletionLength) keeps its last tokens: its end is what the completion
follows (TRL cuts prompts on the left too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftjob.trainer.data.pairs import _where
from ftjob.trainer.data.records import DataError

if TYPE_CHECKING:  # imported by the phase that uses it: see ftjob/trainer/report/startup.py
    import pyarrow as pa  # by batch() alone, as pairs.py and tokenize.py do
    from transformers import PreTrainedTokenizerBase

COLUMNS = ("line", "prompt_ids", "record")


def room(max_seq_length: int, max_completion_length: int) -> int:
    """The tokens a prompt may keep."""
    return max_seq_length - max_completion_length


def batch(
    rows: pa.Table,
    *,
    tok: PreTrainedTokenizerBase,
    name: str,
    template: str | None,
    limit: int,
) -> pa.Table:
    """``datasets.map(batched=True)`` over normalized prompts records -> their token ids, each
    cut to its last ``limit`` tokens, with the count cut."""
    import pyarrow as pa

    table = rows.to_pydict()
    out: dict[str, list] = {"line": [], "prompt_ids": [], "record": [], "cut_prompt": []}
    for i, line in enumerate(table["line"]):
        where = _where(name, line)
        if table["prompt"][i] is not None:
            ids = tok(table["prompt"][i], return_attention_mask=False)["input_ids"]
        else:
            ids = _render(tok, template, table["prompt_messages"][i], where)
        out["line"].append(line)
        out["prompt_ids"].append(ids[-limit:])
        out["record"].append(table["record"][i])
        out["cut_prompt"].append(max(len(ids) - limit, 0))
    types = {"line": pa.int64(), "prompt_ids": pa.list_(pa.int32()), "record": pa.string(),
             "cut_prompt": pa.int32()}  # fmt: skip
    return pa.table({k: pa.array(v, type=types[k]) for k, v in out.items()})


def _render(tok, template: str | None, messages: list[dict], where: str) -> list[int]:
    if template is None:
        raise DataError(
            f"{where}: a conversational prompt needs a chat template, and the model's "
            "tokenizer has none; use a model with a chat template, or plain-text prompts"
        )
    try:
        enc = tok.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True,
            add_generation_prompt=True,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - jinja raises anything; name the record instead
        raise DataError(f"{where}: the chat template refused it: {e}") from e
    return list(enc["input_ids"])
