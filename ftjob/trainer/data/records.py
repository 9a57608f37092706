"""Source -> validated records, one at a time, each with the line (or record number) it came from.

Reading is a cheap single pass that stops at the first bad record, before anything is
tokenized: a malformed line 3 fails the job in seconds, not after an hour of tokenizing.
Records are yielded, never collected, so a file larger than RAM streams through.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ftjob.api.contract import BAD_DATA, TrainerError
from ftjob.api.jobspec.data import DatasetSpec
from ftjob.api.source import parse
from ftjob.job.inputs import DATA_FIX, resolve

# No torch, transformers or pyarrow at import (pyarrow only where a function builds Arrow):
# `ftjob run` and the trainer's entry point read the records (:func:`check`) before those load.


class DataError(TrainerError, ValueError):
    """The data cannot be trained on; the message names the file and record."""

    reason = BAD_DATA


# The fix for a missing source, as `ftjob run` gives it before any process starts.
MISSING_SOURCE = DATA_FIX
# Names a field usually has in public data sets, per knob: a likely field to suggest.
USUAL_NAMES = {
    "messagesField": ("messages", "conversations", "conversation", "chat", "dialog", "turns"),
    "textField": ("text", "content", "body", "document", "sentence"),
    "promptField": ("prompt", "instruction", "question", "input", "query", "source"),
    "completionField": ("completion", "response", "output", "answer", "target", "chosen"),
    "chosenField": ("chosen", "preferred", "accepted", "winner", "better", "response_a"),
    "rejectedField": ("rejected", "dispreferred", "loser", "worse", "response_b"),
}
# A preference record's three parts, each either text or a list of messages.
PARTS = ("prompt", "chosen", "rejected")


def origin(ds: DatasetSpec, split: str, root: Path | None = None) -> str:
    """How errors name the source of one split (``root``: see :func:`resolve`)."""
    if parse(ds.source).remote or Path(resolve(ds.source, root)).is_dir():
        return f"{ds.source} split {split}"
    return ds.source


def check_source(ds: DatasetSpec, split: str, root: Path | None = None) -> Path | None:
    """Refuse a source that cannot hold the split; the local file or folder, if any."""
    if parse(ds.source).remote:
        return None
    path = Path(resolve(ds.source, root))
    if path.is_dir():
        return path
    if split != ds.split:
        raise DataError(
            f"{ds.source}: a single file has no split {split!r}; "
            "use dataset.evalFraction, or a datasets folder or hf:// source with splits",
            fix="set dataset.evalFraction instead of dataset.evalSplit",
        )
    if not path.exists():
        raise DataError(
            f"{ds.source}: no such file (looked at {path})",
            fix=MISSING_SOURCE,
            where="spec.dataset.source",
        )
    if path.suffix.lower() not in (".jsonl", ".json", ".parquet", ".csv"):
        raise DataError(
            f"{ds.source}: unknown file type; use .jsonl, .json, .parquet or .csv",
            fix="convert spec.dataset.source to JSON lines, JSON, Parquet or CSV",
        )
    return path


def raw(ds: DatasetSpec, split: str, root: Path | None = None) -> Iterator[tuple[str, int, dict]]:
    """(where, number, row) for every record of one split, in source order.

    ``number`` is the JSONL line, else the record's position from 1; ``where`` names both.
    """
    name = origin(ds, split, root)
    path = check_source(ds, split, root)
    if path is None or path.is_dir():
        yield from _table_rows(_table(ds, split, path), name)
    elif path.suffix.lower() == ".jsonl":
        yield from _jsonl(path, name)
    elif path.suffix.lower() == ".json":
        yield from _json(path, name)
    elif path.suffix.lower() == ".csv":
        yield from _csv(path, name)
    else:
        yield from _table_rows(_table(ds, split, path), name)


def _csv(path: Path, name: str) -> Iterator[tuple[str, int, dict]]:
    """A CSV's records with every value as the text it holds: a type guessed from the values
    (an answer " 40." read as the number 40.0) is not the text a model should learn."""
    import csv

    with path.open(newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f), start=1):
            yield f"{name} record {i}", i, row


def _table(ds: DatasetSpec, split: str, path: Path | None):
    import datasets

    if path is None:
        token = os.environ.get("HF_TOKEN")
        return datasets.load_dataset(
            resolve(ds.source), ds.subset, split=split, revision=ds.revision, token=token
        )
    if path.is_dir():
        try:
            saved = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise DataError(
                f"{ds.source}: a folder, but not one saved with save_to_disk: {e}"
            ) from e
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise DataError(
                    f"{ds.source}: no split {split!r} (has {sorted(saved)})",
                    fix=f"set dataset.split (or evalSplit) to one of {sorted(saved)}",
                )
            saved = saved[split]
        return saved
    if path.suffix.lower() == ".parquet":
        return datasets.Dataset.from_parquet(str(path))
    return datasets.Dataset.from_csv(str(path))


def _table_rows(table, name: str) -> Iterator[tuple[str, int, dict]]:
    for i, row in enumerate(table, start=1):
        yield f"{name} record {i}", i, row


def _jsonl(path: Path, name: str) -> Iterator[tuple[str, int, dict]]:
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield f"{name} line {number}", number, _object(line, f"{name} line {number}")


def _json(path: Path, name: str) -> Iterator[tuple[str, int, dict]]:
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{name}: not valid UTF-8 ({e.reason})") from e
    except json.JSONDecodeError:
        yield from _jsonl(path, name)  # .json files are often JSON lines
        return
    if not isinstance(value, list):
        raise DataError(f"{name}: a JSON array of objects (or JSON lines) is expected")
    for i, row in enumerate(value, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{name} record {i}: a JSON object is expected")
        yield f"{name} record {i}", i, row


def _object(line: bytes, where: str) -> dict:
    try:
        # Without its line end: a line cut short would be blamed on "column 1" of the next.
        text = line.decode("utf-8").rstrip("\r\n")
        row = json.loads(text)
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 ({e.reason})") from e
    except json.JSONDecodeError as e:
        # The column too: one JSON line can be a whole document long.
        cut = " (the line ends before the JSON does: cut short?)" if e.pos >= len(text) else ""
        raise DataError(
            f"{where}: not valid JSON at column {e.colno} ({e.msg}){cut}",
            fix="fix the JSON at that line and column of spec.dataset.source",
        ) from e
    if not isinstance(row, dict):
        raise DataError(f"{where}: a JSON object is expected")
    return row


# ------------------------------------------------------------------------------ normalizing


def schema(ds: DatasetSpec):
    """The Arrow schema of a normalized record: the line and the format's fields only."""
    import pyarrow as pa

    fields = [("line", pa.int64())]
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    if ds.format == "text":
        fields.append(("text", pa.string()))
    elif ds.format == "chat":
        fields.append(("messages", pa.list_(message)))
    elif ds.format == "prompts":
        # A text prompt or a conversational one (the other null), and the whole record as JSON
        # for the rewards to read (an answer, test cases: any field).
        fields += [("prompt", pa.string()), ("prompt_messages", pa.list_(message))]
        fields.append(("record", pa.string()))
    elif ds.format == "preference":
        # Plain-text parts fill the first three columns, conversational ones the other three;
        # the unused three are null.
        fields += [(part, pa.string()) for part in PARTS]
        fields += [(f"{part}_messages", pa.list_(message)) for part in PARTS]
    else:
        fields += [("prompt", pa.string()), ("completion", pa.string())]
    return pa.schema(fields)


def batches(ds: DatasetSpec, split: str, size: int = 2_000) -> Iterator:
    """Normalized records of one split as Arrow batches of ``size`` rows, in source order.

    Columns are built straight from Python lists: going through ``datasets`` row encoding
    cost three times the JSON parsing.
    """
    import pyarrow as pa

    shape = schema(ds)
    columns: dict[str, list] = {name: [] for name in shape.names}
    count = 0
    for where, number, row in raw(ds, split):
        columns["line"].append(number)
        for name, value in normalize(row, ds, where).items():
            columns[name].append(value)
        count += 1
        if len(columns["line"]) == size:
            yield pa.record_batch(columns, schema=shape)
            columns = {name: [] for name in shape.names}
    if columns["line"]:
        yield pa.record_batch(columns, schema=shape)
    if count == 0:
        raise _no_records(ds, split)


# The files read here without the datasets library: those :func:`check` reads.
PLAIN_FILES = (".jsonl", ".json", ".csv")
# How many records `ftjob run` reads before it starts anything: a field named wrongly or a
# format mismatch shows in the first; the trainer reads them all. 50,000 chat records take
# ~0.2 s (200,000 took 0.78 s, 35 MB); every record of a 10 GB file would be minutes before
# every run, a resume too.
CHECKED = 50_000


def check(ds: DatasetSpec, root: Path | None = None) -> int | None:
    """Read the first CHECKED records of a local JSON lines, JSON or CSV source as the trainer
    will, and raise its DataError at the first bad one (a missing field, a cut line); the number
    of records read. None: not read here (an hf:// or s3:// source, a datasets folder or Parquet
    needs the datasets library; the trainer reads those). A plain pass, no Arrow and no tokenizer.
    """
    path = check_source(ds, ds.split, root)
    if ds.eval_split:
        check_source(ds, ds.eval_split, root)  # a single file has one split
    if path is None or path.is_dir() or path.suffix.lower() not in PLAIN_FILES:
        return None
    count = 0
    for where, _, row in itertools.islice(raw(ds, ds.split, root), CHECKED):
        normalize(row, ds, where)
        count += 1
    if count == 0:
        raise _no_records(ds, ds.split, root)
    return count


def _no_records(ds: DatasetSpec, split: str, root: Path | None = None) -> DataError:
    return DataError(
        f"{origin(ds, split, root)}: holds no records",
        fix="point spec.dataset.source at a file or split with records",
    )


def normalize(row: dict, ds: DatasetSpec, where: str) -> dict:
    """The fields the format needs, checked; a DataError names the record and the knob."""
    if ds.format == "text":
        return {"text": _field(row, ds.text_field, str, where, "textField")}
    if ds.format == "chat":
        messages = _field(row, ds.messages_field, list, where, "messagesField")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m):
                raise DataError(f"{where}: each message needs a role and a string content")
        return {"messages": _messages(messages)}
    if ds.format == "preference":
        return preference(row, ds, where)
    if ds.format == "prompts":
        return prompt(row, ds, where)
    return {
        "prompt": _field(row, ds.prompt_field, str, where, "promptField"),
        "completion": _field(row, ds.completion_field, str, where, "completionField"),
    }


def _messages(messages: list) -> list[dict]:
    return [{"role": str(m["role"]), "content": m["content"]} for m in messages]


def preference(row: dict, ds: DatasetSpec, where: str) -> dict:
    """A preference record's prompt, chosen and rejected response, checked.

    Each part is text or a list of messages, all three alike. Without the prompt field, the
    prompt is what chosen and rejected share at their start (TRL's ``extract_prompt``: whole
    messages, or characters up to the first difference). A pair must have two different,
    non-empty responses: otherwise there is nothing to prefer.
    """
    chosen = _side(row, ds.chosen_field, where, "chosenField")
    rejected = _side(row, ds.rejected_field, where, "rejectedField")
    names = f"{ds.chosen_field!r} and {ds.rejected_field!r}"
    if type(chosen) is not type(rejected):
        raise DataError(
            f"{where}: {names} must both be text or both lists of messages",
            fix="make the chosen and rejected fields of spec.dataset.source the same kind",
        )
    if chosen == rejected:
        raise DataError(
            f"{where}: {names} are equal: a pair needs two different responses",
            fix="remove the record, or fix its rejected response, in spec.dataset.source",
        )
    if ds.prompt_field in row:
        prompt = _side(row, ds.prompt_field, where, "promptField")
        if type(prompt) is not type(chosen):
            raise DataError(
                f"{where}: field {ds.prompt_field!r} must be the same kind as {names} (text, "
                "or a list of messages)",
                fix="make the prompt, chosen and rejected fields of spec.dataset.source alike",
            )
    else:
        prompt, chosen, rejected = _implicit_prompt(row, ds, chosen, rejected, where)
    for name, side in ((ds.chosen_field, chosen), (ds.rejected_field, rejected)):
        if _empty(side):
            raise DataError(
                f"{where}: field {name!r} has an empty response: a pair needs two responses",
                fix="remove the record, or give it both responses, in spec.dataset.source",
            )
    parts = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if isinstance(chosen, str):
        return {**parts, **{f"{p}_messages": None for p in PARTS}}
    return {**{p: None for p in PARTS}, **{f"{p}_messages": _messages(v) for p, v in parts.items()}}


def prompt(row: dict, ds: DatasetSpec, where: str) -> dict:
    """A prompts record (objective grpo): its prompt, text or messages, and the record itself
    as JSON, which the rewards read (its fields as the source has them)."""
    value = _side(row, ds.prompt_field, where, "promptField")
    if _empty(value):
        raise DataError(
            f"{where}: field {ds.prompt_field!r} is empty: there is nothing to complete",
            fix="remove the record, or give it a prompt, in spec.dataset.source",
        )
    text = isinstance(value, str)
    try:
        record = json.dumps(row, ensure_ascii=False, default=str)
    except ValueError as e:  # a circular structure cannot come from a file; NaN can
        raise DataError(f"{where}: the record cannot be kept for the rewards: {e}") from e
    return {
        "prompt": value if text else None,
        "prompt_messages": None if text else _messages(value),
        "record": record,
    }


def _side(row: dict, name: str, where: str, knob: str):
    if name not in row:
        raise DataError(
            f"{where}: has no field {name!r} (dataset.{knob}); it has {sorted(row)}",
            fix=_field_fix(row, str, knob)
            if any(isinstance(v, str) for v in row.values())
            else _field_fix(row, list, knob),
        )
    value = row[name]
    if isinstance(value, list):
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m):
                raise DataError(
                    f"{where}: field {name!r}: each message needs a role and a string content"
                )
        return value
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be a string or a list of messages")
    return value


def _empty(side) -> bool:
    if isinstance(side, str):
        return not side.strip()
    return not side or all(not m["content"].strip() for m in side)


def _implicit_prompt(row, ds, chosen, rejected, where):
    """(prompt, chosen, rejected) of a record whose prompt is the shared start of both."""
    from trl.data_utils import extract_prompt

    shorter, longer = sorted((chosen, rejected), key=len)
    if longer[: len(shorter)] == shorter:
        # One response is the other plus more: after the shared prompt one side is empty.
        name = ds.chosen_field if shorter is chosen else ds.rejected_field
        raise DataError(
            f"{where}: field {name!r} has an empty response: it is where the other "
            "response starts, so it adds nothing after the shared prompt",
            fix="remove the record, or give it both responses, in spec.dataset.source",
        )
    if chosen[0] != rejected[0]:
        raise DataError(
            f"{where}: has no field {ds.prompt_field!r} (dataset.promptField), and "
            f"{ds.chosen_field!r} and {ds.rejected_field!r} share no start to take the "
            f"prompt from; it has {sorted(row)}",
            fix="set spec.dataset.promptField to the field holding the prompt, or begin "
            "chosen and rejected with the same prompt",
        )
    out = extract_prompt({"chosen": chosen, "rejected": rejected})
    return out["prompt"], out["chosen"], out["rejected"]


def _field(row: dict, name: str, kind: type, where: str, knob: str):
    if name not in row:
        raise DataError(
            f"{where}: has no field {name!r} (dataset.{knob}); it has {sorted(row)}",
            fix=_field_fix(row, kind, knob),
        )
    if not isinstance(row[name], kind):
        got = type(row[name]).__name__
        raise DataError(
            f"{where}: field {name!r} must be a {kind.__name__}, got a {got} ({row[name]!r:.60})",
            fix=f"make field {name!r} a {kind.__name__} in that record of spec.dataset.source"
            + (" (a JSON string, in quotes)" if kind is str else ""),
        )
    return row[name]


def _field_fix(row: dict, kind: type, knob: str) -> str:
    """The knob to set when the record has a likely other field; else what the record needs.

    Likely: a field of the right type with a usual name for the knob, or the only field of
    that type (a list of objects, for messages).
    """
    fitting = [k for k, v in row.items() if isinstance(v, kind)]
    if kind is list:
        fitting = [k for k in fitting if row[k] and all(isinstance(m, dict) for m in row[k])]
    usual = [k for k in USUAL_NAMES[knob] if k in fitting]
    likely = usual[0] if usual else fitting[0] if len(fitting) == 1 else None
    if likely is None:
        return (
            f"set spec.dataset.{knob} to the field that holds it, or fix the records of "
            "spec.dataset.source"
        )
    fix = f"set dataset.{knob}: {likely}"
    first = row[likely][0] if kind is list else None
    if isinstance(first, dict) and not {"role", "content"} <= first.keys():
        fix += f" (its messages have {sorted(first)}; each needs role and content)"
    return fix
