"""docs/data.md's examples, as a user pastes them: every file written as shown, every job
valid by `ftjob validate`, every data file read by the trainer's own reader."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ftjob.api import manifest
from ftjob.api.jobspec import parse_resource
from ftjob.trainer.data import records

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "data.md"
BLOCK = re.compile(r"<!-- (file|run): (\S+) -->\n```\w*\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str, str]]:
    return BLOCK.findall(PAGE.read_text())


@pytest.fixture
def pasted(tmp_path, monkeypatch):
    """The page's files in a folder laid out like the repository's root."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "data").mkdir()
    for kind, name, text in blocks():
        if kind == "file":
            (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FTJOB_SOURCE_ROOT", raising=False)
    return tmp_path


def test_the_page_has_an_example_of_each_format_and_file_type():
    names = [name for kind, name, _ in blocks() if kind == "file"]
    jobs = [name for name in names if name.startswith("job-")]
    assert jobs == ["job-chat.yaml", "job-instruction.yaml", "job-text.yaml"]
    assert {Path(n).suffix for n in names} >= {".jsonl", ".csv", ".json", ".yaml"}
    assert [name for kind, name, _ in blocks() if kind == "run"] == ["python"]  # the Parquet


def test_each_job_is_valid_and_its_data_is_read_as_the_trainer_reads_it(pasted):
    jobs = sorted(pasted.glob("job-*.yaml"))
    result = subprocess.run(
        [sys.executable, "-m", "ftjob", "validate", *map(str, jobs)],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": valid -- ") == 3 and "not checked" not in result.stdout
    for job in jobs:
        (doc,) = manifest.load(job)
        ds = parse_resource(doc)[1].dataset
        rows = [row for batch in records.batches(ds, ds.split) for row in batch.to_pylist()]
        assert len(rows) == 2, (job, rows)
        if ds.format == "instruction":
            assert rows[1]["prompt"] == "Name two colours, please."
            assert rows[1]["completion"] == "Red, blue."
        if ds.format == "text":
            assert rows[0]["text"] == "Stockholm is the capital of Sweden."


def test_the_parquet_program_writes_records_the_chat_job_reads(pasted):
    ((_, _, program),) = [b for b in blocks() if b[0] == "run"]
    subprocess.run([sys.executable, "-c", program], check=True, cwd=pasted)
    (doc,) = manifest.load(pasted / "job-chat.yaml")
    doc["spec"]["dataset"]["source"] = "data/chat.parquet"
    ds = parse_resource(doc)[1].dataset
    rows = [row for batch in records.batches(ds, ds.split) for row in batch.to_pylist()]
    assert rows[0]["messages"][1] == {"role": "assistant", "content": "Stockholm."}
