"""Normalized records -> token ids and labels, a batch at a time (run by ``datasets.map``).

Every document's first label is masked: alone it is never a target (the loss predicts token
k from tokens before it), and packed after another document it must not be predicted from
that document's last token. One rule, the same for single, packed and wrapped sequences.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

from ftjob.spec import DatasetSpec
from ftjob.trainer.records import DataError

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
    rows: dict[str, list],
    *,
    tok: PreTrainedTokenizerBase,
    ds: DatasetSpec,
    name: str,
    template: str | None,
) -> dict[str, list]:
    """``datasets.map(batched=True)`` function: columns of records -> columns of tokens."""
    if ds.format == "text":
        eos = [tok.eos_token_id]
        ids = [x + eos for x in tok(rows["text"], return_attention_mask=False)["input_ids"]]
        labels = [list(x) for x in ids]
    elif ds.format == "chat":
        ids, labels = [], []
        for line, messages in zip(rows["line"], rows["messages"], strict=True):
            i, lab = _chat(messages, tok, ds, template, _where(name, line))
            ids.append(i)
            labels.append(lab)
    else:
        eos = [tok.eos_token_id]
        prompts = tok(rows["prompt"], return_attention_mask=False)["input_ids"]
        completions = tok(
            rows["completion"], add_special_tokens=False, return_attention_mask=False
        )["input_ids"]
        ids = [p + c + eos for p, c in zip(prompts, completions, strict=True)]
        if ds.completion_only_loss:
            labels = [
                [IGNORE] * len(p) + c + eos for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            labels = [list(x) for x in ids]
    for lab in labels:
        lab[0] = IGNORE
    return {"input_ids": ids, "labels": labels}


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
