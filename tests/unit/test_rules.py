"""Every door judges a spec alike: the rules evaluated on the parsed spec (ftjob validate, the
operator, ftjob run, the trainer) and on the object the API server holds (defaults filled in),
on every combination of the fields they read."""

import itertools

from ftjob.api.jobspec import parse_resource
from ftjob.api.schema import SpecError
from ftjob.cli import validate

AXES = {
    "method": [
        {"type": "full"},
        {"type": "lora"},
        {"type": "lora", "lora": {"r": 8}},
        {"type": "full", "lora": {}},
        {"type": "qlora"},
        {"type": "qlora", "quantization": {"type": "nf4"}},
        {"type": "lora", "quantization": {}},
    ],
    "training": [{"maxSteps": 10}, {"epochs": 1}, {}, {"maxSteps": 10, "epochs": 1}],
    "resources": [
        {"nodes": 1, "gpusPerNode": 0},
        {"nodes": 2, "gpusPerNode": 8},
        {"nodes": 2, "gpusPerNode": 0, "processesPerNode": 2},
        {"nodes": 1, "gpusPerNode": 4, "processesPerNode": 4},
    ],
    "parallelism": [{}, {"sharding": "hybrid"}, {"sharding": "none", "cpuOffload": True}],
    "network": [{}, {"fabric": "efa"}, {"fabric": "efa", "efaDevicesPerNode": 4}],
    "checkpoint": [{}, {"volume": {"claimName": "fs"}}],
    "output": [{}, {"mergeAdapter": True}],
}


def rule_paths(errors):
    return sorted({e.split(":")[0] for e in errors})


def test_parsed_and_admitted_agree_on_every_combination():
    combos = 0
    for values in itertools.product(*AXES.values()):
        spec = {
            "model": {"source": "m"},
            "dataset": {"source": "d"},
            **dict(zip(AXES, values, strict=True)),
        }
        doc = {"apiVersion": "ftjob.dev/v1alpha1", "kind": "FineTuneJob"}
        doc |= {"metadata": {"name": "x"}, "spec": spec}
        try:
            parse_resource(doc)
            python = []
        except SpecError as e:
            python = [str(x) for x in e.errors]
        server = validate.check(doc).server_errors
        assert rule_paths(python) == rule_paths(server), (spec, python, server)
        combos += 1
    assert combos == 7 * 4 * 4 * 3 * 3 * 2 * 2


def paths_of(spec_changes):
    spec = {"model": {"source": "m"}, "dataset": {"source": "d"}, "training": {"maxSteps": 10}}
    doc = {"apiVersion": "ftjob.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "x"}}
    doc["spec"] = spec | spec_changes
    try:
        parse_resource(doc)
        python = []
    except SpecError as e:
        python = [str(x) for x in e.errors]
    return rule_paths(python), rule_paths(validate.check(doc).server_errors)


OUTPUT_PATHS = {
    "model": True,
    "exports/checkpoints": True,
    "checkpointsx": True,
    "database": True,
    "checkpoints": False,
    "checkpoints/final": False,
    "data": False,
    "hub/x": False,
    "logs": False,
    "tmp": False,
    "progress.json": False,
    "progress.jsonl": False,
    "spec.json": False,
    ".": False,
}


def test_reserved_output_paths_agree_in_python_and_cel():
    for path, ok in OUTPUT_PATHS.items():
        python, server = paths_of({"output": {"path": path}})
        assert python == server == ([] if ok else ["spec.output.path"]), path


WARMUPS = {"0": True, "3%": True, "0%": True, "12.5%": True, "100%": True, "100.0%": True}
WARMUPS |= {"100.5%": False, "150%": False, "1000%": False, "-1%": False, "%": False}


def test_warmup_percentages_stay_within_the_run():
    for warmup, ok in WARMUPS.items():
        python, server = paths_of({"training": {"maxSteps": 10, "warmup": warmup}})
        assert python == server == ([] if ok else ["spec.training.warmup"]), warmup
