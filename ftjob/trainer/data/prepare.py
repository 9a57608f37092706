"""Prepare the data once per job: read, validate, tokenize, split, pack -> Arrow on the volume.

Global rank 0 does the work and writes ``<job_dir>/data/<key>/`` atomically (a temporary
folder renamed into place); every rank then memory-maps it, so no rank holds token lists in
Python objects and a restarted gang (or another job with the same key) starts in seconds.
The key hashes everything that changes the tokens, so a changed file or setting never
reuses stale sequences.

    python -c "from ftjob.trainer.data import prepare; help(prepare.prepare)"
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa  # at this module's import: the data phase's (batches.load), not start-up's
import pyarrow.compute as pc

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.source import Hub, parse
from ftjob.job import atomic
from ftjob.trainer.data import pairs, prompts, records, tokenize
from ftjob.trainer.data.records import DataError

if TYPE_CHECKING:  # imported by the phase that uses it: see ftjob/trainer/report/startup.py
    from transformers import PreTrainedTokenizerBase

LAYOUT = 3  # bump when the prepared layout or the tokenization rules change
SHARD = 50_000  # records tokenized between two progress reports
LARGE_LOSS = 0.05  # a share of tokens (or records) lost above which the log says what to change
WAIT_LIMIT_S = 24 * 3600  # how long other ranks wait for rank 0's prepare (see wait())

Progress = Callable[[dict], None]


def key(spec: FineTuneJobSpec, tok: PreTrainedTokenizerBase) -> str:
    """A hash of everything that changes the prepared tokens (and nothing that does not)."""
    ds = spec.dataset
    settings = {
        "layout": LAYOUT,
        "dataset": {
            k: getattr(ds, k)
            for k in (
                "source",
                "split",
                "subset",
                "revision",
                "format",
                "text_field",
                "messages_field",
                "prompt_field",
                "completion_field",
                "completion_only_loss",
                "max_seq_length",
                "packing",
                "packing_strategy",
                "eval_fraction",
                "eval_split",
            )
        },  # fmt: skip
        "seed": spec.training.seed,
        # Only preference data reads these; other formats keep the keys they had.
        **({"pairs": [ds.chosen_field, ds.rejected_field]} if ds.format == "preference" else {}),
        # A prompt keeps maxSeqLength minus the completion's room.
        **(
            {"completion": spec.training.grpo_settings().max_completion_length}
            if ds.format == "prompts"
            else {}
        ),  # fmt: skip
        "files": _source_identity(ds.source),
        "tokenizer": _tokenizer_identity(tok),
    }
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _source_identity(source: str) -> list:
    # Size and modification time name a file's version without reading gigabytes; a
    # rewritten file gets a new mtime. Hub sources are keyed by the commit sources.fetch
    # pinned (dataset.revision).
    if isinstance(parse(source), Hub):
        return []
    path = Path(records.resolve(source))
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue  # a missing file is reported by the reader, with the fix
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _tokenizer_identity(tok: PreTrainedTokenizerBase) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    special = [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, type(tok).__name__]
    text = json.dumps([vocab, tok.chat_template, special], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------ preparing


def prepare(
    spec: FineTuneJobSpec,
    tok: PreTrainedTokenizerBase,
    root: Path,
    *,
    is_main: bool = True,
    log: Callable[[str], None] = print,
    on_progress: Progress | None = None,
) -> Path:
    """The folder of prepared sequences for this spec under ``root``, preparing it if needed.

    ``is_main`` prepares; the others wait for the folder to appear. ``on_progress`` gets
    ``{"stage", "records", "total", "recordsPerSecond", "etaSeconds"}`` as work goes on.
    """
    folder = root / key(spec, tok)
    if (folder / "info.json").exists():
        if is_main:
            log(f"data: reusing the prepared sequences in {folder}")
            _say_losses(folder, spec.dataset.max_seq_length, log)  # said on every run
        return folder
    if not is_main:
        return wait(folder)
    started = time.monotonic()
    with atomic.new_folder(folder) as tmp:
        info = _build(spec, tok, tmp, log, on_progress or (lambda _: None))
        info["seconds"] = round(time.monotonic() - started, 1)
        (tmp / "info.json").write_text(json.dumps(info, indent=1))
        shutil.rmtree(tmp / "cache", ignore_errors=True)
    log(f"data: prepared in {info['seconds']:.1f} s into {folder}")
    return folder


def wait(folder: Path) -> Path:
    """Wait for rank 0's prepare by polling for the committed folder.

    Not a collective: a barrier would time out after the process group's timeout (minutes)
    while a large prepare takes an hour. If rank 0 fails, torchrun ends this rank with it.
    """
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not (folder / "info.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not finish preparing {folder} in {WAIT_LIMIT_S} s")
        time.sleep(1.0)
    return folder


def _build(spec, tok, tmp: Path, log, on_progress) -> dict:
    import datasets

    datasets.disable_progress_bars()  # we report progress ourselves; pod logs are not terminals
    ds, seed = spec.dataset, spec.training.seed
    template = tokenize.chat_template(tok, ds)
    cache = tmp / "cache"
    train = _read(ds, ds.split, cache, log, on_progress)
    name = records.origin(ds, ds.split)
    evaluation, eval_name = None, f"{name} (eval)"
    if ds.eval_split:
        evaluation = _read(ds, ds.eval_split, cache, log, on_progress)
        eval_name = f"{records.origin(ds, ds.eval_split)} (eval)"
    elif ds.eval_fraction:
        # Hold out whole records, chosen by the seed, before tokenizing: no leak by packing.
        order = np.random.default_rng(seed).permutation(len(train))
        held = np.zeros(len(train), dtype=bool)
        held[order[: max(1, math.ceil(len(train) * ds.eval_fraction))]] = True
        evaluation = train.select(np.flatnonzero(held))
        train = train.select(np.flatnonzero(~held))
    write = _sequences
    if ds.format == "preference":
        template, write = pairs.template(tok), _pairs
    if ds.format == "prompts":
        room = prompts.room(ds.max_seq_length, spec.training.grpo_settings().max_completion_length)
        template, write = pairs.template(tok), functools.partial(_prompts, room=room)
    info = {"train": write(train, tok, ds, name, template, tmp / "train", log, on_progress)}
    if evaluation is not None:
        info["eval"] = write(
            evaluation, tok, ds, eval_name, template, tmp / "eval", log, on_progress
        )
    return info


def _read(ds, split, cache: Path, log, on_progress):
    """One split's validated records, streamed into an Arrow file that is then mapped."""
    import datasets

    meter = Meter("reading", None, log, on_progress)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"records-{split}.arrow"
    count = 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, records.schema(ds)) as out:
        for batch in records.batches(ds, split):
            out.write_batch(batch)
            count += batch.num_rows
            meter.update(count)
    meter.done(count)
    return datasets.Dataset.from_file(str(path))


def _sequences(table, tok, ds, name, template, out: Path, log, on_progress) -> dict:
    """Tokenize, pack (or truncate) and write the sequences to ``out``.

    Documents with nothing to learn are dropped while tokenizing (within the first
    maxSeqLength tokens, where the sequence step truncates). The last pass writes straight
    into ``out``: no copy of the whole set is made to save it.
    """
    import datasets

    n, procs = ds.max_seq_length, _processes(len(table))
    strategy = ds.packing_strategy if ds.packing else None
    meter = Meter("tokenizing", len(table), log, on_progress)
    fn_kwargs = {"tok": tok, "ds": ds, "name": name, "template": template,
                 "limit": None if strategy == "wrapped" else n}  # fmt: skip
    parts = _map_in_shards(table, tokenize.batch, fn_kwargs, f"tokens-{out.name}", meter)
    tokens = datasets.concatenate_datasets(parts).with_format(None)
    if len(tokens) == 0:
        raise DataError(f"{name}: no record has a token to learn from (all labels masked)")
    lengths = pc.list_value_length(tokens.data.table.column("input_ids")).to_numpy()
    if strategy is None and (lengths > n).all():
        raise DataError(
            f"{name}: every record is longer than dataset.maxSeqLength={n} tokens "
            f"(the shortest has {lengths.min()}); raise maxSeqLength or turn packing on",
            fix=f"raise dataset.maxSeqLength above {lengths.min()}, or set dataset.packing: true",
        )
    Meter("packing", None, log, on_progress).update(0, force=True)
    out.mkdir()
    # bfd fills bins within a batch. The last pass writes its shards into the folder ranks map.
    passes = {"batch_size": 10_000, "num_proc": procs}
    last = {**passes, "cache_file_name": str(out / "part.arrow")}
    if strategy is None:
        seqs = tokens.with_format("arrow").map(_single, fn_kwargs={"n": n}, batched=True, **last)
    else:
        from trl.data_utils import pack_dataset

        # In source order: a shuffle would make packing gather rows at random (twice as
        # slow). Documents in a sequence never see each other; the sampler shuffles sequences.
        bfd = strategy == "bfd"
        seqs = pack_dataset(tokens, n, strategy=strategy, map_kwargs=last if bfd else passes)
        if not bfd:
            seqs = seqs.with_format("arrow").map(_whole, fn_kwargs={"n": n}, batched=True, **last)
    if len(seqs) == 0:
        raise DataError(f"{name}: no sequence has a token to learn from (all labels masked)")
    kept = int(pc.sum(pc.list_value_length(seqs.data.table.column("input_ids"))).as_py())
    info = {"name": name, "records": len(table), "tokens": int(lengths.sum()),
            "sequences": len(seqs), "sequenceTokens": kept, "bytes": _size(out),
            **_losses(len(table), lengths, kept, n, strategy)}  # fmt: skip
    how = f"packed {strategy}" if strategy else "one record each"
    log(
        f"data: {name}: {len(table):,} records, {info['tokens']:,} tokens -> {len(seqs):,} "
        f"sequences of <= {n} tokens ({how})"
    )
    for line in loss_lines(info, n):
        log(line)
    return info


def _pairs(table, tok, ds, name, template, out: Path, log, on_progress) -> dict:
    """Tokenize preference pairs, fit each into maxSeqLength tokens per sequence (the prompt
    is cut first), and write them to ``out``: one pair per row, never packed."""
    n, procs = ds.max_seq_length, _processes(len(table))
    meter = Meter("tokenizing", len(table), log, on_progress)
    fn_kwargs = {"tok": tok, "ds": ds, "name": name, "template": template, "limit": n}
    tokens = _concat(_map_in_shards(table, pairs.batch, fn_kwargs, f"pairs-{out.name}", meter))
    counts = tokens.data.table
    cut_prompt = counts.column("cut_prompt").to_numpy()
    cut_response = counts.column("cut_response").to_numpy()
    out.mkdir()
    last = {"batch_size": 10_000, "num_proc": procs, "cache_file_name": str(out / "part.arrow")}
    kept = tokens.with_format("arrow").map(
        _pair_columns, batched=True, new_fingerprint=f"pairs-{out.name}", **last
    )
    lengths = {side: pc.list_value_length(kept.data.table.column(f"{side}_ids")).to_numpy()
               for side in ("prompt", "chosen", "rejected")}  # fmt: skip
    info = {
        "name": name,
        "records": len(table),
        "pairs": len(kept),
        "tokens": int(sum(v.sum() for v in lengths.values())),
        # As the record was, before fitting: what maxSeqLength would have to be.
        "longestPairTokens": int(
            (
                lengths["prompt"]
                + cut_prompt
                + cut_response
                + np.maximum(lengths["chosen"], lengths["rejected"])
            ).max()
        ),  # fmt: skip
        "cutPromptPairs": int((cut_prompt > 0).sum()),
        "cutPromptTokens": int(cut_prompt.sum()),
        "cutResponsePairs": int((cut_response > 0).sum()),
        "cutResponseTokens": int(cut_response.sum()),
        "bytes": _size(out),
    }
    log(f"data: {name}: {len(table):,} records -> {len(kept):,} preference pairs of <= {n} "
        "tokens per sequence")  # fmt: skip
    for line in pair_lines(info, n):
        log(line)
    return info


def _prompts(table, tok, ds, name, template, out: Path, log, on_progress, *, room: int) -> dict:
    """Tokenize prompts (objective grpo), each cut to its last ``room`` tokens, and write them
    with their records to ``out``: one prompt per row."""
    meter = Meter("tokenizing", len(table), log, on_progress)
    fn_kwargs = {"tok": tok, "name": name, "template": template, "limit": room}
    tokens = _concat(_map_in_shards(table, prompts.batch, fn_kwargs, f"prompts-{out.name}", meter))
    cut = tokens.data.table.column("cut_prompt").to_numpy()
    out.mkdir()
    last = {"batch_size": 10_000, "num_proc": _processes(len(table)),
            "cache_file_name": str(out / "part.arrow")}  # fmt: skip
    kept = tokens.with_format("arrow").map(
        _prompt_columns, batched=True, new_fingerprint=f"prompts-{out.name}", **last
    )
    lengths = pc.list_value_length(kept.data.table.column("prompt_ids")).to_numpy()
    info = {"name": name, "records": len(table), "prompts": len(kept),
            "tokens": int(lengths.sum()), "cutPrompts": int((cut > 0).sum()),
            "cutPromptTokens": int(cut.sum()), "bytes": _size(out)}  # fmt: skip
    log(f"data: {name}: {len(table):,} records -> {len(kept):,} prompts of <= {room} tokens "
        "(dataset.maxSeqLength minus training.grpo.maxCompletionLength)")  # fmt: skip
    if info["cutPrompts"]:
        log(
            f"data: {name}: {info['cutPrompts']:,} prompts kept only their last {room} tokens "
            f"({info['cutPromptTokens']:,} tokens cut); raise dataset.maxSeqLength to keep them"
        )
    return info


def _prompt_columns(table: pa.Table) -> pa.Table:
    return table.select(list(prompts.COLUMNS))  # the cut counts stay in info.json


def _pair_columns(table: pa.Table) -> pa.Table:
    return table.select(list(pairs.COLUMNS))  # the cut counts stay in info.json


def _concat(parts):
    import datasets

    return datasets.concatenate_datasets(parts).with_format(None)


def pair_lines(info: dict, n: int) -> list[str]:
    """The log's lines about what fitting pairs into maxSeqLength cut (none when nothing)."""
    name, lines = info.get("name", "data"), []
    if info.get("cutPromptPairs"):
        lines.append(
            f"data: {name}: {info['cutPromptPairs']:,} of {info['records']:,} pairs had their "
            f"prompt's start cut to fit dataset.maxSeqLength={n}: {info['cutPromptTokens']:,} "
            "prompt tokens left out"
        )
    if info.get("cutResponsePairs"):
        lines.append(
            f"data: {name}: warning: {info['cutResponsePairs']:,} of {info['records']:,} pairs "
            f"have a response longer than dataset.maxSeqLength={n} allows: "
            f"{info['cutResponseTokens']:,} response tokens cut; raise maxSeqLength (the "
            f"longest pair has {info['longestPairTokens']:,} tokens) to keep them"
        )
    return lines


def _losses(records: int, lengths: np.ndarray, kept: int, n: int, strategy) -> dict:
    """What the sequences leave out of the records, counted (the prepared data's record).

    ``lengths`` are the tokens of the records kept after tokenizing; the others had nothing
    to learn within their first n tokens (dropped). Single sequences and bfd packing (TRL
    truncates there too) cut a record longer than n; wrapped packing cuts nothing but drops
    each batch's ragged tail. Every token not in a sequence is counted as lost.
    """
    cut = lengths > n if strategy in (None, "bfd") else np.zeros(len(lengths), dtype=bool)
    total = int(lengths.sum())
    return {
        "droppedRecords": records - len(lengths),
        "cutRecords": int(cut.sum()),
        "cutTokens": int((lengths[cut] - n).sum()),
        "lostTokens": total - kept,
        "lostTokenFraction": round((total - kept) / total, 4) if total else 0.0,
        "longestRecordTokens": int(lengths.max()) if len(lengths) else 0,
    }


def loss_lines(info: dict, n: int) -> list[str]:
    """The log's lines about data left out of training (none when nothing is)."""
    name, lines = info.get("name", "data"), []
    if info.get("cutRecords"):
        lines.append(
            f"data: {name}: {info['cutRecords']:,} of {info['records']:,} records cut at "
            f"dataset.maxSeqLength={n}: {info['cutTokens']:,} tokens not trained on"
        )
    if info.get("droppedRecords"):
        lines.append(
            f"data: {name}: {info['droppedRecords']:,} records dropped: nothing to learn "
            f"within their first {n} tokens (dataset.maxSeqLength)"
        )
    lost = info.get("lostTokens", 0) - info.get("cutTokens", 0)
    if lost > 0:
        lines.append(f"data: {name}: {lost:,} tokens of partial sequences left out (packing)")
    dropped = info.get("droppedRecords", 0) / max(info.get("records", 0), 1)
    if info.get("lostTokenFraction", 0) > LARGE_LOSS or dropped > LARGE_LOSS:
        share = max(info.get("lostTokenFraction", 0), dropped)
        lines.append(
            f"data: {name}: warning: {share:.0%} of the data is not trained on; raise "
            f"dataset.maxSeqLength (the longest record has {info['longestRecordTokens']:,} "
            "tokens) to keep it"
        )
    return lines


def _say_losses(folder: Path, n: int, log) -> None:
    try:
        info = json.loads((folder / "info.json").read_text())
    except (OSError, ValueError):
        return
    for split in ("train", "eval"):
        said = info.get(split) or {}
        if "prompts" in said:
            continue  # prompts cut nothing but their starts, said when prepared
        for line in (pair_lines if "pairs" in said else loss_lines)(said, n):
            log(line)


def _single(table: pa.Table, n: int) -> pa.Table:
    """One record per sequence, truncated to n tokens."""
    ids = pc.list_slice(table.column("input_ids"), 0, n)
    labels = pc.list_slice(table.column("labels"), 0, n)
    return pa.table({"input_ids": ids, "labels": labels, "seq_lengths": _one_length(ids)})


def _whole(table: pa.Table, n: int) -> pa.Table:
    """Wrapped sequences are one stream: a single position run per full sequence.

    Each batch's ragged tail is dropped, unless the batch has nothing else.
    """
    full = pc.equal(pc.list_value_length(table.column("input_ids")), n)
    if pc.any(full).as_py():
        table = table.filter(full)
    table = table.filter(tokenize.learnable(table))  # a chunk can be all prompt
    return table.append_column("seq_lengths", _one_length(table.column("input_ids")))


def _one_length(ids: pa.ChunkedArray) -> pa.Array:
    """A one-element seq_lengths list per row: the row is one position run."""
    lengths = pc.list_value_length(ids).combine_chunks().cast(pa.int32())
    offsets = pa.array(np.arange(len(lengths) + 1, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, lengths)


def _map_in_shards(table, fn, fn_kwargs: dict, tag: str, meter: Meter) -> list:
    """``fn`` over the records (``datasets.map``, batched, over Arrow, in worker processes
    when there are many), SHARD records at a time so that the meter moves between them."""
    procs, parts = _processes(len(table)), []
    for start in range(0, len(table), SHARD):
        part = table.select(range(start, min(start + SHARD, len(table)))).with_format("arrow")
        parts.append(
            part.map(
                fn,
                batched=True,
                num_proc=procs,
                fn_kwargs=fn_kwargs,
                remove_columns=part.column_names,
                new_fingerprint=f"{tag}-{start}",  # hashing a tokenizer is slow
            )
        )
        meter.update(start + len(part), force=True)
    return parts


def _processes(count: int) -> int | None:
    # The pod's CPUs (its affinity set), and none for small sets where a pool costs more.
    if count < 5_000:
        return None
    return max(1, min(len(os.sched_getaffinity(0)), 32))


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


class Meter:
    """Progress of one stage: a log line and an on_progress call every few seconds."""

    EVERY_S = 10.0

    def __init__(self, stage: str, total: int | None, log, on_progress: Progress):
        self.stage, self.total, self.log, self.on_progress = stage, total, log, on_progress
        self.start = self.last = time.monotonic()

    def update(self, done: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.EVERY_S:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = (self.total - done) / rate if self.total and rate > 0 else None
        self.on_progress(
            {"stage": self.stage, "records": done, "total": self.total,
             "recordsPerSecond": round(rate, 1), "etaSeconds": None if eta is None else round(eta)}
        )  # fmt: skip
        if done:
            of = f"/{self.total:,}" if self.total else ""
            left = f", about {eta:.0f} s left" if eta is not None and done != self.total else ""
            self.log(f"data: {self.stage} {done:,}{of} records, {rate:,.0f} records/s{left}")

    def done(self, count: int) -> None:
        self.update(count, force=True)
