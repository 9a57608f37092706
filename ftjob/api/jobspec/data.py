"""dataset: what a job trains on, and how its records become tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ftjob.api.jobspec.fields import SOURCE_HINT, SOURCE_PATTERN
from ftjob.api.schema import api_field


@dataclass(kw_only=True)
class DatasetSpec:
    """dataset: what to train on and how records become tokens."""

    source: str = api_field(
        "source of the data: hf://org/name, or a .jsonl/.json/.parquet/.csv file or a "
        "datasets folder saved with save_to_disk. Relative paths as for model.source.",
        pattern=SOURCE_PATTERN,
        pattern_hint=SOURCE_HINT,
        max_length=512,
    )
    split: str = api_field("split of the source to train on.", "train", min_length=1, max_length=64)
    subset: str | None = api_field(
        "subset (configuration name) of an hf:// dataset.", None, min_length=1, max_length=128
    )
    revision: str | None = api_field(
        "revision (branch, tag or commit) of an hf:// dataset; the job pins the commit it "
        "names when it first starts.",
        None,
        min_length=1,
        max_length=128,
    )
    format: Literal["text", "chat", "instruction", "preference", "prompts"] = api_field(
        "format of each record: text (one text field), chat (a list of role/content "
        "messages rendered by the tokenizer's chat template), instruction (prompt and "
        "completion fields), preference (a prompt with a chosen and a rejected response, "
        "for training.objective dpo) or prompts (a prompt to complete, for training.objective "
        "grpo; the record's other fields are kept for the rewards to read). Preference fields "
        "and prompts hold plain text or lists of role/content messages (rendered by the chat "
        "template); without a prompt field, a preference prompt is what chosen and rejected "
        "share at their start.",
        "text",
    )
    text_field: str = api_field(
        "textField holds the text (format text).", "text", min_length=1, max_length=64
    )
    messages_field: str = api_field(
        "messagesField holds the messages (format chat).", "messages", min_length=1, max_length=64
    )
    prompt_field: str = api_field(
        "promptField holds the prompt (format instruction, preference and prompts).",
        "prompt",
        min_length=1,
        max_length=64,
    )
    completion_field: str = api_field(
        "completionField holds the completion (format instruction).",
        "completion",
        min_length=1,
        max_length=64,
    )
    chosen_field: str = api_field(
        "chosenField holds the preferred response (format preference).",
        "chosen",
        min_length=1,
        max_length=64,
    )
    rejected_field: str = api_field(
        "rejectedField holds the dispreferred response (format preference).",
        "rejected",
        min_length=1,
        max_length=64,
    )
    completion_only_loss: bool = api_field(
        "completionOnlyLoss: for chat and instruction data, learn only from assistant turns / "
        "completions (the prompt still conditions them).",
        True,
    )
    max_seq_length: int = api_field(
        "maxSeqLength: tokens per training sequence; longer records are truncated.",
        2048,
        minimum=16,
        maximum=131072,
    )
    packing: bool = api_field(
        "packing puts several records in one sequence (less padding; faster); each record "
        "still attends only to itself. Preference pairs are never packed.",
        True,
    )
    packing_strategy: Literal["bfd", "wrapped"] = api_field(
        "packingStrategy: bfd (best-fit decreasing: whole records share a sequence, each "
        "with its own positions and attention, longer ones truncated) or wrapped (one "
        "token stream cut every maxSeqLength tokens; tokens attend across records).",
        "bfd",
    )
    eval_fraction: float | None = api_field(
        "evalFraction of the records held out for evaluation (0 < f < 0.5). Set this or "
        "evalSplit, not both.",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=0.5,
    )
    eval_split: str | None = api_field(
        "evalSplit: a split of the source used for evaluation.", None, min_length=1, max_length=64
    )
    max_eval_sequences: int = api_field(
        "maxEvalSequences: at most this many eval sequences (preference pairs, for format "
        "preference) are evaluated each time (the same ones every time), so a large eval set "
        "stays affordable.",
        1000,
        minimum=1,
        maximum=10_000_000,
    )
