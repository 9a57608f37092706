"""ftjob/job/folder.py: which spec changes a job folder refuses, and the record it keeps.

python -m pytest tests/unit/test_jobfolder.py -q
"""

from __future__ import annotations

import fnmatch
import json

import pytest

from ftjob.api.contract import BAD_SPEC, TrainerError
from ftjob.api.jobspec import parse_spec
from ftjob.job import folder as jobfolder
from ftjob.job.folder import BEING_WRITTEN, STEP, JobFolder, writing

RAW = {
    "model": {"source": "tiny-model"},
    "dataset": {"source": "data/train.jsonl", "maxSeqLength": 128},
    "training": {"maxSteps": 10, "learningRate": 3e-3},
    "resources": {"nodes": 2, "gpusPerNode": 0},
    "checkpoint": {"volume": {"claimName": "shared"}},
}


def spec(**sections):
    raw = {k: dict(v) for k, v in RAW.items()}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return parse_spec(raw)


@pytest.mark.parametrize(
    "change",
    [
        {"training": {"maxSteps": 500}},
        {"training": {"logEvery": 1, "evalEvery": 3}},
        {"checkpoint": {"every": 7, "keep": 9, "asyncSave": True}},
        {"output": {"mergeAdapter": False}},
        {"parallelism": {"sharding": "full"}},
        {"runPolicy": {"backoffLimit": 9}},
        {"model": {"attention": "eager"}},
    ],
)
def test_what_does_not_change_the_steps_taken_may_change(change):
    assert jobfolder.changes(jobfolder.record("j", spec()), spec(**change)) == []


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"training": {"learningRate": 1e-3}}, "spec.training.learningRate: 0.003 -> 0.001"),
        ({"training": {"seed": 7}}, "spec.training.seed: 42 -> 7"),
        ({"dataset": {"maxSeqLength": 64}}, "spec.dataset.maxSeqLength: 128 -> 64"),
        ({"model": {"source": "other"}}, 'spec.model.source: "tiny-model" -> "other"'),
        ({"resources": {"nodes": 4}}, "spec.resources.worldSize: 2 -> 4"),
        ({"method": {"type": "full"}}, 'spec.method.type: "lora" -> "full"'),
    ],
)
def test_what_changes_training_is_named(change, line):
    assert line in jobfolder.changes(jobfolder.record("j", spec()), spec(**change))


def test_claim_records_refuses_and_keeps_what_the_export_holds(tmp_path):
    jobfolder.write(tmp_path, "j", spec(), trained_steps=10)
    JobFolder(tmp_path).step(10).mkdir(parents=True)  # trained state the record vouches for
    record = jobfolder.claim(tmp_path, "j", spec(training={"maxSteps": 20}), writer=True)
    assert record["trainedSteps"] == 10  # a safe change keeps what the export holds
    on_disk = json.loads((tmp_path / jobfolder.RECORD).read_text())
    assert on_disk["spec"]["training"]["maxSteps"] == 20 and on_disk["trainedSteps"] == 10
    with pytest.raises(TrainerError) as refused:
        jobfolder.claim(tmp_path, "j", spec(training={"learningRate": 1.0}), writer=False)
    assert refused.value.reason == BAD_SPEC
    assert "spec.training.learningRate: 0.003 -> 1.0" in str(refused.value)
    assert json.loads((tmp_path / jobfolder.RECORD).read_text()) == on_disk  # untouched


def test_a_changed_spec_is_refused_only_when_trained_state_depends_on_the_record(tmp_path):
    """A run that failed before its first checkpoint (bad data, a download) left nothing a
    fixed spec could mix with: the fix replaces the record; a checkpoint or an export makes
    the same change a refusal naming what was trained."""
    jobfolder.write(tmp_path, "j", spec(dataset={"messagesField": "messages"}))
    fixed = spec(dataset={"messagesField": "conversation"})
    record = jobfolder.claim(tmp_path, "j", fixed, writer=True)
    assert record["spec"]["dataset"]["messagesField"] == "conversation"
    on_disk = json.loads((tmp_path / jobfolder.RECORD).read_text())
    assert on_disk["spec"]["dataset"]["messagesField"] == "conversation"
    assert "trainedSteps" not in on_disk
    for held, said in (
        (JobFolder(tmp_path).step(4), "checkpoints up to step 4"),
        (tmp_path / "model", f"an export in {tmp_path / 'model'}"),
    ):
        held.mkdir(parents=True)
        with pytest.raises(TrainerError) as refused:
            jobfolder.claim(tmp_path, "j", spec(dataset={"source": "other.jsonl"}), writer=True)
        assert said in str(refused.value).splitlines()[0]
        assert 'spec.dataset.source: "data/train.jsonl" -> "other.jsonl"' in str(refused.value)
        held.rmdir()
    # A half-written checkpoint is no trained state (a crash before its commit).
    writing(JobFolder(tmp_path).step(8)).mkdir(parents=True)
    assert jobfolder.conflicts(tmp_path, on_disk, spec(training={"seed": 1})) == []


def test_a_record_written_before_fingerprints_is_still_compared(tmp_path):
    old = {k: v for k, v in jobfolder.record("j", spec()).items() if k == "spec"}
    assert jobfolder.changes(old, spec()) == []
    assert jobfolder.changes(old, spec(training={"seed": 1})) == ["spec.training.seed: 42 -> 1"]


# ------------------------------------------------------------------ the export's swap


def folder(path, text: str):
    path.mkdir()
    (path / "model.safetensors").write_text(text)
    return path


def test_a_new_export_replaces_the_old_one_whole(tmp_path):
    out = folder(tmp_path / "model", "old")
    jobfolder.swap_in_export(folder(tmp_path / ".tmp-model", "new"), out)
    assert (out / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_crash_between_the_renames_leaves_the_old_export_found(tmp_path, monkeypatch):
    """The process dies after moving the old export aside, before moving the new one in: the
    next run (and ftjob's "already trained" check) finds the old export, complete, in place."""
    out = folder(tmp_path / "model", "old")
    new = folder(tmp_path / ".tmp-model", "new")
    real, calls = type(out).rename, []

    def crash_on_second(self, target):
        calls.append(self.name)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real(self, target)

    monkeypatch.setattr(type(out), "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        jobfolder.swap_in_export(new, out)
    monkeypatch.undo()
    assert calls == ["model", ".tmp-model"] and not out.exists()  # the crash window
    assert jobfolder.export_present(out)
    jobfolder.recover_export(out)
    assert (out / "model.safetensors").read_text() == "old"
    # The next export swaps in over the recovered one, never deleting it first.
    jobfolder.swap_in_export(new, out)
    assert (out / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_swap_after_a_crash_keeps_the_only_complete_export(tmp_path):
    """An aside copy with nothing in place is the only complete export: the next swap puts
    it back before anything is removed (the old code removed it first)."""
    folder(tmp_path / ".old-model", "old")
    out = tmp_path / "model"
    assert jobfolder.export_present(out) and not out.exists()
    real = type(out).rename

    def crash_moving_in(self, target):
        if self.name == ".tmp-model":
            raise KeyboardInterrupt("killed before the new export moved in")
        return real(self, target)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(out), "rename", crash_moving_in)
        with pytest.raises(KeyboardInterrupt):
            jobfolder.swap_in_export(folder(tmp_path / ".tmp-model", "new"), out)
    jobfolder.recover_export(out)
    assert (out / "model.safetensors").read_text() == "old"


def test_no_export_is_no_export(tmp_path):
    assert not jobfolder.export_present(tmp_path / "model")
    jobfolder.recover_export(tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_the_objective_and_dpo_settings_change_training():
    dpo = {"dataset": {"format": "preference"}, "training": {"objective": "dpo"}}
    base = spec(**dpo)
    assert 'spec.training.objective: "sft" -> "dpo"' in jobfolder.changes(
        jobfolder.record("j", spec()), base
    )
    beta = spec(dataset=dpo["dataset"], training={"objective": "dpo", "dpo": {"beta": 0.3}})
    assert any("spec.training.dpo" in line for line in jobfolder.changes(
        jobfolder.record("j", base), beta))  # fmt: skip


def test_the_job_folder_names_every_path_in_it(tmp_path):
    folder = JobFolder(tmp_path)
    assert folder.step(200) == tmp_path / "checkpoints" / "step-00000200"
    assert STEP.match(folder.step(7).name).group(1) == "00000007"
    assert writing(folder.step(3)) == tmp_path / "checkpoints" / ".tmp-step-00000003"
    assert fnmatch.fnmatch(writing(folder.step(3)).name, BEING_WRITTEN)
    assert not folder.has_checkpoints()
    folder.step(5).mkdir(parents=True)
    assert folder.has_checkpoints()
    assert folder.node_log(1) == tmp_path / "logs" / "node-1.log"
    assert folder.node_termination(1) == tmp_path / "logs" / "node-1.termination"
    assert (folder.record, folder.owner, folder.progress) == (
        tmp_path / "spec.json",
        tmp_path / "owner",
        tmp_path / "progress.json",
    )
    assert folder.export(spec()) == tmp_path / "model"
    assert folder.export(spec(output={"path": "out/final"})) == tmp_path / "out" / "final"
