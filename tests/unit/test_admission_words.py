"""validate's "kubectl apply would be refused with" lines, in the words kube-apiserver 1.37.2
answered for the same corpus files (tests/cluster/test_real_admission.py compares every file
against the real server; these pin the forms that differed before it ran)."""

from __future__ import annotations

from pathlib import Path

from ftjob.api import manifest
from ftjob.cli import validate as validation

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
NOT_CHECKED = (
    "<nil>: Invalid value: null: some validation rules were not checked because the object "
    "was invalid; correct the existing errors to complete validation"
)


def server_errors(name: str) -> list[str]:
    docs = manifest.load(CORPUS / name)
    return validation.check(docs[-1], docs[0] if len(docs) == 2 else None).server_errors


def test_a_rule_refusal_names_no_value():
    assert server_errors("rule-eval-fraction-and-split.yaml") == [
        "spec.dataset.evalSplit: Invalid value: set evalFraction or evalSplit, not both"
    ]


def test_unknown_fields_are_refused_alone_and_an_object_for_a_list_is_unknown_fields():
    assert server_errors("type-env-map.yaml") == ['spec.env.FOO: unknown field "spec.env.FOO"']


def test_a_bound_lets_the_rules_run_a_blocking_error_does_not():
    assert server_errors("range-nodes-zero.yaml") == [
        "spec.checkpoint.volume: Invalid value: more than one node needs a shared "
        "checkpoint.volume (a ReadWriteMany claim) so that every node writes its shards to one "
        "place; set it, or name a spec.profile whose defaults give one",
        "spec.resources.nodes: Invalid value: 0: spec.resources.nodes in body should be greater "
        "than or equal to 1",
    ]
    assert NOT_CHECKED in server_errors("enum-fabric.yaml")


def test_an_exclusive_maximum_reads_less_than():
    assert server_errors("range-dpo-label-smoothing.yaml") == [
        "spec.training.dpo.labelSmoothing: Invalid value: 0.5: "
        "spec.training.dpo.labelSmoothing in body should be less than 0.5"
    ]
