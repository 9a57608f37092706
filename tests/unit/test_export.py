"""What a run leaves for the next one and for other people: the export's files and the
progress a rerun starts from (trainer/state/export.py, trainer/report/progress.py).

python -m pytest tests/unit/test_export.py -q
"""

from __future__ import annotations

import json
import os

from ftjob.api.jobspec import parse_spec
from ftjob.trainer.report import progress
from ftjob.trainer.state import export


def adapter(tmp_path, source: str, revision: str | None = None):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "/home/trainer/.cache/hub/snapshots/abc", "r": 8})
    )
    (folder / "README.md").write_text(
        "---\nbase_model: /home/trainer/.cache/hub/snapshots/abc\nlibrary_name: peft\ntags:\n"
        "- base_model:adapter:/home/trainer/.cache/hub/snapshots/abc\n- lora\n---\n# x\n"
    )
    model = {"source": source} | ({"revision": revision} if revision else {})
    raw = {"model": model, "dataset": {"source": "d.jsonl"}, "training": {"maxSteps": 1}}
    export._name_base(folder, parse_spec(raw).model)
    return json.loads((folder / "adapter_config.json").read_text())


def test_an_adapter_names_the_hub_id_and_revision_of_an_hf_source(tmp_path):
    config = adapter(tmp_path, "hf://meta-llama/Meta-Llama-3-8B", "v1.0")
    assert config["base_model_name_or_path"] == "meta-llama/Meta-Llama-3-8B"
    assert config["revision"] == "v1.0" and config["r"] == 8
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "base_model: meta-llama/Meta-Llama-3-8B" in card and "/home/trainer" not in card
    assert "- base_model:adapter:meta-llama/Meta-Llama-3-8B" in card and "- lora" in card


def test_an_adapter_names_a_path_source_by_its_absolute_path(tmp_path, monkeypatch):
    """A relative source is read beside the job file: the adapter names that folder whole, so
    it loads from any working directory."""
    monkeypatch.setenv("FTJOB_SOURCE_ROOT", str(tmp_path / "jobs"))
    config = adapter(tmp_path, "models/llama-3-8b")
    assert config["base_model_name_or_path"] == str(tmp_path / "jobs" / "models" / "llama-3-8b")
    assert "revision" not in config
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "base_model" not in card and "library_name: peft" in card  # a card's base is a Hub id


def test_export_files_get_the_umasks_mode(tmp_path):
    folder = tmp_path / ".tmp-model"
    (folder / "merged").mkdir(parents=True)
    for name in ("model.safetensors", "merged/model.safetensors"):
        (folder / name).write_bytes(b"x")
        os.chmod(folder / name, 0o600)  # as safetensors writes them
    old = os.umask(0o027)
    try:
        export.readable_like_the_folder(folder)
    finally:
        os.umask(old)
    modes = {p.name + ("/" if p.is_dir() else ""): p.stat().st_mode & 0o777
             for p in [folder, *folder.rglob("*")]}  # fmt: skip
    assert modes == {".tmp-model/": 0o750, "merged/": 0o750, "model.safetensors": 0o640}
    assert not (folder / ".umask-probe").exists()


def finished(job_dir, **fields):
    snap = {"phase": "succeeded", "step": 60, "totalSteps": 60, "loss": 1.25, "evalLoss": 1.5,
            "tokensSeen": 9000, "port": 1234, "startedAt": "then", "resumedFrom": "x",
            "lastCheckpoint": str(job_dir / "checkpoints" / "step-00000056"),
            "lastCheckpointStep": 56, "exportPath": str(job_dir / "model"), **fields}  # fmt: skip
    (job_dir / "progress.json").write_text(json.dumps(snap))


def test_a_rerun_starts_from_the_previous_runs_numbers(tmp_path):
    finished(tmp_path)
    report = progress.Progress(tmp_path, True, None, 2, writes_files=False)
    report.own_folder()
    report.close()
    snap = json.loads((tmp_path / "progress.json").read_text())
    assert snap["phase"] == "starting"  # this run's phase, times and port
    assert (snap["step"], snap["totalSteps"], snap["loss"], snap["evalLoss"]) == (60, 60, 1.25, 1.5)
    assert snap["tokensSeen"] == 9000 and snap["lastCheckpointStep"] == 56
    assert snap["resumedFrom"] is None and snap["exportPath"] is None
    assert snap["startedAt"] != "then" and snap["port"] is None


def test_a_folder_moved_here_keeps_its_numbers_not_its_paths(tmp_path):
    finished(tmp_path, lastCheckpoint="/elsewhere/checkpoints/step-00000056")
    report = progress.Progress(tmp_path, True, None, 2, writes_files=False)
    report.own_folder()
    report.begin(56)  # training resumes: this attempt's tokens count from zero
    report.close()
    snap = json.loads((tmp_path / "progress.json").read_text())
    assert snap["step"] == 56 and snap["loss"] == 1.25 and snap["tokensSeen"] == 0
    assert snap["lastCheckpoint"] is None and snap["lastCheckpointStep"] is None
