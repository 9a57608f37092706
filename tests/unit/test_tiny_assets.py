"""The tiny model, tokenizer and data sets in examples/ that CPU runs and tests train on.

python -m pytest tests/unit/test_tiny_assets.py -q
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import hangs
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODEL_DIR = EXAMPLES / "tiny-model"
QLORA_MODEL_DIR = EXAMPLES / "tiny-qlora-model"  # examples/tiny-qlora.yaml's base
DATA_FILES = [
    "tiny-text.jsonl",
    "tiny-chat.jsonl",
    "tiny-instruct.jsonl",
    "tiny-pairs.jsonl",
    "tiny-prompts.jsonl",
]


def read_jsonl(name: str) -> list[dict]:
    lines = (EXAMPLES / "data" / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


# A hang guard: the generation took 17 s on a 2-core machine at load average 15.
@pytest.mark.timeout(hangs.after(17))
def test_committed_files_equal_a_fresh_generation(tmp_path):
    spec = importlib.util.spec_from_file_location("make_tiny", EXAMPLES / "make_tiny.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    make_tiny.build(tmp_path)

    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    # A stale file left in a model folder would be loaded too, so each must match exactly.
    for model_dir in (MODEL_DIR, QLORA_MODEL_DIR):
        committed_model = sorted(p.relative_to(EXAMPLES) for p in model_dir.iterdir())
        assert [p for p in generated if p.parts[0] == model_dir.name] == committed_model
    assert sorted(p.name for p in generated if p.parts[0] == "data") == sorted(DATA_FILES)
    stale = [
        str(rel)
        for rel in generated
        if (tmp_path / rel).read_bytes() != (EXAMPLES / rel).read_bytes()
    ]
    assert not stale, f"out of date, run `python examples/make_tiny.py`: {stale}"


def test_model_loads_and_starts_near_uniform_loss(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    assert model.config.vocab_size == len(tokenizer) == 1024
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    assert model.config.bos_token_id == tokenizer.bos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())

    batch = tokenizer(read_jsonl("tiny-text.jsonl")[0]["text"], return_tensors="pt")
    assert batch.input_ids[0, 0] == tokenizer.bos_token_id
    with torch.no_grad():
        loss = model(**batch, labels=batch.input_ids).loss.item()
    # An untrained model predicts close to uniformly over the vocabulary.
    assert math.isfinite(loss)
    assert abs(loss - math.log(1024)) < 0.2


def test_records_have_their_fields_and_fit_a_short_context(tokenizer):
    text, chat, instruct, pairs, prompts = (read_jsonl(name) for name in DATA_FILES)
    assert len(text) == len(chat) == len(instruct) == 2000
    assert len(pairs) == 500 and all(p["chosen"] != p["rejected"] for p in pairs)
    # GRPO's prompts: sums with their answers as numbers, for a reward to check.
    assert len(prompts) == 300 and all(p["answer"].lstrip("-").isdigit() for p in prompts)
    lengths = [len(tokenizer(r["text"]).input_ids) for r in text]
    lengths += [len(tokenizer(r["prompt"] + r["completion"]).input_ids) for r in instruct]
    for record in chat:
        assert {m["role"] for m in record["messages"]} <= {"system", "user", "assistant"}
        lengths.append(len(tokenizer.apply_chat_template(record["messages"], tokenize=True)))
    assert max(lengths) < 256


def test_assistant_mask_selects_exactly_the_replies_and_their_eos(tokenizer):
    # A record with a system prompt and two exchanges exercises every branch of the template.
    messages = next(r["messages"] for r in read_jsonl("tiny-chat.jsonl") if len(r["messages"]) == 5)
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)

    runs, run = [], []
    for token, selected in zip(ids, mask, strict=True):
        if selected:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    expected = [
        tokenizer(m["content"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        for m in messages
        if m["role"] == "assistant"
    ]
    assert runs == expected


def test_generation_prompt_opens_an_assistant_turn(tokenizer):
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|user|>\nWhat is 3 + 4?<|eos|>\n<|assistant|>\n"
    with pytest.raises(Exception, match="unknown chat role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
