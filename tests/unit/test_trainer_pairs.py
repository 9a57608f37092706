"""Preference data prepared once (trainer/data/prepare.py + trainer/data/pairs.py): tokenized pairs
in
the three layouts (text, conversations, implicit prompt), truncation that keeps the responses,
bad pairs refused naming file and line, and micro-batches that hold whole pairs.

python -m pytest tests/unit/test_trainer_pairs.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ftjob.api.jobspec import parse_spec
from ftjob.trainer.data import batches as data
from ftjob.trainer.data import pairs, prepare
from ftjob.trainer.data.batches import IGNORE, DataError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
USER = {"role": "user", "content": "What colour is the sky?"}


def said(content):
    return {"role": "assistant", "content": content}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(EXAMPLES / "tiny-model")


def spec(source, **dataset):
    return parse_spec(
        {
            "model": {"source": str(EXAMPLES / "tiny-model")},
            "dataset": {"source": str(source), "format": "preference", **dataset},
            "training": {"objective": "dpo", "maxSteps": 1},
        }
    )


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def quiet(*_):
    pass


def prepared(tok, tmp_path, rows, **dataset) -> list[dict]:
    s = spec(write_jsonl(tmp_path / "pairs.jsonl", rows), **dataset)
    loaded = data.load(s, tok, tmp_path / "job", log=quiet)
    return loaded.train.rows(range(len(loaded.train)))


def text(tok, ids) -> str:
    return tok.decode(ids)


# ------------------------------------------------------------------------------ layouts


def test_text_pairs_keep_prompt_and_responses_apart_each_response_ends_with_eos(tok, tmp_path):
    rows = [{"prompt": "Q: the sky? A:", "chosen": " blue", "rejected": " green"}]
    (pair,) = prepared(tok, tmp_path, rows)
    assert text(tok, pair["prompt_ids"]) == "<|bos|>Q: the sky? A:"
    assert text(tok, pair["chosen_ids"]) == " blue<|eos|>"
    assert text(tok, pair["rejected_ids"]) == " green<|eos|>"
    assert pair["line"] == 1


def test_field_names_are_configurable(tok, tmp_path):
    rows = [{"q": "Q: the sky? A:", "good": " blue", "bad": " green"}]
    (pair,) = prepared(
        tok, tmp_path, rows, promptField="q", chosenField="good", rejectedField="bad"
    )
    assert text(tok, pair["chosen_ids"]) == " blue<|eos|>"


def test_conversations_render_with_the_chat_template_and_the_prompt_asks_for_an_answer(
    tok, tmp_path
):
    rows = [{"prompt": [USER], "chosen": [said("Blue.")], "rejected": [said("Green.")]}]
    (pair,) = prepared(tok, tmp_path, rows)
    whole = tok.apply_chat_template([USER, said("Blue.")], tokenize=True, return_dict=True)
    assert pair["prompt_ids"] + pair["chosen_ids"] == list(whole["input_ids"])
    assert text(tok, pair["prompt_ids"]).endswith("<|assistant|>\n")
    assert text(tok, pair["chosen_ids"]).startswith("Blue.<|eos|>")
    assert text(tok, pair["rejected_ids"]).startswith("Green.<|eos|>")


def test_an_implicit_prompt_is_what_chosen_and_rejected_share(tok, tmp_path):
    conversation = {"chosen": [USER, said("Blue.")], "rejected": [USER, said("Green.")]}
    plain = {"chosen": "Q: the sky? A: blue", "rejected": "Q: the sky? A: green"}
    explicit = {"prompt": [USER], "chosen": [said("Blue.")], "rejected": [said("Green.")]}
    implicit_chat, implicit_text = prepared(tok, tmp_path, [conversation, plain])
    (tmp_path / "explicit").mkdir()
    (reference,) = prepared(tok, tmp_path / "explicit", [explicit])
    assert {k: implicit_chat[k] for k in pairs.COLUMNS[1:]} == {
        k: reference[k] for k in pairs.COLUMNS[1:]
    }
    assert text(tok, implicit_text["prompt_ids"]) == "<|bos|>Q: the sky? A:"
    assert text(tok, implicit_text["chosen_ids"]) == " blue<|eos|>"


# ------------------------------------------------------------------------------ truncation


def test_truncation_cuts_the_prompt_start_keeps_the_responses_and_is_counted(tok, tmp_path):
    long_prompt = "Q: " + " ".join(f"w{i}" for i in range(60)) + " A:"
    rows = [
        {"prompt": long_prompt, "chosen": " blue sky", "rejected": " green"},
        {"prompt": "Q: ok? A:", "chosen": " yes", "rejected": " no"},
    ]
    full = [len(tok(long_prompt)["input_ids"]), len(tok(long_prompt + " blue sky")["input_ids"])]
    cut, short = prepared(tok, tmp_path, rows, maxSeqLength=16)
    assert full[1] + 1 > 16  # the pair does not fit as it is
    assert text(tok, cut["chosen_ids"]) == " blue sky<|eos|>"  # responses whole
    assert text(tok, cut["rejected_ids"]) == " green<|eos|>"
    assert len(cut["prompt_ids"]) + len(cut["chosen_ids"]) == 16  # the prompt's end kept
    assert text(tok, cut["prompt_ids"]).endswith(" A:")
    assert text(tok, short["prompt_ids"]) == "<|bos|>Q: ok? A:"  # untouched
    info = json.loads(next((tmp_path / "job" / "data").glob("*/info.json")).read_text())["train"]
    assert info["cutPromptPairs"] == 1
    assert info["cutPromptTokens"] == full[0] - len(cut["prompt_ids"])
    assert info["cutResponsePairs"] == 0 and info["pairs"] == 2
    assert info["longestPairTokens"] == full[1] + 1  # as the record was: + eos
    lines = prepare.pair_lines(info, 16)
    assert len(lines) == 1 and "1 of 2 pairs had their prompt's start cut" in lines[0]


def test_a_response_longer_than_the_sequence_keeps_its_start_and_one_prompt_token():
    (prompt, chosen, rejected), cut_prompt, cut_response = pairs.fit(
        [1, 2, 3], list(range(10, 30)), [40, 41], 8
    )
    assert (prompt, chosen, rejected) == ([3], list(range(10, 17)), [40, 41])
    assert (cut_prompt, cut_response) == (2, 13)


# ------------------------------------------------------------------------------ bad pairs


def error(tok, tmp_path, rows, **dataset) -> DataError:
    with pytest.raises(DataError) as e:
        prepared(tok, tmp_path, rows, **dataset)
    return e.value


GOOD = {"prompt": "Q: x? A:", "chosen": " a", "rejected": " b"}


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"prompt": "Q: x? A:", "chosen": " a", "rejected": " a"}, "are equal"),
        ({"prompt": "Q: x? A:", "chosen": " a", "rejected": "  "}, "'rejected' has an empty"),
        ({"prompt": "Q", "chosen": [said("a")], "rejected": [said("b")]}, "same kind"),
        ({"chosen": "Q: x? A: a", "rejected": "Q: x? A: a b"}, "'chosen' has an empty"),
        ({"chosen": "yes", "rejected": "no"}, "share no start"),
        ({"prompt": "Q", "chosen": " a"}, "has no field 'rejected' (dataset.rejectedField)"),
    ],
)
def test_a_bad_pair_fails_naming_file_and_line(tok, tmp_path, bad, says):
    e = error(tok, tmp_path, [GOOD, GOOD, bad])
    assert f"{tmp_path / 'pairs.jsonl'} line 3: " in str(e) and says in str(e)
    assert e.fix


def test_a_pair_whose_responses_become_equal_when_cut_fails_naming_file_and_line(tok, tmp_path):
    """Two responses that differ only past maxSeqLength are the same once fitted."""
    same_start = " ".join(f"w{i}" for i in range(40))
    bad = {"prompt": "Q: x? A:", "chosen": f" {same_start} yes", "rejected": f" {same_start} no"}
    (tmp_path / "fits").mkdir()
    prepared(tok, tmp_path / "fits", [GOOD, bad], maxSeqLength=256)  # whole, they differ
    e = error(tok, tmp_path, [GOOD, GOOD, bad], maxSeqLength=16)
    assert f"{tmp_path / 'pairs.jsonl'} line 3: " in str(e)
    assert "same tokens once cut to dataset.maxSeqLength 16" in str(e)
    assert "spec.dataset.maxSeqLength" in e.fix


def test_a_missing_response_field_suggests_the_likely_one(tok, tmp_path):
    e = error(tok, tmp_path, [{"prompt": "Q", "preferred": " a", "rejected": " b"}])
    assert e.fix == "set dataset.chosenField: preferred"


# ------------------------------------------------------------------------------ batches


def test_a_micro_batch_holds_whole_pairs_chosen_rows_then_rejected_rows(tok, tmp_path):
    rows = [
        {"prompt": "Q: the sky? A:", "chosen": " blue", "rejected": " a green one"},
        {"prompt": "Q: ok? A:", "chosen": " yes", "rejected": " no"},
    ]
    got = prepared(tok, tmp_path, rows)
    batch = data.collate(pairs.rows(got, shared=False), tok.pad_token_id)
    assert batch.input_ids.shape[0] == 4
    for i, pair in enumerate(got):
        for row, side in ((i, "chosen_ids"), (2 + i, "rejected_ids")):
            n = len(pair["prompt_ids"]) + len(pair[side])
            assert batch.input_ids[row, :n].tolist() == pair["prompt_ids"] + pair[side]
            learned = batch.labels[row][batch.labels[row] != IGNORE].tolist()
            assert learned == pair[side]  # the response only, never the prompt or padding
    assert batch.labelled == sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in got)


def test_prepared_pairs_are_reused_and_keyed_by_the_field_names(tok, tmp_path):
    source = write_jsonl(tmp_path / "pairs.jsonl", [GOOD])
    a = prepare.key(spec(source), tok)
    assert a == prepare.key(spec(source), tok)
    assert a != prepare.key(spec(source, chosenField="good"), tok)
    logs = []
    data.load(spec(source), tok, tmp_path / "job", log=quiet)
    data.load(spec(source), tok, tmp_path / "job", log=logs.append)
    assert any("reusing the prepared sequences" in line for line in logs)
