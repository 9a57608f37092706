"""trainer/data/prepare.py: packing that keeps documents apart, real chat templates, the prepared
data's key and reuse, ranks waiting for rank 0, the eval cap.

python -m pytest tests/unit/test_trainer_prepare.py -q
"""

from __future__ import annotations

import copy
import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from ftjob.api.jobspec import parse_spec
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import prepare, tokenize
from ftjob.trainer.data.batches import IGNORE, DataError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What colour is snow?"},
    {"role": "assistant", "content": "Snow is white."},
    {"role": "user", "content": "And grass?"},
    {"role": "assistant", "content": "Grass is green."},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(EXAMPLES / "tiny-model")


def spec(source, training=None, **dataset):
    return parse_spec(
        {
            "model": {"source": str(EXAMPLES / "tiny-model")},
            "dataset": {"source": str(source), **dataset},
            "training": {"maxSteps": 1, **(training or {})},
        }
    )


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def quiet(*_):
    pass


# ------------------------------------------------------------------------------ packing


def per_token_loss(model, rows, pad_id) -> list[torch.Tensor]:
    """Per-row losses of the labelled tokens, through the trainer's own collate."""
    batch = data.collate(rows, pad_id)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
        ).logits
    target = batch.labels[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), target, ignore_index=IGNORE,
                           reduction="none")  # fmt: skip
    return [loss[r][target[r] != IGNORE] for r in range(len(rows))]


def test_a_packed_sequence_has_the_loss_of_its_documents_run_one_by_one(tok, tmp_path):
    texts = [{"text": f"Doc {n}: " + "the cat sat on the mat. " * (n % 3 + 1)} for n in range(12)]
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    packed = data.load(spec(path, maxSeqLength=128), tok, tmp_path / "p", log=quiet).train
    row = max(packed.rows(range(len(packed))), key=lambda r: len(r["seq_lengths"]))
    assert len(row["seq_lengths"]) >= 3  # several documents share this sequence

    model = AutoModelForCausalLM.from_pretrained(
        EXAMPLES / "tiny-model", dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    docs, start = [], 0
    for n in row["seq_lengths"]:
        ids, labels = row["input_ids"][start : start + n], row["labels"][start : start + n]
        docs.append({"input_ids": ids, "labels": labels, "seq_lengths": [n]})
        start += n
    alone = torch.cat([per_token_loss(model, [d], tok.pad_token_id)[0] for d in docs])
    (together,) = per_token_loss(model, [row], tok.pad_token_id)
    assert together.shape == alone.shape and alone.numel() > 50
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)

    # The same tokens with one position run (documents attending to each other) differ:
    # the comparison above can fail.
    (leaky,) = per_token_loss(model, [{**row, "seq_lengths": [len(row["input_ids"])]}],
                              tok.pad_token_id)  # fmt: skip
    assert (leaky - alone).abs().max() > 1e-3


def test_padding_in_a_batch_does_not_change_a_sequences_loss(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c " * n} for n in (2, 9)])
    train = data.load(spec(path, packing=False), tok, tmp_path / "p", log=quiet).train
    model = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model", dtype=torch.float32)
    short, long = sorted(train.rows([0, 1]), key=lambda r: len(r["input_ids"]))
    (alone,) = per_token_loss(model.eval(), [short], tok.pad_token_id)
    padded, _ = per_token_loss(model, [short, long], tok.pad_token_id)
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ chat templates


def test_generation_markers_are_the_block_tag_not_add_generation_prompt():
    assert tokenize.has_generation_markers("{%- generation %}{{ x }}{% endgeneration %}")
    assert tokenize.has_generation_markers("{% generation -%}x{%- endgeneration %}")
    assert not tokenize.has_generation_markers("{% if add_generation_prompt %}<|a|>{% endif %}")
    assert not tokenize.has_generation_markers(None)


@pytest.mark.parametrize("family", ["llama3", "qwen2_5"])
def test_real_family_templates_learn_the_assistant_turns_only(tok, tmp_path, family):
    """A model shipping its family's plain template (no markers) gets TRL's training one."""
    from trl import chat_template_utils

    shipped = getattr(chat_template_utils, f"{family}_chat_template")
    assert not tokenize.has_generation_markers(shipped)  # what the models ship
    family_tok = copy.deepcopy(tok)
    family_tok.chat_template = shipped
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    s = spec(path, format="chat", packing=False, maxSeqLength=1024)
    train = data.load(s, family_tok, tmp_path / "job", log=quiet).train
    (row,) = train.rows(range(len(train)))
    learned = family_tok.decode([t for t in row["labels"] if t != IGNORE])
    everything = family_tok.decode(row["input_ids"])
    assert "Snow is white." in learned and "Grass is green." in learned
    assert "What colour" not in learned and "one sentence" not in learned
    assert "What colour" in everything and "one sentence" in everything


def test_a_template_without_markers_and_unknown_to_trl_is_refused_with_the_fix(tok, tmp_path):
    plain = copy.deepcopy(tok)
    template = tok.chat_template.replace("{%- generation %}", "").replace("{% endgeneration %}", "")
    plain.chat_template = template
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError) as e:
        data.load(spec(path, format="chat"), plain, tmp_path / "job", log=quiet)
    assert "no {% generation %} markers" in str(e.value)
    assert "dataset.completionOnlyLoss: false" in str(e.value)
    # ... and the fix it names works.
    s = spec(path, format="chat", completionOnlyLoss=False, packing=False)
    assert len(data.load(s, plain, tmp_path / "job2", log=quiet).train) == 1


def test_usual_formats_prepare_unicode_long_multiturn(tok, tmp_path):
    long_text = "Ünïcødé ✓ 日本語 — " + "lorem ipsum " * 3000
    cases = {
        "text": [{"text": "naïve café 🚀"}, {"text": long_text}],
        "instruction": [
            {"prompt": "Ω?", "completion": " ∞ " * 2000},
            {"prompt": "é", "completion": "ß"},
        ],
        "chat": [{"messages": CHAT}, {"messages": CHAT[1:3]}],
    }
    for fmt, rows in cases.items():
        path = write_jsonl(tmp_path / f"{fmt}.jsonl", rows)
        for packing in (True, False):
            s = spec(path, format=fmt, packing=packing, maxSeqLength=256)
            train = data.load(s, tok, tmp_path / f"{fmt}-{packing}", log=quiet).train
            lengths = [len(ids) for ids in train.column("input_ids")]
            assert lengths and max(lengths) <= 256, (fmt, packing)
    s = spec(tmp_path / "text.jsonl", packing=False)
    first = data.load(s, tok, tmp_path / "t", log=quiet).train.rows([0])[0]
    assert "🚀" in tok.decode(first["input_ids"])


# ------------------------------------------------------------------------------ key and reuse


def test_prepared_data_is_reused_and_rebuilt_when_tokens_would_change(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"a cat has {n} legs"} for n in range(40)])
    root = tmp_path / "data"
    said = []
    first = prepare.prepare(spec(path), tok, root, log=said.append)
    stamp = (first / "info.json").stat().st_mtime_ns
    assert prepare.prepare(spec(path), tok, root, log=said.append) == first
    assert (first / "info.json").stat().st_mtime_ns == stamp and "reusing" in said[-1]
    # Settings that do not change tokens keep the key; those that do change it.
    assert prepare.key(spec(path, training={"maxSteps": 7}), tok) == first.name
    assert prepare.key(spec(path, maxSeqLength=64), tok) != first.name
    assert prepare.key(spec(path, training={"seed": 3}), tok) != first.name
    assert prepare.key(spec(path, packingStrategy="wrapped"), tok) != first.name
    write_jsonl(path, [{"text": "a dog"}])
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    assert prepare.key(spec(path), tok) != first.name
    assert not list(root.glob(".*tmp*"))  # no temporary folders left behind


def test_other_ranks_wait_for_rank_zero_and_map_the_same_data(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"a cat has {n} legs"} for n in range(40)])
    s = spec(path)
    got = {}
    waiter = threading.Thread(
        target=lambda: got.update(rank1=data.load(s, tok, tmp_path, is_main=False, log=quiet))
    )
    waiter.start()
    rank0 = data.load(s, tok, tmp_path, log=quiet)
    waiter.join(timeout=60)
    assert got["rank1"].train.column("input_ids") == rank0.train.column("input_ids")


def test_a_bad_record_fails_before_tokenizing_and_leaves_nothing(tok, tmp_path):
    rows = [{"text": "fine"}] * 1000 + [{"body": "no text"}] + [{"text": "fine"}] * 1000
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    progress = []
    with pytest.raises(DataError, match=r"d.jsonl line 1001: has no field 'text'"):
        data.load(spec(path), tok, tmp_path / "job", log=quiet, on_progress=progress.append)
    assert all(p["stage"] == "reading" for p in progress)  # tokenizing never started
    assert not any((tmp_path / "job" / "data").iterdir())


# ------------------------------------------------------------------------------ eval cap


def test_eval_is_capped_and_the_log_says_how_many(tok, tmp_path):
    source = EXAMPLES / "data" / "tiny-text.jsonl"
    said = []
    s = spec(source, maxSeqLength=32, evalFraction=0.2, maxEvalSequences=5)
    assert len(data.load(s, tok, tmp_path, log=said.append).eval) == 5
    assert any("evaluating 5 of " in line and "maxEvalSequences" in line for line in said)
    assert spec(source).dataset.max_eval_sequences == 1000  # the documented default


def test_progress_reports_rate_and_eta(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"n {n}"} for n in range(100)])
    progress = []
    data.load(spec(path), tok, tmp_path, log=quiet, on_progress=progress.append)
    tokenizing = [p for p in progress if p["stage"] == "tokenizing"]
    assert tokenizing[-1]["records"] == tokenizing[-1]["total"] == 100
    assert tokenizing[-1]["recordsPerSecond"] > 0 and tokenizing[-1]["etaSeconds"] == 0


@pytest.mark.parametrize(
    ("fmt", "row", "fix"),
    [
        ("chat", {"conversations": [{"role": "user", "content": "hi"}]},
         "set dataset.messagesField: conversations"),
        ("chat", {"conversations": [{"from": "human", "value": "hi"}]},
         "set dataset.messagesField: conversations (its messages have ['from', 'value']; "
         "each needs role and content)"),
        ("text", {"id": 3, "content": "a story"}, "set dataset.textField: content"),
        ("text", {"id": 3, "body_text": "a story"}, "set dataset.textField: body_text"),
        ("instruction", {"instruction": "Add 2 and 2.", "completion": "4"},
         "set dataset.promptField: instruction"),
        ("instruction", {"prompt": "Add 2 and 2.", "output": "4", "source": "x"},
         "set dataset.completionField: output"),
        ("text", {"a": "one", "b": "two"},
         "set spec.dataset.textField to the field that holds it, or fix the records of "
         "spec.dataset.source"),
    ],
)  # fmt: skip
def test_a_missing_field_gets_the_knob_to_set_when_the_record_has_a_likely_one(
    tok, tmp_path, fmt, row, fix
):
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError, match=r"d.jsonl line 1: has no field") as caught:
        data.load(spec(path, format=fmt), tok, tmp_path / "job", log=quiet)
    assert caught.value.fix == fix
