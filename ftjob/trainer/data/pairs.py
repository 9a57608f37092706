"""Preference records -> tokenized pairs, truncated to keep the responses, and their batches.

A pair is stored as three token lists: the prompt, the chosen and the rejected response.
Training runs both sequences of a pair, prompt + chosen and prompt + rejected, in one
forward, and a pair never spans micro-batches or ranks: with the trainer's packed attention
the two share one row and the prompt runs once (:func:`rows`), otherwise they are two rows
(TRL's layout). The labels are the response tokens; the prompt is context only.

Tokenized as TRL's DPO trainer does: the prompt alone (with the chat template's generation
prompt for conversations) and the whole prompt + response; the response starts where the two
token lists diverge, since a template or a token merge at the boundary can change the
prompt's last tokens. Text responses end with the tokenizer's end-of-sequence token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ftjob.api.jobspec.data import DatasetSpec
from ftjob.trainer.data.branches import branched
from ftjob.trainer.data.records import DataError

if TYPE_CHECKING:  # imported by the phase that uses it: see ftjob/trainer/report/startup.py
    import pyarrow as pa  # by batch() alone: DPO's objective imports this module at start
    from transformers import PreTrainedTokenizerBase

COLUMNS = ("line", "prompt_ids", "chosen_ids", "rejected_ids")


def template(tok: PreTrainedTokenizerBase) -> str | None:
    """The chat template conversational pairs render with (None if the tokenizer has none)."""
    found = tok.chat_template
    if isinstance(found, dict):
        found = found.get("default")
    return found or None


def batch(
    rows: pa.Table,
    *,
    tok: PreTrainedTokenizerBase,
    ds: DatasetSpec,
    name: str,
    template: str | None,
    limit: int,
) -> pa.Table:
    """``datasets.map(batched=True)`` over normalized preference records -> tokenized pairs,
    each fitted into ``limit`` tokens per sequence (:func:`fit`), with what the fit cut."""
    import pyarrow as pa

    out: dict[str, list] = {c: [] for c in COLUMNS}
    out.update(cut_prompt=[], cut_response=[])
    table = rows.to_pydict()
    for i, line in enumerate(table["line"]):
        where = _where(name, line)
        if table["chosen"][i] is not None:
            prompt, chosen, rejected = _text(tok, *(table[p][i] for p in PARTS))
        else:
            parts = (table[f"{p}_messages"][i] for p in PARTS)
            prompt, chosen, rejected = _chat(tok, template, *parts, where=where)
        if chosen == rejected:
            raise DataError(
                f"{where}: chosen and rejected are the same tokens: a pair needs two different "
                "responses",
                fix="remove the record, or fix its rejected response, in spec.dataset.source",
            )
        if not chosen or not rejected:
            raise DataError(
                f"{where}: a response has no tokens after the prompt",
                fix="remove the record, or give it both responses, in spec.dataset.source",
            )
        fitted, cut_prompt, cut_response = fit(prompt, chosen, rejected, limit)
        if fitted[1] == fitted[2]:
            # Responses that differ only past the cut: nothing is left to prefer.
            raise DataError(
                f"{where}: chosen and rejected are the same tokens once cut to "
                f"dataset.maxSeqLength {limit}: they differ only after token {len(fitted[1])} "
                "of the response",
                fix="raise spec.dataset.maxSeqLength, or remove the record from "
                "spec.dataset.source",
            )
        for column, ids in zip(COLUMNS[1:], fitted, strict=True):
            out[column].append(ids)
        out["line"].append(line)
        out["cut_prompt"].append(cut_prompt)
        out["cut_response"].append(cut_response)
    ids = pa.list_(pa.int32())
    types = {"line": pa.int64(), "cut_prompt": pa.int32(), "cut_response": pa.int32()}
    return pa.table({k: pa.array(v, type=types.get(k, ids)) for k, v in out.items()})


PARTS = ("prompt", "chosen", "rejected")


def fit(
    prompt: list[int], chosen: list[int], rejected: list[int], limit: int
) -> tuple[tuple[list[int], list[int], list[int]], int, int]:
    """The pair cut to at most ``limit`` tokens per sequence, the responses kept first.

    The prompt loses its start (its end is what the response follows); a response is cut
    only when it alone is too long, and then keeps its start and one prompt token to be
    predicted from. Returns the pieces and the prompt and response tokens cut (the longer
    response's count).
    """
    longest = max(len(chosen), len(rejected))
    keep = max(min(len(prompt), limit - longest), min(len(prompt), 1))
    room = limit - keep
    cut_response = max(longest - room, 0)
    pieces = (prompt[len(prompt) - keep :], chosen[:room], rejected[:room])
    return pieces, len(prompt) - keep, cut_response


def _text(tok, prompt: str, chosen: str, rejected: str):
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    enc = tok([prompt, prompt + chosen, prompt + rejected], return_attention_mask=False)
    p, pc, pr = enc["input_ids"]
    return _split(p, pc + eos, pr + eos)


def _chat(tok, template, prompt, chosen, rejected, where):
    if template is None:
        raise DataError(
            f"{where}: conversational pairs need a chat template, and the model's tokenizer "
            "has none; use a model with a chat template, or plain-text pairs"
        )

    def render(messages, generation_prompt=False):
        try:
            enc = tok.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=True,
                return_dict=True,
                add_generation_prompt=generation_prompt,
            )
        except Exception as e:  # noqa: BLE001 - jinja raises anything; name the record instead
            raise DataError(f"{where}: the chat template refused it: {e}") from e
        return list(enc["input_ids"])

    return _split(render(prompt, True), render(prompt + chosen), render(prompt + rejected))


def _split(p: list[int], pc: list[int], pr: list[int]):
    """(prompt, chosen, rejected) ids: the responses start where either whole sequence first
    differs from the prompt alone."""
    n = min(_common(p, pc), _common(p, pr))
    return p[:n], pc[n:], pr[n:]


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def _where(name: str, line: int) -> str:
    kind = "line" if name.endswith((".jsonl", ".json")) else "record"
    return f"{name} {kind} {line}"


# ------------------------------------------------------------------------------ batches


def rows(pairs: list[dict], shared: bool) -> list[dict]:
    """Prepared pairs -> rows for :func:`ftjob.trainer.data.batches.collate` whose labels are
    the responses; sequence i is pair i's chosen response, B + i its rejected one.

    Unshared: 2B rows, prompt + chosen then prompt + rejected (TRL's layout). ``shared`` (the
    trainer's packed attention): one row a pair, the rejected response a branch that reads
    the prompt's keys and values instead of running the prompt again (branches.branched).
    """
    b = len(pairs)
    parts = [(list(p["prompt_ids"]), list(p["chosen_ids"]), list(p["rejected_ids"])) for p in pairs]
    if shared and all(prompt for prompt, _, _ in parts):  # an empty one has no token to branch at
        return [branched(p, [c, r], [i, b + i]) for i, (p, c, r) in enumerate(parts)]
    chosen = [branched(p, [c], [i]) for i, (p, c, _) in enumerate(parts)]
    return chosen + [branched(p, [r], [b + i]) for i, (p, _, r) in enumerate(parts)]
