"""Build the tiny Llama model, tokenizer and data sets that CPU runs and tests train on.

    python examples/make_tiny.py [--out DIR]

writes DIR/tiny-model/ (config, fp32 safetensors weights, byte-level BPE tokenizer with a chat
template), DIR/tiny-qlora-model/ (the same tokenizer; a Llama whose decoder weights NF4 can store
in 4 bits and split over two processes, bf16) and DIR/data/tiny-{text,chat,instruct,pairs}.jsonl.
DIR defaults to this script's folder.
The output is byte-for-byte deterministic, so the committed files can be checked against a
fresh run (tests/unit/test_tiny_assets.py does).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 1234
VOCAB_SIZE = 1024
RECORDS = 2000

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
# Order fixes the ids: pad=0, bos=1, eos=2, system=3, user=4, assistant=5.
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT]

# Every turn is "<|role|>\n" + content + "<|eos|>\n". The assistant's content and its <|eos|>
# sit inside {% generation %} so the mask teaches the model both the reply and when to stop;
# eos doubles as end-of-turn so that generate() stops after one reply without extra config.
CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown chat role: ' + message['role']) }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|assistant|>\n' }}
        {%- generation %}{{ message['content'] + eos_token }}{% endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\n' }}
{%- endif %}
"""

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing", "India": "Delhi",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
    "Austria": "Vienna", "Ireland": "Dublin", "Russia": "Moscow", "Turkey": "Ankara",
    "Cuba": "Havana", "Ghana": "Accra", "Nepal": "Kathmandu", "Iceland": "Reykjavik",
    "Hungary": "Budapest", "Denmark": "Copenhagen", "Belgium": "Brussels", "Vietnam": "Hanoi",
    "Thailand": "Bangkok", "Argentina": "Buenos Aires", "Colombia": "Bogota",
    "Morocco": "Rabat", "Ethiopia": "Addis Ababa", "Australia": "Canberra",
}  # fmt: skip
COLOURS = {
    "grass": "green", "the sky": "blue", "snow": "white", "coal": "black", "a lemon": "yellow",
    "a tomato": "red", "an orange": "orange", "a plum": "purple", "chocolate": "brown",
    "a flamingo": "pink", "ash": "grey", "a banana": "yellow", "blood": "red", "milk": "white",
}  # fmt: skip
ANIMALS = {  # animal: (sound, legs)
    "dog": ("barks", 4), "cat": ("meows", 4), "cow": ("moos", 4), "duck": ("quacks", 2),
    "sheep": ("bleats", 4), "horse": ("neighs", 4), "lion": ("roars", 4), "owl": ("hoots", 2),
    "frog": ("croaks", 4), "pig": ("oinks", 4), "goose": ("honks", 2), "snake": ("hisses", 0),
    "bee": ("buzzes", 6), "crow": ("caws", 2), "mouse": ("squeaks", 4), "wolf": ("howls", 4),
}  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly.", "You are a tiny model."]


def make_facts(rng: random.Random) -> tuple[str, str, str]:
    """One (question, answer, statement) triple; the same facts appear in all three files."""
    kind = rng.randrange(6)
    if kind == 0:
        country, city = rng.choice(sorted(CAPITALS.items()))
        return (
            f"What is the capital of {country}?",
            f"The capital of {country} is {city}.",
            f"The capital of {country} is {city}.",
        )
    if kind == 1:
        thing, colour = rng.choice(sorted(COLOURS.items()))
        return (
            f"What colour is {thing}?",
            f"{thing[0].upper() + thing[1:]} is {colour}.",
            f"The colour of {thing} is {colour}.",
        )
    if kind == 2:
        animal, (sound, legs) = rng.choice(sorted(ANIMALS.items()))
        if rng.random() < 0.5:
            return f"What does a {animal} do?", f"A {animal} {sound}.", f"A {animal} {sound}."
        return (
            f"How many legs does a {animal} have?",
            f"A {animal} has {legs} legs.",
            f"A {animal} has {legs} legs.",
        )
    if kind == 3:
        a, b = rng.randrange(20), rng.randrange(20)
        op = rng.randrange(3)
        if op == 0:
            return f"What is {a} + {b}?", str(a + b), f"{a} plus {b} is {a + b}."
        if op == 1:
            a, b = max(a, b), min(a, b)
            return f"What is {a} - {b}?", str(a - b), f"{a} minus {b} is {a - b}."
        a, b = a % 12 + 1, b % 12 + 1
        return f"What is {a} * {b}?", str(a * b), f"{a} times {b} is {a * b}."
    if kind == 4:
        start = rng.randrange(1, 200)
        numbers = " ".join(str(n) for n in range(start, start + rng.randrange(3, 10)))
        last = numbers.split()[-1]
        return f"Count from {start} to {last}.", numbers, f"Counting: {numbers}."
    day = rng.randrange(7)
    return (
        f"What day comes after {DAYS[day]}?",
        f"After {DAYS[day]} comes {DAYS[(day + 1) % 7]}.",
        f"After {DAYS[day]} comes {DAYS[(day + 1) % 7]}.",
    )


def make_datasets(rng: random.Random) -> dict[str, list[dict]]:
    text, chat, instruct = [], [], []
    for _ in range(RECORDS):
        text.append({"text": " ".join(make_facts(rng)[2] for _ in range(rng.randrange(2, 6)))})

        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.choice([1, 1, 1, 2])):
            question, answer, _ = make_facts(rng)
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        chat.append({"messages": messages})

        question, answer, _ = make_facts(rng)
        instruct.append({"prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}"})
    return {"tiny-text": text, "tiny-chat": chat, "tiny-instruct": instruct}


def make_pairs(instruct: list[dict], count: int = 500) -> list[dict]:
    """Preference pairs from the instruction records: the right answer is chosen, another
    question's answer rejected. Learnable: the rejected answer is most often of another kind
    (a city for a sum, a colour for a day). A stream of its own, so the other files, and the
    tokenizer trained on them, are the same with or without it."""
    rng = random.Random(SEED + 1)
    pairs = []
    for record in instruct[:count]:
        wrong = rng.choice(instruct)["completion"]
        while wrong == record["completion"]:
            wrong = rng.choice(instruct)["completion"]
        pairs.append(
            {"prompt": record["prompt"], "chosen": record["completion"], "rejected": wrong}
        )
    return pairs


def make_prompts(instruct: list[dict], count: int = 300) -> list[dict]:
    """GRPO's prompts (examples/tiny-grpo.yaml): the arithmetic questions of the instruction
    records, each with its answer in a field of its own for the rewards to read. Derived from
    those records, with no random stream: the other files are the same with or without it."""
    sums = [r for r in instruct if re.match(r"Question: What is \d+ [-+*] \d+\?", r["prompt"])]
    return [{"prompt": r["prompt"], "answer": r["completion"].strip()} for r in sums[:count]]


def corpus(datasets: dict[str, list[dict]]):
    for record in datasets["tiny-text"]:
        yield record["text"]
    for record in datasets["tiny-chat"]:
        yield from (m["content"] for m in record["messages"])
    for record in datasets["tiny-instruct"]:
        yield record["prompt"] + record["completion"]


def train_tokenizer(datasets: dict[str, list[dict]]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Plain text gets a leading bos like Llama's tokenizer; the trainer appends eos itself.
    # apply_chat_template does not add special tokens, so chats get exactly one bos.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 bytes are in the vocabulary, so any text encodes without unknown tokens.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(datasets), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


# The tiny model: 64x64 weights, too small for QLoRA (torchao's NF4 needs multiples of
# 64 x 256 = 16,384 values in each shard).
TINY = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2)
# A small Llama QLoRA runs on over 2 processes (examples/tiny-qlora.yaml): every decoder linear
# weight holds a multiple of 2 x 16,384 values (k/v_proj 128x256, the rest 256x256).
QLORA = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def build_model(
    tokenizer: PreTrainedTokenizerFast, dtype: torch.dtype = torch.float32, **shape
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        **(shape or TINY),
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=str(dtype).removeprefix("torch."),
    )
    # Construction draws from torch's global RNG; fork it so importers' seeds are untouched.
    with torch.random.fork_rng():
        model = LlamaForCausalLM(config)
    # torch's normal_() uses SIMD transcendental functions whose last bits differ between
    # CPUs, which would make the committed weights unreproducible elsewhere. Uniform values
    # from Python's integer RNG are exact everywhere; a = 0.02 * sqrt(3) keeps std at 0.02.
    rng = random.Random(SEED)
    scale = 0.02 * 3**0.5 * 2 / 2**24
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            raw = bytearray(rng.randbytes(4 * param.numel()))
            ints = torch.frombuffer(raw, dtype=torch.int32) >> 8  # in [-2**23, 2**23)
            param.copy_((ints.to(torch.float32) * scale).view_as(param))
    return model.to(dtype)


def write_jsonl(path: Path, records: list[dict]) -> None:
    lines = (json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path.write_text("".join(lines), encoding="utf-8")


def build(out: Path) -> None:
    rng = random.Random(SEED)
    datasets = make_datasets(rng)
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, records in datasets.items():
        write_jsonl(out / "data" / f"{name}.jsonl", records)
    write_jsonl(out / "data" / "tiny-pairs.jsonl", make_pairs(datasets["tiny-instruct"]))
    write_jsonl(out / "data" / "tiny-prompts.jsonl", make_prompts(datasets["tiny-instruct"]))

    tokenizer = train_tokenizer(datasets)
    save(build_model(tokenizer), tokenizer, out / "tiny-model")
    # bf16, as QLoRA's frozen base computes: half the file of fp32.
    save(build_model(tokenizer, torch.bfloat16, **QLORA), tokenizer, out / "tiny-qlora-model")


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, model_dir: Path) -> None:
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    # safetensors creates its files with mode 0600; an image built from this folder must let
    # the non-root trainer read them.
    for path in model_dir.iterdir():
        path.chmod(0o644)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    build(parser.parse_args().out)


if __name__ == "__main__":
    main()
