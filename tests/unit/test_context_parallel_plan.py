"""parallelism.contextParallel at the door and in the plan (issue 76, phase 2): the spec's
rules (the API server's CEL and the same predicates in Python), the trainer's refusal of a
split that does not divide the heads, the planner's activations and all-to-all traffic at a
split, auto's choice, and examples/long-context.yaml's verdicts with and without the split.

    python -m pytest tests/unit/test_context_parallel_plan.py -q
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from example_jobs import example

from ftjob.api import admission, crd
from ftjob.api.contract import BAD_SPEC, TrainerError
from ftjob.api.schema import SpecError
from ftjob.plan import describe, estimate, layout, options, traffic
from ftjob.plan.modelshape import ModelShape, known_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape.from_config(json.loads((ROOT / "examples/tiny-model/config.json").read_text()))
LLAMA_8B = known_model("hf://meta-llama/Meta-Llama-3-8B")
FIELD = "spec.parallelism.contextParallel"


def _doc(**edits) -> dict:
    """examples/tiny.yaml as a document, dotted paths under spec set."""
    from ftjob.api import manifest

    (doc,) = manifest.load(ROOT / "examples/tiny.yaml")
    for path, value in edits.items():
        node = doc["spec"]
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return doc


def _refusals(doc: dict) -> tuple[list[str], list[str]]:
    """What Python's parse and the API server's schema + CEL say of ``doc``: the fields."""
    from ftjob.api.jobspec import parse_resource

    try:
        parse_resource(doc)
        python = []
    except SpecError as e:
        python = sorted({err.path for err in e.errors})
    _, server = admission.admit(crd.schema(), copy.deepcopy(doc))
    return python, sorted({line.split(": ")[0] for line in server})


@pytest.mark.parametrize(
    "edits, refused",
    [
        ({"parallelism.contextParallel": 2}, False),  # tiny: 2 nodes x 1 process: 2 > 1
        ({"parallelism.contextParallel": 1}, False),
        ({"parallelism.contextParallel": "auto"}, False),
        (
            {
                "resources.nodes": 1,
                "resources.processesPerNode": 4,
                "parallelism.contextParallel": 2,
            },
            False,
        ),  # fmt: skip
        (
            {
                "resources.nodes": 1,
                "resources.processesPerNode": 4,
                "parallelism.contextParallel": 3,
            },
            True,
        ),  # fmt: skip
        (
            {
                "resources.nodes": 1,
                "resources.processesPerNode": 2,
                "parallelism.contextParallel": 2,
                "model.attention": "eager",
            },
            True,
        ),  # fmt: skip
    ],
)
def test_the_door_takes_a_split_within_a_node_only(edits, refused):
    edits = {"resources.nodes": edits.pop("resources.nodes", 2), **edits}
    doc = _doc(**edits)
    python, server = _refusals(doc)
    tiny_two_nodes = edits.get("resources.nodes") == 2 and edits["parallelism.contextParallel"] == 2
    want = refused or tiny_two_nodes
    # Python and the API server agree, field for field.
    assert python == server
    assert (FIELD in python) == want, python


def test_dpo_and_grpo_are_refused_with_the_reason():
    from ftjob.api.jobspec import parse_resource

    doc = _doc(**{"resources.nodes": 1, "resources.processesPerNode": 2,
                  "parallelism.contextParallel": 2})  # fmt: skip
    doc["spec"]["training"]["objective"] = "dpo"
    doc["spec"]["dataset"]["format"] = "preference"
    with pytest.raises(SpecError) as refused:
        parse_resource(doc)
    said = [e for e in refused.value.errors if e.path == FIELD]
    assert said and "sum each sequence's log-probabilities" in said[0].message
    assert "use contextParallel 1, or objective sft" in said[0].message
    python, server = _refusals(doc)
    assert FIELD in python and FIELD in server


def test_the_trainer_refuses_a_split_that_does_not_divide_the_heads():
    from ftjob.trainer.model import parallel

    spec = example("tiny.yaml", **{"resources.nodes": 1, "resources.processesPerNode": 8,
                                    "parallelism.contextParallel": 8})  # fmt: skip
    with pytest.raises(TrainerError) as refused:
        parallel.check_context_heads(spec, SimpleNamespace(num_attention_heads=4))
    e = refused.value
    assert e.reason == BAD_SPEC and e.where == ".parallelism.contextParallel"
    assert "does not divide the model's 4 attention heads" in str(e)
    assert "set parallelism.contextParallel to a divisor of 4 (e.g. 4)" in e.fix
    parallel.check_context_heads(spec, SimpleNamespace(num_attention_heads=32))  # divides


def test_a_split_holds_a_share_of_the_activations_and_adds_all_to_alls():
    base = example("long-context.yaml", **{"parallelism.contextParallel": 1})
    at = {n: layout.estimate(layout.with_context(base, n), LLAMA_8B) for n in (1, 2, 8)}
    assert at[1].context_seconds == at[1].context_layer_bytes == 0
    # Activations scale with the tokens a process holds (the loss's chunk aside).
    assert at[2].activations == pytest.approx(at[1].activations / 2, rel=0.02)
    assert at[8].activations == pytest.approx(at[1].activations / 8, rel=0.15)
    # One layer's forward: (N-1)/N of q, k, v and the output, T = S/N tokens, bf16.
    t, d = 131072 // 8, 128
    assert at[8].context_layer_bytes == 7 / 8 * t * (2 * 32 + 2 * 8) * d * 2
    assert at[8].context_seconds > 0
    assert at[8].collective_seconds >= at[8].context_seconds
    # K/V heads repeated to lcm(8, 16) where 16 does not divide the 8 of them.
    sixteen = traffic.context_layer_bytes(layout.with_context(base, 16), 32, 8, 128, 2)
    assert sixteen == 15 / 16 * (131072 // 16) * (2 * 32 + 2 * 16) * 128 * 2
    # The data parallel degree is what a step's tokens count.
    assert layout.with_context(base, 2).tokens_per_step == 4 * 131072


def test_long_context_example_fits_only_with_its_split():
    spec = example("long-context.yaml")
    assert spec.parallelism.context_parallel == "2"
    split = options.plan(spec, LLAMA_8B)
    assert split.fits is True
    lines = describe.describe(spec, split)
    said = next(line for line in lines if line.startswith("context parallel"))
    assert "2 (parallelism.contextParallel); each process holds 65,536 tokens" in said
    assert describe.verdict_text(split).startswith("FITS: ")

    whole = layout.with_context(spec, 1)
    refused = options.plan(whole, LLAMA_8B)
    assert refused.fits is False
    verdict = describe.verdict_text(refused)
    assert verdict.startswith("WILL NOT FIT: ")
    assert "fits with: parallelism.contextParallel: 2" in verdict
    assert describe.fits_with(refused).startswith("set one of: parallelism.contextParallel: 2 |")
    condition = describe.planned_condition(whole)
    assert not condition["allowed"] and "parallelism.contextParallel: 2" in condition["fix"]
    # Without a split, no line about one: the plan of every other job reads as before.
    assert not any("context parallel" in line for line in describe.describe(whole, refused))


def test_auto_splits_only_a_job_that_fits_no_other_way():
    spec = example("long-context.yaml", **{"parallelism.contextParallel": "auto"})
    planned = options.plan(spec, LLAMA_8B)
    assert planned.fits is True and planned.estimate.context_parallel == 2
    assert planned.spec.parallelism.context_parallel == "2"  # what the trainer runs
    assert planned.estimate.context_reason == (
        "contextParallel auto -> 2: sequences of 131,072 tokens fit only split over 2 processes"
    )
    short = example("long-context.yaml", **{"parallelism.contextParallel": "auto",
                                            "dataset.maxSeqLength": 8192})  # fmt: skip
    e = options.plan(short, LLAMA_8B).estimate
    assert e.fits is True and e.context_parallel == 1 and e.context_reason == ""
    # DPO, or an attention other than sdpa: no split to choose from.
    assert layout.context_splits(layout.with_context(spec, 1), LLAMA_8B) == [2, 4, 8]
    eager = example("long-context.yaml", **{"model.attention": "eager",
                                            "parallelism.contextParallel": "auto"})  # fmt: skip
    assert layout.context_splits(eager, LLAMA_8B) == []
    assert estimate.TIGHT * 80e9 > 0  # the budget auto fits against (90% of a GPU)
