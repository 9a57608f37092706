"""Records -> token sequences -> batches whose order is a pure function of (seed, step).

Every rank reads and tokenizes the same records (deterministic), so no rank waits for another
and a restarted gang sees exactly the batches the first one would have: the data position
saved in a checkpoint is just the step.

    python -c "from ftjob.trainer import data; help(data)"

Bad data stops the job before any training, naming the file and the record.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from ftjob import contract
from ftjob.spec import DatasetSpec, FineTuneJobSpec
from ftjob.trainer.model import resolve

IGNORE = -100  # label of tokens that are context only (prompts, user turns, padding)


class DataError(contract.TrainerError, ValueError):
    """The data cannot be trained on; the message names the file and record."""

    reason = contract.BAD_DATA


@dataclass
class Records:
    rows: list[dict]
    origin: str  # shown in errors
    line_numbers: list[int] | None = None  # jsonl: rows[i] came from this line

    def where(self, i: int) -> str:
        if self.line_numbers is not None:
            return f"{self.origin} line {self.line_numbers[i]}"
        return f"{self.origin} record {i + 1}"


# ------------------------------------------------------------------------------ reading


def read(ds: DatasetSpec, split: str) -> Records:
    """The records of one split of the source."""
    if ds.source.startswith("hf://"):
        import datasets

        repo = resolve(ds.source)
        token = os.environ.get("HF_TOKEN")
        rows = datasets.load_dataset(repo, ds.subset, split=split, token=token)
        return Records(rows.to_list(), f"{ds.source} split {split}")
    path = Path(resolve(ds.source))
    if path.is_dir():
        return _read_saved(path, split, ds.source)
    if split != ds.split:
        raise DataError(
            f"{ds.source}: a single file has no split {split!r}; "
            "use dataset.evalFraction, or a datasets folder or hf:// source with splits"
        )
    if not path.exists():
        raise DataError(f"{ds.source}: no such file (looked at {path})")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, ds.source)
    if suffix == ".json":
        return _read_json(path, ds.source)
    if suffix in (".parquet", ".csv"):
        import datasets

        loader = (
            datasets.Dataset.from_parquet if suffix == ".parquet" else datasets.Dataset.from_csv
        )
        return Records(loader(str(path)).to_list(), ds.source)
    raise DataError(f"{ds.source}: unknown file type; use .jsonl, .json, .parquet or .csv")


def _read_saved(path: Path, split: str, origin: str) -> Records:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DataError(f"{origin}: a folder, but not one saved with save_to_disk: {e}") from e
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(f"{origin}: no split {split!r} (has {sorted(saved)})")
        saved = saved[split]
    return Records(saved.to_list(), f"{origin} split {split}")


def _read_jsonl(path: Path, origin: str) -> Records:
    rows, numbers = [], []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{origin} line {number}: not valid UTF-8 ({e.reason})") from e
        except json.JSONDecodeError as e:
            raise DataError(f"{origin} line {number}: not valid JSON ({e.msg})") from e
        if not isinstance(row, dict):
            raise DataError(f"{origin} line {number}: a JSON object is expected")
        rows.append(row)
        numbers.append(number)
    return Records(rows, origin, numbers)


def _read_json(path: Path, origin: str) -> Records:
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{origin}: not valid UTF-8 ({e.reason})") from e
    except json.JSONDecodeError:
        return _read_jsonl(path, origin)  # .json files are often JSON lines
    if not isinstance(value, list):
        raise DataError(f"{origin}: a JSON array of objects (or JSON lines) is expected")
    for i, row in enumerate(value):
        if not isinstance(row, dict):
            raise DataError(f"{origin} record {i + 1}: a JSON object is expected")
    return Records(value, origin)


# ------------------------------------------------------------------------------ tokenizing


@dataclass
class Example:
    ids: list[int]
    labels: list[int]  # aligned with ids; the loss shifts them by one


def tokenize(records: Records, tok: PreTrainedTokenizerBase, ds: DatasetSpec) -> list[Example]:
    """Records -> examples, with labels masked on prompts when completionOnlyLoss."""
    masked_chat = ds.format == "chat" and ds.completion_only_loss
    if masked_chat and "generation" not in (tok.chat_template or ""):
        raise DataError(
            f"{ds.source}: the tokenizer's chat template has no {{% generation %}} markers, "
            "so assistant turns cannot be told apart; set dataset.completionOnlyLoss: false"
        )
    out = []
    for i, row in enumerate(records.rows):
        where = records.where(i)
        if ds.format == "text":
            text = _field(row, ds.text_field, str, where, "textField")
            ids = tok(text)["input_ids"] + [tok.eos_token_id]
            out.append(Example(ids, list(ids)))
        elif ds.format == "chat":
            out.append(_chat(row, tok, ds, where))
        else:
            prompt = _field(row, ds.prompt_field, str, where, "promptField")
            completion = _field(row, ds.completion_field, str, where, "completionField")
            p = tok(prompt)["input_ids"]
            c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            masked = [IGNORE] * len(p) if ds.completion_only_loss else list(p)
            out.append(Example(p + c, masked + c))
    return out


def _field(row: dict, name: str, kind: type, where: str, knob: str):
    if name not in row:
        raise DataError(f"{where}: has no field {name!r} (dataset.{knob}); it has {sorted(row)}")
    if not isinstance(row[name], kind):
        raise DataError(f"{where}: field {name!r} must be a {kind.__name__}")
    return row[name]


def _chat(row: dict, tok: PreTrainedTokenizerBase, ds: DatasetSpec, where: str) -> Example:
    messages = _field(row, ds.messages_field, list, where, "messagesField")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m):
            raise DataError(f"{where}: each message needs a role and a string content")
    try:
        enc = tok.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=ds.completion_only_loss,
        )
    except Exception as e:  # noqa: BLE001 - jinja raises anything; name the record instead
        raise DataError(f"{where}: the chat template refused it: {e}") from e
    ids = list(enc["input_ids"])
    if not ds.completion_only_loss:
        return Example(ids, list(ids))
    mask = enc["assistant_masks"]
    return Example(ids, [t if m else IGNORE for t, m in zip(ids, mask, strict=True)])


# ------------------------------------------------------------------------------ sequences


def sequences(examples: list[Example], ds: DatasetSpec, origin: str, seed: int) -> list[Example]:
    """Fixed-length packed sequences, or truncated single examples when packing is off."""
    n = ds.max_seq_length
    if not examples:
        raise DataError(f"{origin}: holds no records")
    if ds.packing:
        # Shuffle documents before packing so that a sequence mixes topics, deterministically.
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        ids = [t for i in order for t in examples[i].ids]
        labels = [t for i in order for t in examples[i].labels]
        count = max(len(ids) // n, 1)  # the ragged tail is dropped unless it is all there is
        out = [Example(ids[k * n : (k + 1) * n], labels[k * n : (k + 1) * n]) for k in range(count)]
    else:
        if all(len(e.ids) > n for e in examples):
            shortest = min(len(e.ids) for e in examples)
            raise DataError(
                f"{origin}: every record is longer than dataset.maxSeqLength={n} tokens "
                f"(the shortest has {shortest}); raise maxSeqLength or turn packing on"
            )
        out = [Example(e.ids[:n], e.labels[:n]) for e in examples]
    # A sequence whose labels are all masked (a prompt cut off by truncation) teaches nothing.
    out = [e for e in out if any(t != IGNORE for t in e.labels[1:])]
    if not out:
        raise DataError(f"{origin}: no record has a token to learn from (all labels masked)")
    return out


@dataclass
class Data:
    train: list[Example]
    eval: list[Example]
    pad_id: int


def load(spec: FineTuneJobSpec, tok: PreTrainedTokenizerBase) -> Data:
    """Read, split, tokenize and pack the train (and eval) sets."""
    ds, seed = spec.dataset, spec.training.seed
    train = read(ds, ds.split)
    if not train.rows:
        raise DataError(f"{train.origin}: holds no records")
    evaluation: Records | None = None
    if ds.eval_split:
        evaluation = read(ds, ds.eval_split)
    elif ds.eval_fraction:
        order = list(range(len(train.rows)))
        random.Random(seed).shuffle(order)
        held = set(order[: max(1, math.ceil(len(order) * ds.eval_fraction))])
        evaluation = _subset(train, sorted(held))
        train = _subset(train, [i for i in range(len(train.rows)) if i not in held])
    train_seqs = sequences(tokenize(train, tok, ds), ds, train.origin, seed)
    eval_seqs = []
    if evaluation is not None:
        eval_seqs = sequences(
            tokenize(evaluation, tok, ds), ds, f"{evaluation.origin} (eval)", seed
        )
    return Data(train_seqs, eval_seqs, tok.pad_token_id)


def _subset(records: Records, keep: list[int]) -> Records:
    numbers = records.line_numbers
    return Records(
        [records.rows[i] for i in keep],
        records.origin,
        [numbers[i] for i in keep] if numbers is not None else None,
    )


# ------------------------------------------------------------------------------ batches


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors; padding is masked out of attention and loss."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        labels[row, : len(e.labels)] = torch.tensor(e.labels)
        mask[row, : len(e.ids)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class Sampler:
    """Which sequences a rank trains on at (step, micro-batch): a pure function of them.

    Sequence number k of the whole run is element k % n of permutation k // n (one per epoch,
    seeded by seed and epoch); a micro-batch takes the next world x microBatchSize numbers.
    """

    def __init__(self, n: int, seed: int, world: int, micro_batch: int, accumulation: int):
        self.n, self.seed = n, seed
        self.world, self.micro_batch, self.accumulation = world, micro_batch, accumulation
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    @property
    def per_step(self) -> int:
        return self.world * self.micro_batch * self.accumulation

    def steps_for(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * self.n / self.per_step))

    def epoch(self, step: int) -> float:
        return step * self.per_step / self.n

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = ((step * self.accumulation + micro) * self.world + rank) * self.micro_batch
        return [self._at(k) for k in range(start, start + self.micro_batch)]

    def _at(self, k: int) -> int:
        epoch, i = divmod(k, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return int(self._perm[i])


def eval_batches(data: Data, rank: int, world: int, micro_batch: int) -> list[dict]:
    """This rank's share of the eval set; every rank gets the same number of batches.

    FSDP needs every rank in every forward, so short ranks get a batch with no labels.
    """
    mine = data.eval[rank::world]
    count = math.ceil(len(data.eval) / world / micro_batch)
    batches = []
    for b in range(count):
        chunk = mine[b * micro_batch : (b + 1) * micro_batch]
        if not chunk:
            blank = data.eval[0]
            chunk = [Example(blank.ids, [IGNORE] * len(blank.ids))]
        batches.append(collate(chunk, data.pad_id))
    return batches
