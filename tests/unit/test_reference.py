"""The key of a full fine-tune's stored DPO reference log-probabilities
(trainer/objectives/reference.py):
the same model, precision and pairs reuse them; a change to any of them does not."""

import os
import shutil
from pathlib import Path

from ftjob.api.jobspec import parse_spec
from ftjob.trainer.objectives import reference

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"


def spec(model: Path, **training):
    return parse_spec(
        {
            "model": {"source": str(model)},
            "dataset": {"source": "pairs.jsonl", "format": "preference"},
            "method": {"type": "full"},
            "training": {"objective": "dpo", "maxSteps": 1, **training},
        }
    )


def test_the_key_names_the_model_weights_precision_data_and_pair_counts(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    data = tmp_path / "data" / "0123456789abcdef"
    counts = {"train": 450, "eval": 50}
    first = reference.key(spec(model), data, counts)  # bf16: the default on GPUs
    assert reference.key(spec(model), data, counts) == first  # a restart: the same key
    assert reference.key(spec(model), data.with_name("fedcba9876543210"), counts) != first
    assert reference.key(spec(model), data, {"train": 450, "eval": 40}) != first
    assert reference.key(spec(model, precision="fp32"), data, counts) != first
    # Other weights in the same folder (rewritten files): a new key.
    (weights,) = model.glob("*.safetensors")
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert reference.key(spec(model), data, counts) != first
