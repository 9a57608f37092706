"""The CEL rules and their Python twins agree on every combination of the fields they read."""

import itertools

from ftjob import validation
from ftjob.schema import SpecError
from ftjob.spec import parse_resource

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


def test_python_and_cel_agree_on_every_combination():
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
        server = validation.check(doc).server_errors
        assert rule_paths(python) == rule_paths(server), (spec, python, server)
        combos += 1
    assert combos == 7 * 4 * 4 * 3 * 3 * 2 * 2
