"""The DPO objective and preference data in the spec: defaults, and a valid job passes both
ftjob's validator and the CRD (schema + CEL); the refusals are corpus cases
(tests/corpus/rule-*dpo*, rule-preference-*, enum-dpo-*, range-dpo-*)."""

from ftjob.api.jobspec import API_VERSION, KIND, parse_spec
from ftjob.cli import validate

DPO = {
    "model": {"source": "hf://org/m"},
    "dataset": {"source": "pairs.jsonl", "format": "preference"},
    "training": {"objective": "dpo", "maxSteps": 10},
}


def test_objective_is_sft_unless_asked_and_dpo_settings_default_when_it_is():
    sft = parse_spec(
        {"model": DPO["model"], "dataset": {"source": "d.jsonl"}, "training": {"maxSteps": 10}}
    )
    assert sft.training.objective == "sft" and sft.training.dpo_settings() is None
    dpo = parse_spec(DPO).training.dpo_settings()
    assert (dpo.beta, dpo.loss_type) == (0.1, "sigmoid")
    ds = parse_spec(DPO).dataset
    assert (ds.prompt_field, ds.chosen_field, ds.rejected_field) == ("prompt", "chosen", "rejected")


def test_a_dpo_job_with_its_settings_and_field_names_passes_validator_and_crd():
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "dpo"},
        "spec": {
            **DPO,
            "dataset": {
                **DPO["dataset"],
                "promptField": "question",
                "chosenField": "good",
                "rejectedField": "bad",
            },
            "training": {**DPO["training"], "dpo": {"beta": 0.5, "lossType": "ipo"}},
        },
    }
    checked = validate.check(doc)
    assert checked.ok, (checked.errors, checked.server_errors)
    spec = parse_spec(doc["spec"])
    assert spec.training.dpo_settings().loss_type == "ipo"
    assert spec.dataset.chosen_field == "good" and spec.dataset.rejected_field == "bad"


def test_label_smoothing_below_a_half_with_the_sigmoid_loss_passes_validator_and_crd():
    doc = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "dpo"}}
    doc["spec"] = {**DPO, "training": {**DPO["training"], "dpo": {"labelSmoothing": 0.25}}}
    checked = validate.check(doc)
    assert checked.ok, (checked.errors, checked.server_errors)
    assert parse_spec(doc["spec"]).training.dpo_settings().label_smoothing == 0.25
    assert parse_spec(DPO).training.dpo_settings().label_smoothing is None  # unset: 0
