"""Which weight files the trainer reads, and what it refuses before reading any: safetensors
with an index or as one file; a pickled checkpoint only with the command that converts it.

    python -m pytest tests/unit/test_modelfiles.py -q
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftjob.api.jobspec import parse_spec
from ftjob.job import modelfiles

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-model"


def test_an_index_names_the_files_and_a_single_file_is_one():
    assert modelfiles.weight_files(TINY) == [TINY / "model.safetensors"]
    assert modelfiles.problem(TINY, "tiny") is None


def test_an_index_naming_a_missing_file_is_refused(tmp_path):
    index = {"metadata": {}, "weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (tmp_path / modelfiles.INDEX).write_text(json.dumps(index))
    (tmp_path / "model-1.safetensors").write_bytes(b"")
    assert modelfiles.weight_files(tmp_path) == [tmp_path / "model-1.safetensors",
                                                 tmp_path / "model-2.safetensors"]  # fmt: skip
    message, fix = modelfiles.problem(tmp_path, "m")
    assert "names 1 file(s) that are not there (model-2.safetensors)" in message
    assert "every file its index names" in fix


def test_no_weights_at_all_is_refused(tmp_path):
    message, fix = modelfiles.problem(tmp_path, "m")
    assert message.startswith("model.source m: no weights (model.safetensors or ")
    assert "save_pretrained" in fix


@pytest.fixture(scope="module")
def pickled(tmp_path_factory) -> Path:
    """The tiny model as a pytorch_model.bin checkpoint (what older repositories hold)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("pickled")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)
    model = AutoModelForCausalLM.from_pretrained(TINY)
    import torch

    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def test_a_pickled_checkpoint_is_refused_with_the_command_that_converts_it(pickled, tmp_path):
    message, fix = modelfiles.problem(pickled, "old-model")
    assert "PyTorch's pickle format only (pytorch_model.bin)" in message
    # The fix is a command that works: run it, and the converted folder is accepted.
    command = fix.split("e.g. ", 1)[1].split(" (copy", 1)[0].replace("OUT", str(tmp_path / "out"))
    argv = shlex.split(command)
    assert argv[0] == "python"
    subprocess.run([sys.executable, *argv[1:]], check=True, capture_output=True, timeout=120)
    assert modelfiles.problem(tmp_path / "out", "out") is None


def test_the_trainer_refuses_a_pickled_checkpoint_before_the_data(pickled):
    """Pods read the volume, not this machine: the trainer makes the same check itself, when
    it loads the tokenizer (before the data is prepared)."""
    from ftjob.trainer.model import load as model

    spec = parse_spec({"model": {"source": str(pickled)},
                       "dataset": {"source": "d.jsonl"}, "training": {"maxSteps": 1}})  # fmt: skip
    with pytest.raises(model.SourceError) as refused:
        model.load_tokenizer(spec)
    assert "pickle format only" in str(refused.value)
    assert refused.value.fix.startswith("convert it to safetensors once")
    assert refused.value.where == "spec.model.source"


@pytest.mark.parametrize(
    ("text", "error"),
    [('{"metadata": {}, "weight_ma', "JSONDecodeError"), ('{"metadata": {}}', "KeyError")],
)
def test_a_malformed_index_is_refused_naming_the_file_and_the_fix(tmp_path, text, error):
    """A truncated download: the trainer refuses it with the file and the fix, no traceback."""
    from ftjob.trainer.model import load as model

    for f in TINY.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / modelfiles.INDEX).write_text(text)
    spec = parse_spec({"model": {"source": str(tmp_path)},
                       "dataset": {"source": "d.jsonl"}, "training": {"maxSteps": 1}})  # fmt: skip
    with pytest.raises(model.SourceError) as refused:
        model.load_tokenizer(spec)
    assert str(refused.value).startswith(
        f"model.source {tmp_path}: {modelfiles.INDEX} cannot be read ({error}"
    )
    assert refused.value.fix.startswith("download or copy the checkpoint again")
    assert refused.value.where == "spec.model.source"
