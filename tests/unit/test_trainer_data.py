"""trainer/data/batches.py + prepare.py: reading, masking, packing, batch order, data errors.

python -m pytest tests/unit/test_trainer_data.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from ftjob.api.jobspec import parse_spec
from ftjob.trainer.data import batches as data
from ftjob.trainer.data.batches import IGNORE, DataError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(EXAMPLES / "tiny-model")


def spec(source, **dataset):
    return parse_spec(
        {
            "model": {"source": str(EXAMPLES / "tiny-model")},
            "dataset": {"source": str(source), **dataset},
            "training": {"maxSteps": 1},
        }
    )


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def decoded_labels(tok, row) -> str:
    return tok.decode([t for t in row["labels"] if t != IGNORE])


def load(s, tok, job_dir: Path) -> data.Data:
    return data.load(s, tok, job_dir, log=lambda _: None)


def as_rows(table: data.Sequences) -> list[dict]:
    return table.rows(range(len(table)))


# ------------------------------------------------------------------------------ formats


def test_text_learns_every_token_and_ends_with_eos(tok, tmp_path):
    s = spec(write_jsonl(tmp_path / "t.jsonl", [{"text": "A dog barks."}]), packing=False)
    (ex,) = as_rows(load(s, tok, tmp_path / "job").train)
    # The first label is never a target: alone nothing precedes it, packed it must not be
    # predicted from the previous document.
    assert ex["labels"] == [IGNORE] + ex["input_ids"][1:]
    assert ex["input_ids"][0] == tok.bos_token_id and ex["input_ids"][-1] == tok.eos_token_id


def test_chat_learns_assistant_turns_only(tok, tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "What colour is snow?"},
                {"role": "assistant", "content": "Snow is white."},
            ]
        }
    ]
    s = spec(write_jsonl(tmp_path / "c.jsonl", rows), format="chat", packing=False)
    (ex,) = as_rows(load(s, tok, tmp_path / "job").train)
    assert decoded_labels(tok, ex) == "Snow is white.<|eos|>"
    assert "What colour" in tok.decode(ex["input_ids"])
    s = spec(tmp_path / "c.jsonl", format="chat", packing=False, completionOnlyLoss=False)
    (ex,) = as_rows(load(s, tok, tmp_path / "job").train)
    assert ex["labels"][1:] == ex["input_ids"][1:]


def test_instruction_learns_the_completion_only(tok, tmp_path):
    rows = [{"prompt": "Question: What is 2 + 2?\nAnswer:", "completion": " 4"}]
    s = spec(write_jsonl(tmp_path / "i.jsonl", rows), format="instruction", packing=False)
    (ex,) = as_rows(load(s, tok, tmp_path / "job").train)
    assert decoded_labels(tok, ex) == " 4<|eos|>"
    assert ex["labels"][0] == IGNORE


def test_wrapped_packing_makes_full_sequences_with_masks_kept(tok, tmp_path):
    source = EXAMPLES / "data" / "tiny-instruct.jsonl"
    s = spec(source, format="instruction", maxSeqLength=64, packingStrategy="wrapped")
    train = as_rows(load(s, tok, tmp_path / "job").train)
    assert len(train) > 10 and all(len(e["input_ids"]) == 64 == len(e["labels"]) for e in train)
    assert any(t == IGNORE for e in train for t in e["labels"])  # prompts stay masked


def test_bfd_packing_keeps_whole_documents_in_one_sequence(tok, tmp_path):
    rows_in = [{"text": "word " * n} for n in (3, 20, 7, 40, 12, 2, 30)]
    path = write_jsonl(tmp_path / "d.jsonl", rows_in)
    alone = {
        tuple(e["input_ids"])
        for e in as_rows(
            load(spec(path, packing=False, maxSeqLength=64), tok, tmp_path / "a").train
        )
    }
    packed = as_rows(load(spec(path, maxSeqLength=64), tok, tmp_path / "b").train)
    assert len(packed) < len(rows_in)  # several documents share a sequence
    pieces = set()
    for e in packed:
        assert sum(e["seq_lengths"]) == len(e["input_ids"]) <= 64
        start = 0
        for n in e["seq_lengths"]:
            pieces.add(tuple(e["input_ids"][start : start + n]))
            assert e["labels"][start] == IGNORE  # never predicted from the previous document
            start += n
    assert pieces == alone  # every document is there, whole, exactly once


def test_records_with_nothing_to_learn_within_the_sequence_are_dropped(tok, tmp_path):
    rows = [
        {"prompt": "q " * 60, "completion": " late answer"},  # completion after token 32
        {"prompt": "Q:", "completion": " short answer"},
    ]
    path = write_jsonl(tmp_path / "i.jsonl", rows)
    for packing in ({"packing": False}, {"packingStrategy": "bfd"}):
        s = spec(path, format="instruction", maxSeqLength=32, **packing)
        train = as_rows(load(s, tok, tmp_path / str(packing)).train)
        assert [decoded_labels(tok, r) for r in train] == [" short answer<|eos|>"], packing
    # Wrapped sequences continue a record into the next sequence: its answer is learned, and
    # no sequence of prompt alone is kept.
    s = spec(path, format="instruction", maxSeqLength=32, packingStrategy="wrapped")
    train = as_rows(load(s, tok, tmp_path / "wrapped").train)
    assert "late answer" in "".join(decoded_labels(tok, r) for r in train)
    assert all(any(t != IGNORE for t in r["labels"]) for r in train)
    # With no record left, the error says why.
    only = write_jsonl(tmp_path / "only.jsonl", rows[:1])
    message = load_error(tok, spec(only, format="instruction", maxSeqLength=32, packing=False))
    assert message == f"{only}: no record has a token to learn from (all labels masked)"


def test_eval_fraction_holds_out_records_deterministically(tok, tmp_path):
    source = EXAMPLES / "data" / "tiny-text.jsonl"
    s = spec(source, maxSeqLength=64, evalFraction=0.1)
    a, b = load(s, tok, tmp_path / "a"), load(s, tok, tmp_path / "b")  # prepared twice
    assert len(a.eval) and as_rows(a.eval) == as_rows(b.eval)
    assert as_rows(a.train) == as_rows(b.train)
    train_tokens = sum(len(r["input_ids"]) for r in as_rows(a.train))
    eval_tokens = sum(len(r["input_ids"]) for r in as_rows(a.eval))
    assert 0.05 < eval_tokens / (train_tokens + eval_tokens) < 0.15


@pytest.mark.parametrize("kind", ["parquet", "csv", "json", "saved"])
def test_other_sources_read_the_same_records(tok, tmp_path, kind):
    import datasets

    rows = [{"text": f"A cat has {n} legs."} for n in range(5)]
    table = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        table.to_parquet(str(tmp_path / "d.parquet"))
        source = tmp_path / "d.parquet"
    elif kind == "csv":
        table.to_csv(str(tmp_path / "d.csv"), index=False)
        source = tmp_path / "d.csv"
    elif kind == "json":
        (tmp_path / "d.json").write_text(json.dumps(rows))
        source = tmp_path / "d.json"
    else:
        datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved"))
        source = tmp_path / "saved"
    reference = spec(write_jsonl(tmp_path / "ref.jsonl", rows), packing=False)
    got = load(spec(source, packing=False), tok, tmp_path / "a").train
    assert got.column("input_ids") == load(reference, tok, tmp_path / "b").train.column("input_ids")


def test_relative_sources_resolve_against_the_source_root(tok, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "rel.jsonl", [{"text": "A cow moos."}])
    monkeypatch.setenv("FTJOB_SOURCE_ROOT", str(tmp_path))
    assert len(load(spec("rel.jsonl", packing=False), tok, tmp_path / "job").train) == 1


# ------------------------------------------------------------------------------ batch order


def test_batch_order_is_a_pure_function_of_seed_and_step():
    a = data.Sampler(n=50, seed=7, world=2, micro_batch=3, accumulation=2)
    b = data.Sampler(n=50, seed=7, world=2, micro_batch=3, accumulation=2)
    # A fresh sampler (a resumed run) asked for step 9 first gives what the first run had.
    late = b.indices(9, 1, 1)
    seen = [a.indices(step, m, r) for step in range(10) for m in range(2) for r in range(2)]
    assert seen[-1] == late
    # Within an epoch every record comes once, ranks never share one.
    first_epoch = [i for batch in seen for i in batch][:50]
    assert sorted(first_epoch) == list(range(50))
    assert data.Sampler(50, 8, 2, 3, 2).indices(0, 0, 0) != a.indices(0, 0, 0)
    assert a.steps_for(1.0) == 5 and a.steps_for(2.5) == 11


def test_eval_batches_are_even_across_ranks(tok, tmp_path):
    rows = [{"text": f"a cat has {n} legs"} for n in range(50)]
    s = spec(write_jsonl(tmp_path / "d.jsonl", rows), packing=False, evalFraction=0.1)
    ds = load(s, tok, tmp_path / "job")  # the real prepare: 5 eval sequences
    assert len(ds.eval) == 5
    rank0, rank1 = data.eval_batches(ds, 0, 2, 2), data.eval_batches(ds, 1, 2, 2)
    assert len(rank0) == len(rank1) == 2  # FSDP needs every rank in every forward
    # Every eval sequence's labels are counted once, none twice, the filler batch none.
    labelled = sum(int((b.labels != IGNORE).sum()) for b in rank0 + rank1)
    assert labelled == sum(t != IGNORE for r in as_rows(ds.eval) for t in r["labels"])


def test_collate_pads_and_masks(tok):
    batch = data.collate(
        [
            {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7], "seq_lengths": [1, 2]},
            {"input_ids": [8], "labels": [IGNORE], "seq_lengths": [1]},
        ],
        tok.pad_token_id,
    )
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.labels.tolist() == [[IGNORE, 6, 7], [IGNORE, IGNORE, IGNORE]]
    # Positions restart per document; the padding is a document of its own.
    assert batch.position_ids.tolist() == [[0, 0, 1], [0, 0, 1]]
    # The same documents over the flattened 2 x 3 tokens, as varlen attention takes them.
    assert batch.cu_seqlens.tolist() == [0, 1, 3, 4, 6] and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 2
    # Host counts: real tokens, next-token targets, attention of real documents only.
    assert (batch.tokens, batch.labelled, batch.attention_sq) == (4, 2, 1 + 4 + 1)


def test_flat_collate_runs_the_real_tokens_as_one_row(tok):
    rows = [
        {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7], "seq_lengths": [1, 2]},
        {"input_ids": [8, 9], "labels": [8, 9], "seq_lengths": [2]},  # first label not masked
    ]
    batch = data.collate(rows, tok.pad_token_id, flat=True)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9]]  # no padding
    # A row's first label is never a target, as in the padded layout: 7 predicts nothing.
    assert batch.labels.tolist() == [[IGNORE, 6, 7, IGNORE, 9]]
    assert batch.position_ids.tolist() == [[0, 0, 1, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 1, 3, 5] and batch.max_seqlen == 2
    padded = data.collate(rows, tok.pad_token_id)
    assert (batch.tokens, batch.labelled, batch.attention_sq) == (
        padded.tokens, padded.labelled, padded.attention_sq) == (5, 3, 1 + 4 + 4)  # fmt: skip


def test_collate_counts_match_the_tensors_on_a_real_packed_batch(tok, tmp_path):
    texts = [{"text": f"Doc {n}: " + "the cat sat. " * (n % 7 + 1)} for n in range(40)]
    ds = load(spec(write_jsonl(tmp_path / "d.jsonl", texts), maxSeqLength=64), tok, tmp_path / "j")
    rows = ds.rows(range(4))
    batch = data.collate(rows, ds.pad_id)
    assert batch.labelled == int((batch.labels[:, 1:] != IGNORE).sum())
    assert batch.tokens == sum(len(r["input_ids"]) for r in rows)
    assert batch.attention_sq == sum(n * n for r in rows for n in r["seq_lengths"])
    # cu_seqlens starts a document exactly where a position restarts at 0.
    flat = batch.position_ids.reshape(-1)
    assert batch.cu_seqlens[:-1].tolist() == (flat == 0).nonzero().flatten().tolist()
    assert batch.cu_seqlens[-1] == batch.input_ids.numel()
    assert batch.max_seqlen == int(batch.cu_seqlens.diff().max())
    # Without CUDA pinning is a no-op; to() moves the tensors and keeps the host counts.
    moved = batch.pin().to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.labelled == batch.labelled


def test_collate_refuses_lengths_that_do_not_add_up(tok):
    with pytest.raises(DataError, match=r"seq_lengths \[2\] do not add up to its 3 tokens"):
        data.collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "seq_lengths": [2]}], 0)


# ------------------------------------------------------------------------------ bad data


def load_error(tok, s) -> str:
    with pytest.raises(DataError) as e:
        load(s, tok, Path(s.dataset.source).parent / "job")
    return str(e.value)


def test_invalid_json_names_file_and_line(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": nope}\n')
    assert (
        load_error(tok, spec(path))
        == f"{path} line 3: not valid JSON at column 10 (Expecting value)"
    )


def test_a_line_cut_short_is_named_at_its_end_not_column_1(tok, tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "a cat", "n": 1\n{"text": "b"}\n')
    assert load_error(tok, spec(path)) == (
        f"{path} line 2: not valid JSON at column 25 (Expecting ',' delimiter) (the line ends "
        "before the JSON does: cut short?)"
    )


def test_invalid_utf8_names_file_and_line(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert load_error(tok, spec(path)).startswith(f"{path} line 2: not valid UTF-8")


def test_missing_field_names_record_and_knob(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"body": "b"}])
    message = load_error(tok, spec(path))
    assert message == f"{path} line 2: has no field 'text' (dataset.textField); it has ['body']"
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user"}]}])
    assert "line 1: each message needs a role and a string content" in load_error(
        tok, spec(path, format="chat")
    )


def test_empty_set_is_refused(tok, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert load_error(tok, spec(path)) == f"{path}: holds no records"


def test_every_sequence_too_long_without_packing_is_refused(tok, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": "word " * 40}] * 3)
    message = load_error(tok, spec(path, packing=False, maxSeqLength=16))
    assert message.startswith(f"{path}: every record is longer than dataset.maxSeqLength=16")
    # with packing the same records are fine
    assert load(spec(path, packing=True, maxSeqLength=16), tok, tmp_path / "job").train


def test_a_single_file_has_no_eval_split(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    assert "has no split 'test'" in load_error(tok, spec(path, evalSplit="test"))


def test_unknown_file_type_and_missing_file(tok, tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    assert "unknown file type" in load_error(tok, spec(tmp_path / "d.txt"))
    assert "no such file" in load_error(tok, spec(tmp_path / "nope.jsonl"))


def test_csv_values_are_read_as_the_text_they_hold(tmp_path):
    """An answer that looks like a number (" 40.") is the text a model learns, not 40.0; a
    wrong type elsewhere names the value and the fix."""
    from ftjob.trainer.data import records

    csv = 'prompt,completion\n"How many legs have 10 spiders?"," 80."\nAnd 10 cats?,40\n'
    (tmp_path / "qa.csv").write_text(csv)
    source = {"source": str(tmp_path / "qa.csv"), "format": "instruction"}
    raw = {"model": {"source": "m"}, "training": {"maxSteps": 1}, "dataset": source}
    ds = parse_spec(raw).dataset
    rows = [r for b in records.batches(ds, "train") for r in b.to_pylist()]
    assert [r["completion"] for r in rows] == [" 80.", "40"]
    assert rows[1]["prompt"] == "And 10 cats?"
    with pytest.raises(DataError) as e:
        records.normalize({"prompt": "p", "completion": 40.0}, ds, "d.jsonl line 3")
    assert "field 'completion' must be a str, got a float (40.0)" in str(e.value)
    assert e.value.fix.startswith("make field 'completion' a str in that record")


def test_ftjob_runs_record_check_reads_the_first_records_only(tmp_path, monkeypatch):
    """`ftjob run` names a bad record in the first CHECKED at once; past them, the trainer
    does (a 10 GB file read whole before every run, a resume too, would be minutes)."""
    from ftjob.trainer.data import records

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good] * 5 + [{"conversation": []}])
    ds = spec(str(path), format="chat").dataset
    with pytest.raises(DataError, match="line 6: has no field 'messages'"):
        records.check(ds)
    monkeypatch.setattr(records, "CHECKED", 5)
    assert records.check(ds) == 5  # the sixth, bad, record is the trainer's to find
