"""GRPO's rewards: the built-ins on real-looking completions, the combiner's NaNs and metrics,
a user's function (that works, raises, hangs, returns the wrong shape, is missing), TRL's own
reward functions unchanged, and RewardSpec as the API parses and the API server admits it."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import hangs
import pytest
import torch

from ftjob.api import admission
from ftjob.api.rewards import UNIQUE_NAMES, RewardSpec, metric_names, reward_names
from ftjob.api.schema import Rule, SpecError, api_field, openapi, parse
from ftjob.trainer.rewards import RewardError, Rewards
from ftjob.trainer.rewards.builtins import answer_text, normalise, number

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def specs(*items: dict) -> list[RewardSpec]:
    return [parse(RewardSpec, item, f"rewards[{i}]") for i, item in enumerate(items)]


def score(items, completions, records, prompts=None, root=None, ids=None):
    prompts = prompts or ["Q"] * len(completions)
    with Rewards(specs(*items), root) as rewards:
        return rewards.score(prompts, completions, records, completion_ids=ids)


def column(items, completions, records, **kw) -> list[float]:
    return score(items, completions, records, **kw)[:, 0].tolist()


# ----------------------------------------------------------------------------- built-ins


def test_the_answer_is_the_last_tag_then_boxed_then_hashes_else_the_whole_text():
    assert answer_text("so <answer>7</answer> no, <answer> 8 </answer>") == " 8 "
    assert answer_text(r"<answer>It is \boxed{\frac{1}{2}}.</answer>") == r"\frac{1}{2}"
    assert answer_text(GSM8K_ANSWER) == "72"
    assert answer_text(r"\boxed{3} then \boxed{x^{2}}") == "x^{2}"
    assert answer_text("just text") == "just text"


def test_numbers_with_commas_signs_decimals_and_fractions():
    assert number(GSM8K_ANSWER) == 72
    assert number("The total is $1,234.50 in all.") == 1234.5
    assert number("x = -4") == -4
    assert number("from 3-4 apples") == 4  # a hyphen, not a sign
    assert number(r"So \boxed{\dfrac{3}{4}}") == 0.75
    assert number("half: 1/2") == 0.5
    assert number("no digits here") is None
    assert number(12) == 12.0


def test_numeric_compares_gsm8k_and_boxed_answers_as_numbers():
    completions = [
        "She sold 24 in May, so 48 + 24 = 72.\n#### 72",
        r"Adding up, the answer is $\boxed{72.0}$",
        "Altogether 1,072 clips? No: 72 clips.",
        "I think it is 71.",
        "I cannot tell.",
    ]
    records = [{"answer": GSM8K_ANSWER}] * len(completions)
    assert column([{"type": "numeric"}], completions, records) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_numeric_tolerance_is_relative_to_the_reference_and_a_reference_without_number_is_nan():
    records = [{"solution": "1000"}, {"solution": "1000"}, {"solution": "n/a"}]
    got = column(
        [{"type": "numeric", "field": "solution", "tolerance": 0.01}],
        ["#### 1009", "#### 1011", "#### 5"],
        records,
    )
    assert got[:2] == [1.0, 0.0] and math.isnan(got[2])


def test_exact_match_normalises_case_whitespace_and_trailing_punctuation():
    assert normalise("  The  Eiffel\tTower!! ") == "the eiffel tower"
    completions = [
        "<think>capital of France</think><answer> PARIS. </answer>",
        "Paris",
        "<answer>Lyon</answer>",
        r"The city is \boxed{paris}",
    ]
    records = [{"answer": "Paris"}] * 3 + [{"answer": ["London", "Paris"]}]
    assert column([{"type": "exactMatch"}], completions, records) == [1.0, 1.0, 0.0, 1.0]
    gsm8k = column(
        [{"type": "exactMatch"}], ["So 72.\n#### 72", "#### 72.5"], [{"answer": GSM8K_ANSWER}] * 2
    )
    assert gsm8k == [1.0, 0.0]  # the reference's answer is read as the completion's is


def test_a_record_without_the_field_is_refused_naming_the_field():
    with pytest.raises(RewardError, match="record 1 of the batch has no field 'label'"):
        score([{"type": "exactMatch", "field": "label"}], ["a", "b"], [{"label": "a"}, {}])


def test_regex_searches_the_whole_completion_across_lines():
    pattern = r"^<think>.*</think>\s*<answer>.*</answer>$"
    completions = [
        "<think>\nstep 1\nstep 2\n</think>\n<answer>42</answer>",
        "<answer>42</answer>",
        "preamble <think>x</think><answer>1</answer>",
    ]
    got = column([{"type": "regex", "pattern": pattern}], completions, [{}] * 3)
    assert got == [1.0, 0.0, 0.0]
    assert column([{"type": "regex", "pattern": "####"}], ["a\n#### 3"], [{}]) == [1.0]


def test_length_penalty_is_zero_then_linear_to_minus_one_at_max_length():
    reward = {"type": "length", "maxLength": 100, "bufferLength": 20}
    ids = [[0] * n for n in (10, 80, 90, 100, 150)]
    got = column([reward], ["x"] * 5, [{}] * 5, ids=ids)
    assert got == [0.0, 0.0, -0.5, -1.0, -1.0]
    chars = {"type": "length", "maxLength": 8, "unit": "characters"}  # buffer: 8 / 4 = 2
    assert column([chars], ["abcdef", "abcdefg", "abcdefgh"], [{}] * 3) == [0.0, -0.5, -1.0]


def test_length_in_tokens_needs_the_completion_ids():
    with pytest.raises(RewardError, match="completion_ids"):
        score([{"type": "length", "maxLength": 4}], ["abc"], [{}])


# ----------------------------------------------------------------------------- combiner


def test_nan_where_a_reward_gives_none_and_the_weighted_sum_skips_it_as_trl_does():
    items = [{"type": "numeric", "weight": 2.0}, {"type": "regex", "pattern": "^<think>"}]
    completions = ["<think>ok</think> #### 5", "#### 5", "<think>?</think>"]
    records = [{"answer": "5"}, {"answer": "5"}, {"answer": None}]
    with Rewards(specs(*items), None) as rewards:
        per_func = rewards.score(["Q"] * 3, completions, records)
        assert per_func.dtype == torch.float32 and per_func.shape == (3, 2)
        assert torch.isnan(per_func[2, 0]) and per_func[2, 1] == 1.0
        total = (per_func * rewards.weights).nansum(1)
        assert total.tolist() == [3.0, 2.0, 1.0]
        metrics = rewards.metrics(per_func)
    assert rewards.names == ["numeric", "regex"]
    assert metrics["rewards/numeric/mean"] == 1.0  # the NaN is left out, not counted as 0
    assert metrics["rewards/regex/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/regex/std"] == pytest.approx(torch.tensor([1.0, 0, 1]).std().item())
    assert list(metrics) == rewards.metric_names() == metric_names(rewards.specs)


def test_derived_names_step_aside_for_given_ones():
    items = [
        {"type": "numeric"},
        {"type": "numeric", "name": "numeric_2"},
        {"type": "numeric"},
        {"type": "exactMatch", "field": "final answer"},
        {"type": "function", "function": "pkg.mod:score"},
    ]
    assert reward_names(specs(*items)) == [
        "numeric",
        "numeric_2",
        "numeric_3",
        "exactMatch_final_answer",
        "score",
    ]


# ----------------------------------------------------------------------------- user functions

WORKS = """
def score(prompts, completions, completion_ids, records, answer, difficulty, **kwargs):
    assert len(prompts) == len(completions) == len(answer) == len(completion_ids)
    assert [r["answer"] for r in records] == answer and completion_ids == [[1], [2]]
    return [len(c) / 10 if d == "easy" else None for c, d in zip(completions, difficulty)]
"""
RAISES = """
def score(completions, **kwargs):
    out = []
    for c in completions:
        out.append(1 / len(c))
    return out
"""
SLEEPS = """
import time

def score(completions, **kwargs):
    if completions[0] == "slow":
        time.sleep(600)
    return [1.0] * len(completions)
"""
SHORT = """
def score(completions, **kwargs):
    return [1.0] * (len(completions) - 1)
"""
WRONG_TYPE = """
def score(completions, **kwargs):
    return ["good" for c in completions]
"""


def function(tmp_path, source: str, name: str = "score", **extra) -> dict:
    (tmp_path / "rewards").mkdir(exist_ok=True)
    (tmp_path / "rewards" / "mine.py").write_text(source)
    return {"type": "function", "function": f"rewards/mine.py:{name}", **extra}


def test_a_user_function_gets_trl_arguments_and_record_fields_as_columns(tmp_path):
    records = [{"answer": "1", "difficulty": "easy"}, {"answer": "2", "difficulty": "hard"}]
    got = score([function(tmp_path, WORKS)], ["abcde", "x"], records, root=tmp_path, ids=[[1], [2]])
    assert got[0, 0] == 0.5 and torch.isnan(got[1, 0])


def test_a_function_that_raises_names_its_file_and_line_and_the_fix(tmp_path):
    with pytest.raises(RewardError) as caught:
        score([function(tmp_path, RAISES)], ["ok", ""], [{}, {}], root=tmp_path)
    message = str(caught.value)
    assert "ZeroDivisionError" in message and "rewards/mine.py:5" in message
    assert "out.append(1 / len(c))" in message
    assert "correct the function at that line" in caught.value.fix
    assert caught.value.where.endswith("rewards/mine.py:5")


def test_a_function_that_hangs_is_stopped_at_its_limit_and_the_next_call_works(tmp_path):
    items = [function(tmp_path, SLEEPS, timeoutSeconds=1)]
    with Rewards(specs(*items), tmp_path) as rewards:
        began = time.monotonic()
        with pytest.raises(RewardError, match="took longer than 1 s"):
            rewards.score(["Q"], ["slow"], [{}])
        # not a hang guard: the promised bound under test (1 s limit, a kill and a wait)
        assert time.monotonic() - began < 10
        assert rewards.score(["Q"], ["fast"], [{}]).tolist() == [[1.0]]


@pytest.mark.parametrize(
    "source, said",
    [
        (SHORT, "returned 1 values; it must return a list of 2 floats"),
        (WRONG_TYPE, "item 0 is str"),
    ],
)
def test_a_function_that_returns_the_wrong_shape_says_what_it_must_return(tmp_path, source, said):
    with pytest.raises(RewardError, match=said):
        score([function(tmp_path, source)], ["a", "b"], [{}, {}], root=tmp_path)


def test_a_missing_file_function_or_module_and_a_syntax_error_fail_at_construction(tmp_path):
    missing = {"type": "function", "function": "rewards/none.py:score"}
    with pytest.raises(RewardError, match="no such file"):
        Rewards(specs(missing), tmp_path)
    with pytest.raises(RewardError, match="has no attribute 'scor'") as caught:
        Rewards(specs(function(tmp_path, WORKS, name="scor")), tmp_path)
    assert "name a function the module defines" in caught.value.fix
    with pytest.raises(RewardError, match=r"SyntaxError.*rewards/mine.py:3"):
        Rewards(specs(function(tmp_path, "def score(c):\n    pass\nreturn [\n")), tmp_path)
    module = {"type": "function", "function": "no_such_package.rewards:score"}
    with pytest.raises(RewardError, match="ModuleNotFoundError"):
        Rewards(specs(module), tmp_path)


TRL_STYLE = """
import re

def format_reward(completions, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(r"^<think>.*?</think>", c, re.DOTALL) else 0.0 for c in contents]
"""


def test_trl_reward_functions_work_unchanged_on_chat_prompts(tmp_path):
    items = [
        function(tmp_path, TRL_STYLE, name="format_reward"),
        {"type": "function", "function": "trl.rewards:think_format_reward"},
    ]
    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    got = score(items, ["<think>2+2</think>4", "4"], [{}, {}], prompts=prompts, root=tmp_path)
    assert got.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert reward_names(specs(*items)) == ["format_reward", "think_format_reward"]


# ----------------------------------------------------------------------------- the spec


@dataclass(kw_only=True)
class Grpo:
    """What the core's training.grpo holds of the rewards, to test them as a list item."""

    rewards: list[RewardSpec] = api_field("rewards.", factory=list, max_items=16)
    __rules__: ClassVar[tuple[Rule, ...]] = (UNIQUE_NAMES,)


def python_errors(rewards: list) -> list[str]:
    try:
        parse(Grpo, {"rewards": rewards}, "spec.training.grpo")
    except SpecError as e:
        return [str(x) for x in e.errors]
    return []


def server_errors(rewards: list) -> list[str]:
    return admission.admit(openapi(Grpo), {"rewards": rewards})[1]


def test_defaults_as_parsed_and_as_the_api_server_fills_them_in():
    (spec,) = specs({"type": "numeric"})
    assert (spec.name, spec.field, spec.timeout_seconds, spec.weight) == (None, "answer", 30, 1.0)
    assert (spec.tolerance, spec.unit, spec.max_length, spec.pattern) == (
        1e-6,
        "tokens",
        None,
        None,
    )
    filled = admission.admit(openapi(Grpo), {"rewards": [{"type": "numeric"}]})[0]["rewards"][0]
    assert filled == {
        "type": "numeric",
        "field": "answer",
        "timeoutSeconds": 30,
        "weight": 1.0,
        "tolerance": 1e-6,
        "unit": "tokens",
    }
    described = openapi(RewardSpec)["properties"]
    assert "Defaults to 30." in described["timeoutSeconds"]["description"]


REFUSED = [
    ({"type": "regex"}, "rewards[0].pattern", "type regex needs pattern"),
    ({"type": "numeric", "pattern": "x"}, "rewards[0].pattern", "pattern is for type regex"),
    ({"type": "function"}, "rewards[0].function", "type function needs function"),
    ({"type": "length"}, "rewards[0].maxLength", "type length needs maxLength"),
    ({"type": "numeric", "maxLength": 5}, "rewards[0].maxLength", "is for type length"),
    (
        {"type": "length", "maxLength": 5, "bufferLength": 6},
        "rewards[0].bufferLength",
        "may not exceed maxLength",
    ),
]


@pytest.mark.parametrize("reward, path, said", REFUSED)
def test_rules_refuse_naming_the_field_in_python_and_cel_alike(reward, path, said):
    python, server = python_errors([reward]), server_errors([reward])
    assert any(e.startswith(f"spec.training.grpo.{path}: ") and said in e for e in python), python
    assert any(e.startswith(path + ": ") and said in e for e in server), server


def test_field_refusals_name_the_field_and_what_is_allowed():
    errors = python_errors(
        [
            {"type": "exact", "weight": "high"},
            {"type": "function", "function": "score.py"},
            {"type": "numeric", "name": "my reward", "timeoutSeconds": 0},
        ]
    )
    assert any(e.startswith("spec.training.grpo.rewards[0].type: must be one of") for e in errors)
    assert any(e.startswith("spec.training.grpo.rewards[0].weight: must be") for e in errors)
    assert any(
        e.startswith("spec.training.grpo.rewards[1].function: must be path/to/file.py:")
        for e in errors
    )
    assert any(e.startswith("spec.training.grpo.rewards[2].name: must be a name") for e in errors)
    assert any(e.startswith("spec.training.grpo.rewards[2].timeoutSeconds:") for e in errors)


def test_a_pattern_python_cannot_compile_is_refused_in_python_where_cel_cannot_tell():
    bad = [{"type": "regex", "pattern": "<answer>(.*</answer>"}]
    errors = python_errors(bad)
    assert any(
        e.startswith("spec.training.grpo.rewards[0].pattern: pattern is not a valid Python")
        for e in errors
    )
    assert server_errors(bad) == []  # the operator's own parse refuses it: one step later


def test_given_names_must_be_unique_in_python_and_cel_alike():
    twice = [{"type": "numeric", "name": "acc"}, {"type": "exactMatch", "name": "acc"}]
    assert python_errors(twice) == [
        "spec.training.grpo.rewards: every reward's name must be unique among rewards (it "
        "names the reward's metrics); rename one"
    ]
    assert [e.split(":")[0] for e in server_errors(twice)] == ["rewards"]
    assert python_errors([{"type": "numeric"}, {"type": "numeric"}]) == []
    assert server_errors([{"type": "numeric"}, {"type": "numeric"}]) == []


def test_a_full_reward_list_is_accepted_both_ways():
    rewards = [
        {"type": "numeric", "weight": 1.0},
        {"type": "regex", "pattern": r"^<think>.*</think>", "weight": 0.2},
        {"type": "length", "maxLength": 512, "bufferLength": 128, "weight": 0.5},
        {"type": "function", "function": "rewards/math.py:score", "timeoutSeconds": 5},
        {"type": "exactMatch", "field": "label", "name": "label"},
    ]
    assert python_errors(rewards) == [] and server_errors(rewards) == []


def test_a_function_without_kwargs_is_told_to_take_them(tmp_path):
    narrow = "def score(completions):\n    return [1.0 for c in completions]\n"
    with pytest.raises(RewardError, match=r"unexpected keyword argument 'prompts'") as caught:
        score([function(tmp_path, narrow)], ["a"], [{"answer": "1"}], root=tmp_path)
    assert "end the function's parameters with **kwargs" in caught.value.fix


def test_a_pattern_that_backtracks_for_ever_is_stopped_at_its_limit():
    reward = {"type": "regex", "pattern": r"^(a|a)+$", "timeoutSeconds": 1}
    began = time.monotonic()
    with pytest.raises(RewardError, match="took longer than 1 s"):
        score([reward], ["a" * 64 + "b"], [{}])
    # not a hang guard: the promised bound under test (1 s limit, a kill and a wait)
    assert time.monotonic() - began < 10


def test_check_refuses_a_record_without_a_field_before_any_step():
    with Rewards(specs({"type": "numeric", "field": "solution"}), None) as rewards:
        rewards.check({"solution": "4"})
        with pytest.raises(RewardError, match="no field 'solution'.*fields: answer, question"):
            rewards.check({"question": "2+2?", "answer": "4"})


ORPHAN = """
import sys
from pathlib import Path
from ftjob.api.schema import parse
from ftjob.api.rewards import RewardSpec
from ftjob.trainer.rewards import Rewards

spec = {"type": "function", "function": "rewards/mine.py:score", "timeoutSeconds": 600}
rewards = Rewards([parse(RewardSpec, spec)], Path(sys.argv[1]))
print(rewards._parts[0].worker.proc.pid, flush=True)
rewards.score(["Q"], ["slow"], [{}])  # the worker sleeps in the function
"""


def test_a_busy_worker_ends_with_its_trainer_even_when_the_trainer_is_killed(tmp_path):
    function(tmp_path, SLEEPS)
    command = [sys.executable, "-c", ORPHAN, str(tmp_path)]
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(trainer.stdout.readline())
        time.sleep(0.5)  # not a hang guard: time for the call to reach the function
        assert _alive(worker)
    finally:
        trainer.kill()
        trainer.wait(hangs.FLOOR)
    # Past its parent a sleeping worker reads no closed socket: only the death signal ends it.
    hangs.poll(lambda: not _alive(worker), what="the worker to end with its trainer")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def test_a_function_that_ends_its_process_is_named_with_the_exit_code(tmp_path):
    exits = "import os\n\ndef score(completions, **kwargs):\n    os._exit(3)\n"
    with pytest.raises(RewardError, match=r"its process ended \(exit code 3\) while returning"):
        score([function(tmp_path, exits)], ["a"], [{}], root=tmp_path)


def test_signs_before_currency_mixed_numbers_and_space_grouped_thousands():
    """Answers that once read as another number (issue 75): "-$5" as 5, "5 1/2" as 0.5,
    "10 000" as 0."""
    assert number("She owes -$5 now") == -5
    assert number("It costs $5.") == 5
    assert number("5 1/2 cups") == 5.5
    assert number("-2 3/4") == -2.75
    assert number("about 10 000 people") == 10000
    assert number("#### 1 234 567.5") == 1234567.5
    assert number("3 and 4") == 4  # two numbers, not a thousands group
    assert number("from 3-4 apples") == 4
    assert number("10 - 4") == 4  # an operator between terms


def test_exact_match_of_a_number_field_matches_the_numeral_a_completion_writes():
    """A JSON gold answer 72.0 (or 72) is the numeral "72" or "72.0", not "72.0" alone."""
    completions = ["#### 72", "#### 72.0", "#### 72.5", "#### 0.5"]
    records = [{"answer": 72.0}, {"answer": 72}, {"answer": 72.0}, {"answer": 0.5}]
    assert column([{"type": "exactMatch"}], completions, records) == [1.0, 1.0, 0.0, 1.0]
