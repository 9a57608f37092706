"""The spec parser: defaults, derived values and error messages that name the field."""

import pytest

from ftjob.api import manifest
from ftjob.api.jobspec import parse_spec
from ftjob.api.schema import SpecError, to_dict

MINIMAL = {"model": {"source": "hf://org/m"}, "dataset": {"source": "d.jsonl"}}


def spec_of(**overrides):
    data = {**MINIMAL, "training": {"maxSteps": 10}}
    data.update(overrides)
    return parse_spec(data)


def errors_of(data):
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    return [str(x) for x in e.value.errors]


def test_defaults_are_what_a_practitioner_would_choose():
    s = spec_of()
    assert s.method.type == "lora" and s.method.lora_settings().r == 16
    assert s.model.attention == "sdpa" and s.model.trust_remote_code is False
    assert s.training.peak_learning_rate("lora") == 2e-4
    assert s.training.peak_learning_rate("full") == 2e-5
    assert s.training.warmup_steps(1000) == 30
    assert s.compute_precision() == "bf16"
    assert s.run_policy.backoff_limit == 3


def test_issue_example_message():
    errs = errors_of({**MINIMAL, "training": {"maxSteps": 1}, "method": {"lora": {"r": "big"}}})
    assert errs == ['spec.method.lora.r: must be an integer between 1 and 1024, got "big"']


def test_every_problem_is_reported_at_once():
    errs = errors_of({"model": {"source": 5}, "dataset": {}, "training": {"maxStep": 1}})
    paths = sorted(e.split(":")[0] for e in errs)
    assert paths == ["spec.dataset.source", "spec.model.source", "spec.training.maxStep"]


def test_unknown_field_suggests_the_right_spelling():
    errs = errors_of({**MINIMAL, "training": {"maxsteps": 3}})
    assert errs == ['spec.training.maxsteps: unknown field; did you mean "maxSteps"?']


def test_booleans_are_not_numbers_and_ints_are_floats():
    errs = errors_of({**MINIMAL, "training": {"maxSteps": True}})
    assert errs[0].startswith("spec.training.maxSteps: must be an integer")
    assert spec_of(training={"maxSteps": 5, "learningRate": 1}).training.learning_rate == 1.0


def test_yaml_floats_are_read_as_kubectl_reads_them():
    (doc,) = manifest.loads("lr: 5e-5\nother: 1.5E+3\nword: e5\nver: '1e3'\n")
    assert doc == {"lr": 5e-5, "other": 1500.0, "word": "e5", "ver": "1e3"}


def test_derived_values():
    s = spec_of(
        resources={"nodes": 2, "gpusPerNode": 8},
        training={"maxSteps": 5, "microBatchSize": 2, "gradientAccumulation": 4},
        dataset={"source": "d", "maxSeqLength": 1024},
        checkpoint={"volume": {"claimName": "fs"}},
    )
    assert s.resources.world_size == 16
    assert s.global_batch_size == 2 * 4 * 16
    assert s.tokens_per_step == 128 * 1024
    cpu = spec_of(resources={"gpusPerNode": 0, "processesPerNode": 3})
    assert cpu.resources.world_size == 3 and cpu.compute_precision() == "fp32"


def test_round_trip_through_dict_keeps_every_value():
    s = spec_of(method={"type": "qlora", "quantization": {"type": "fp4"}}, env=[{"name": "A"}])
    assert parse_spec(to_dict(s)) == s


def test_field_errors_and_cross_field_rules_come_together():
    """One pass: a type error does not hide that maxSteps and epochs are both set."""
    errs = errors_of(
        {**MINIMAL, "training": {"maxSteps": 10, "epochs": 2}, "resources": {"nodes": "two"}}
    )
    assert sorted(e.split(":")[0] for e in errs) == ["spec.resources.nodes", "spec.training"]


def test_a_rule_that_reads_a_wrong_field_stays_quiet():
    # nodes is wrong, so "more than one node needs a volume" has nothing sound to say.
    errs = errors_of({**MINIMAL, "training": {"maxSteps": 10}, "resources": {"nodes": 2.5}})
    assert [e.split(":")[0] for e in errs] == ["spec.resources.nodes"]


@pytest.mark.parametrize(
    "section, typo, meant",
    [
        ("dataset", "maxSeqLenght", "maxSeqLength"),
        ("training", "lerningRate", "learningRate"),
        ("training", "microbatchsize", "microBatchSize"),
        ("training", "gradientAccumulationSteps", "gradientAccumulation"),
    ],
)
def test_an_unknown_field_suggests_the_closest_known_one(section, typo, meant):
    data = {**MINIMAL, "training": {"maxSteps": 10}}
    data[section] = {**data.get(section, {}), typo: 1}
    (err,) = errors_of(data)
    assert err == f'spec.{section}.{typo}: unknown field; did you mean "{meant}"?'


def test_an_unknown_field_far_from_any_lists_the_known_ones():
    (err,) = errors_of({**MINIMAL, "training": {"maxSteps": 10}, "method": {"banana": 1}})
    assert err == "spec.method.banana: unknown field; allowed: type, lora, quantization"


def test_activation_checkpointing_takes_words_and_refuses_the_old_booleans():
    assert spec_of().training.activation_checkpointing == "auto"
    for word in ("auto", "all", "none", "every-2", "every-12"):
        training = {"maxSteps": 1, "activationCheckpointing": word}
        assert spec_of(training=training).training.activation_checkpointing == word
    for old in (True, False):
        (err,) = errors_of({**MINIMAL, "training": {"maxSteps": 1, "activationCheckpointing": old}})
        assert err.startswith("spec.training.activationCheckpointing: must be auto, all, none")
        assert err.endswith("use all (was true) or none (was false)"), err
    for bad in ("every-1", "every-0", "every", "some", 1):
        (err,) = errors_of({**MINIMAL, "training": {"maxSteps": 1, "activationCheckpointing": bad}})
        assert "every-N with N >= 2" in err and "was true" not in err, err


def test_compile_is_off_unless_asked_until_verified_on_a_gpu():
    unset = spec_of()
    assert unset.training.compile is None
    assert unset.compile_enabled(on_gpu=False) is False
    assert unset.compile_enabled(on_gpu=True) is False  # spec.COMPILE_VERIFIED_ON_GPU
    on = spec_of(training={"maxSteps": 1, "compile": True})
    assert on.compile_enabled(on_gpu=False) and on.compile_enabled(on_gpu=True)
    off = spec_of(training={"maxSteps": 1, "compile": False})
    assert not off.compile_enabled(on_gpu=True)
    (err,) = errors_of({**MINIMAL, "training": {"maxSteps": 1, "compile": "yes"}})
    assert err.startswith("spec.training.compile: must be true or false")


def test_gpu_type_names_a_product_and_h100_80gb_is_one_for_memory():
    assert spec_of(resources={"gpuType": "H100-PCIe-80GB"}).resources.gpu_type == "H100-PCIe-80GB"
    assert spec_of(resources={"gpuType": "H100-80GB"}).resources.gpu_type == "H100-80GB"
    (err,) = errors_of({**MINIMAL, "training": {"maxSteps": 1}, "resources": {"gpuType": "V100"}})
    assert err.startswith("spec.resources.gpuType: must be one of") and "B200-180GB" in err
