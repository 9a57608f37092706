"""`ftjob plan` against what real runs use: per-process memory of 2-process CPU fine-tunes.

    python -m pytest tests/e2e/test_plan_accuracy.py -q

Llamas of ~25M and ~80M parameters (built from a config, weights random) are fine-tuned for
a few steps, full and LoRA, by `ftjob run`; the trainer reports each rank's peak RSS over
loading and training (`trainPeakRssMiB`). Rank 1 never holds the whole model, so its peak is
what the plan's per-process total (weights + gradients + optimizer + activations +
temporaries + process baseline) should predict. The goal of issue 6 is +-30% overall.

The plan estimates live memory. glibc's default malloc keeps freed large blocks resident, so
default RSS peaks run 1.2-1.8x the live memory (bench/RESULTS.md, planner suite); the runs
here pin its mmap threshold so that RSS measures what the plan predicts (that setting costs
~26% of CPU throughput, which is why ftjob does not impose it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import hangs
import pytest
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from ftjob.api.jobspec import parse_resource
from ftjob.plan.layout import estimate
from ftjob.plan.modelshape import ModelShape

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHAPES = {
    # hidden, layers, heads, kv heads, intermediate
    "25M": (512, 8, 8, 4, 1408),
    "80M": (768, 12, 12, 4, 2048),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folders = {}
    for size, (hidden, layers, heads, kv, inter) in SHAPES.items():
        folder = tmp_path_factory.mktemp(size)
        config = LlamaConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=inter,
            vocab_size=1024,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        LlamaForCausalLM(config).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(EXAMPLES / "tiny-model" / name, folder / name)
        folders[size] = folder
    return folders


def job(model: Path, method: str, micro_batch: int) -> dict:
    return {
        "apiVersion": "ftjob.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": f"acc-{method}"},
        "spec": {
            "model": {"source": str(model)},
            "dataset": {
                "source": str(EXAMPLES / "data" / "tiny-text.jsonl"),
                "maxSeqLength": 256,
            },
            "method": {"type": method},
            "training": {
                "maxSteps": 2,
                "microBatchSize": micro_batch,
                "activationCheckpointing": "none",
            },
            "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2},
            "checkpoint": {"every": 1000},
        },
    }


@pytest.mark.parametrize(
    "size, method, micro_batch",
    [  # the slow tier (tests/deadline.py): LoRA's, on the smaller model. A full fine-tune's
        # estimate is the 80M model's alone (the 25M one's, at micro-batch 4, was retired:
        # docs/testing.md).
        pytest.param("25M", "lora", 4, marks=pytest.mark.slow),
        ("80M", "full", 2),
    ],
)
def test_plan_predicts_per_process_memory_within_20_percent(
    models, tmp_path, size, method, micro_batch
):
    model = models[size]
    doc = job(model, method, micro_batch)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    work = tmp_path / "run"
    cmd = [sys.executable, "-m", "ftjob", "run", str(path), "--workdir", str(work)]
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=hangs.RUN, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    measured = json.loads((work / "progress.json").read_text())["trainPeakRssMiB"][1] * 2**20

    spec = parse_resource(doc)[1]
    config = json.loads((model / "config.json").read_text())
    planned = estimate(spec, ModelShape.from_config(config)).per_device
    ratio = planned / measured
    print(
        f"{size} {method}: estimate {planned / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB"
    )
    assert 0.8 <= ratio <= 1.2, f"estimate/measured = {ratio:.2f}"
