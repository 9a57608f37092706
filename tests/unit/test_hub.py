"""output.push: the spec's checks, the job folder's push record, the model card.

    python -m pytest tests/unit/test_hub.py -q

The upload itself runs against a local Hub in tests/e2e/test_hub_push.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftjob.api import contract
from ftjob.api.jobspec import parse_spec
from ftjob.api.schema import SpecError
from ftjob.cli import failure
from ftjob.job import folder as jobfolder
from ftjob.job import inputs
from ftjob.operator import status
from ftjob.trainer.state import push

TOKEN = {"huggingFaceToken": {"name": "hf", "key": "token"}}
RAW = {
    "model": {"source": "hf://org/base", "revision": "v1"},
    "dataset": {"source": "hf://org/data", "maxSeqLength": 128},
    "method": {"type": "lora", "lora": {"r": 8, "alpha": 16}},
    "training": {"maxSteps": 10, "learningRate": 3e-4},
    "resources": {"gpusPerNode": 0},
}


def spec(output=None, secrets=TOKEN, **sections):
    raw = {**RAW, **sections, "output": output or {}, "secrets": secrets}
    return parse_spec(raw)


def errors(**kw) -> list[str]:
    with pytest.raises(SpecError) as e:
        spec(**kw)
    return [str(x) for x in e.value.errors]


def test_push_defaults_to_off_and_private():
    assert spec().output.push is None
    assert spec({"push": ["hf://my-org/my-model"]}).output.private is True


def test_a_push_without_a_token_is_refused_naming_both_fields():
    (error,) = errors(output={"push": ["hf://my-org/my-model"]}, secrets={})
    assert error.startswith("spec.output.push:") and "secrets.huggingFaceToken" in error


@pytest.mark.parametrize(
    "target", ["my-model", "org/name", "hf://name", "hf://org/a/b", "s3://o/n"]
)
def test_a_push_target_must_be_a_hub_repository_with_its_namespace(target):
    (error,) = errors(output={"push": [target]})
    assert error.startswith("spec.output.push[0]:") and "hf://org/name" in error, error


def test_adding_a_push_to_a_trained_job_does_not_change_its_training():
    before = jobfolder.record("j", spec())
    after = spec({"push": ["hf://my-org/my-model"], "private": False})
    assert jobfolder.changes(before, after) == []


def test_a_push_is_pending_until_recorded_for_this_repository_and_export(tmp_path):
    job = spec({"push": ["hf://my-org/a"]})
    recorded = {"trainedSteps": 10}
    assert not jobfolder.push_pending(spec(), tmp_path, recorded)  # no push asked
    assert jobfolder.push_pending(job, tmp_path, recorded)
    jobfolder.record_push(tmp_path, job, recorded, "hf://my-org/a", commitUrl="u", revision="r")
    assert not jobfolder.push_pending(job, tmp_path, recorded)
    assert jobfolder.pushed(tmp_path)["hf://my-org/a"]["commitUrl"] == "u"
    # Another repository, or a continued job's new export, is pushed again.
    assert jobfolder.push_pending(spec({"push": ["hf://my-org/b"]}), tmp_path, recorded)
    assert jobfolder.push_pending(job, tmp_path, {"trainedSteps": 20})


def test_each_destination_is_pending_until_its_own_push_is_recorded(tmp_path):
    """Two destinations: one pushed (the other's upload failed) leaves only the other pending,
    and the one done keeps its record when the other's is written."""
    both = ["hf://my-org/a", "s3://exports/a"]
    job, recorded = spec({"push": both}), {"trainedSteps": 10}
    assert jobfolder.pending_pushes(job, tmp_path, recorded) == both
    jobfolder.record_push(tmp_path, job, recorded, both[1], commitUrl="s3://exports/a")
    assert jobfolder.pending_pushes(job, tmp_path, recorded) == [both[0]]
    jobfolder.record_push(tmp_path, job, recorded, both[0], commitUrl="u")
    assert jobfolder.pending_pushes(job, tmp_path, recorded) == []
    assert set(jobfolder.pushed(tmp_path)) == set(both)


def test_a_push_record_written_before_destinations_were_listed_is_read(tmp_path):
    """pushed.json of one record (a job folder from before): its destination counts as done."""
    job, recorded = spec({"push": ["hf://my-org/a"]}), {"trainedSteps": 10}
    old = {**jobfolder.push_key(job, recorded, "hf://my-org/a"), "commitUrl": "u"}
    (tmp_path / "pushed.json").write_text(json.dumps(old))
    assert jobfolder.pending_pushes(job, tmp_path, recorded) == []


def test_a_destination_listed_twice_is_refused():
    (error,) = errors(output={"push": ["hf://my-org/a", "hf://my-org/a"]})
    assert error.startswith("spec.output.push:") and "once" in error, error


def test_ftjob_run_leaves_a_trained_job_whose_push_is_pending_to_the_trainer(tmp_path: Path):
    job = spec({"push": ["hf://my-org/a"]})
    (tmp_path / "model").mkdir()
    (tmp_path / "progress.json").write_text(json.dumps({"phase": "succeeded"}))
    recorded = jobfolder.write(tmp_path, "j", job, trained_steps=10)
    assert inputs.already_trained(job, tmp_path, recorded) is None
    jobfolder.record_push(tmp_path, job, recorded, "hf://my-org/a", commitUrl="u")
    assert inputs.already_trained(job, tmp_path, recorded) == tmp_path / "model"


@pytest.mark.parametrize("reason", [contract.PUSH_FAILED, contract.HUB_PUSH_FAILED])
def test_push_failed_is_named_everywhere_and_retryable(reason):
    """PushFailed, and HubPushFailed, which trainers wrote before it (still understood)."""
    assert reason in contract.REASONS and reason not in contract.NOT_IN_PLACE
    assert reason not in status.PERMANENT and "output.push" in status.ADVICE[reason]
    assert "run it again" in failure.FIXES[reason]
    assert contract.PHASES.index("pushing") == contract.PHASES.index("exporting") + 1


def test_the_card_carries_hub_metadata_and_what_the_run_was():
    from huggingface_hub import ModelCard

    job = spec({"push": ["hf://my-org/tuned"], "mergeAdapter": True})
    text = push.model_card(job, {"trainedSteps": 10}, {"loss": 1.23456, "evalLoss": 2.5})
    card = ModelCard(text)
    assert card.data.base_model == "org/base" and card.data.datasets == ["org/data"]
    # The merged model is the repository's root: transformers loads it.
    assert card.data.library_name == "transformers" and {"ftjob", "lora"} <= set(card.data.tags)
    assert "**Base model:** `hf://org/base` (revision `v1`)" in card.text
    assert "**Data:** `hf://org/data`" in card.text
    assert "**Method:** LoRA adapter (r 8, alpha 16.0" in card.text and "adapter/" in card.text
    assert (
        "**Final train loss:** 1.2346" in card.text and "**Final eval loss:** 2.5000" in card.text
    )
    assert "| training.learningRate | 0.0003 |" in card.text
    assert 'AutoModelForCausalLM.from_pretrained("my-org/tuned")  # the merged' in card.text
    assert 'PeftModel.from_pretrained(base, "my-org/tuned", subfolder="adapter")' in card.text
    assert 'AutoModelForCausalLM.from_pretrained("org/base")' in card.text


def test_an_adapter_alone_is_the_repository_and_a_merge_moves_it_to_adapter(tmp_path):
    for name in ("adapter_config.json", "README.md", "merged/config.json", "merged/x.safetensors"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    merged = push.layout(spec({"push": ["hf://o/n"], "mergeAdapter": True}), tmp_path)
    assert {k: v.relative_to(tmp_path).as_posix() for k, v in merged.items()} == {
        "config.json": "merged/config.json",
        "x.safetensors": "merged/x.safetensors",
        "adapter/adapter_config.json": "adapter_config.json",
    }
    alone = push.layout(spec({"push": ["hf://o/n"]}), tmp_path)
    assert set(alone) == {"adapter_config.json", "merged/config.json", "merged/x.safetensors"}


def test_a_full_fine_tunes_card_without_an_evaluation_says_so():
    job = spec({"push": ["hf://my-org/tuned"]}, method={"type": "full"})
    text = push.model_card(job, {"trainedSteps": 10}, {"loss": 1.0})
    assert "**Method:** full fine-tune" in text and "**Final eval loss:** n/a" in text
    assert 'AutoModelForCausalLM.from_pretrained("my-org/tuned")' in text


def test_a_push_with_no_token_at_all_fails_as_push_failed_naming_the_hub_and_hf_token(
    tmp_path, monkeypatch
):
    """The spec asks for the Secret; a pod (or `ftjob run`) that still has no token fails
    before any request, named, with nothing recorded as pushed (one process, no gang)."""
    import huggingface_hub.constants
    import torch

    from ftjob.trainer.model import parallel
    from ftjob.trainer.report import progress

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    job = spec({"push": ["hf://my-org/tuned"]})
    jobfolder.write(tmp_path, "j", job, trained_steps=10)
    (tmp_path / "model").mkdir()
    report = progress.Progress(tmp_path, True, None, 1, writes_files=False)
    one = parallel.Dist(0, 0, 1, 1, torch.device("cpu"))
    with pytest.raises(contract.TrainerError) as e:
        push.push(job, tmp_path, tmp_path / "model", one, report)
    assert e.value.reason == contract.PUSH_FAILED and e.value.where == "spec.output.push"
    assert "the push to the Hub repository hf://my-org/tuned failed" in str(e.value)
    assert "HF_TOKEN is not set" in str(e.value) and "HF_TOKEN" in e.value.fix
    assert jobfolder.pushed(tmp_path) == {} and report.snapshot.get("pushedTo") is None


def test_a_dpo_jobs_card_says_dpo_and_its_held_out_reward_accuracy(tmp_path):
    from huggingface_hub import ModelCard

    from ftjob.trainer.report import progress

    job = spec(
        {"push": ["hf://my-org/tuned"]},
        dataset={"source": "hf://org/pairs", "format": "preference", "maxSeqLength": 128},
        training={"maxSteps": 10, "objective": "dpo", "dpo": {"beta": 0.2}},
    )
    report = progress.Progress(tmp_path, True, total=10, world=1)  # what rank 0 reports
    report.begin(0)
    report.step(10, 1e-4, 1.0)
    report.logged(10, 0.55, 100, 0.0, rewardAccuracy=0.9, rewardMargin=0.4,
                  chosenReward=0.3, rejectedReward=-0.1)  # fmt: skip
    report.evaluated(10, 0.6, rewardAccuracy=0.75, rewardMargin=0.25,
                     chosenReward=0.2, rejectedReward=-0.05)  # fmt: skip
    card = ModelCard(push.model_card(job, {"trainedSteps": 10}, report.snapshot))
    assert "dpo" in card.data.tags
    assert "trained by DPO on preference pairs (beta 0.2, sigmoid loss)" in card.text
    assert "**Final eval reward accuracy:** 0.7500" in card.text
    assert "**Final eval reward margin:** 0.2500" in card.text
    report.close()
    # Next-token training says nothing of rewards.
    sft = ModelCard(push.model_card(spec({"push": ["hf://my-org/tuned"]}), {}, {"loss": 1.0}))
    assert "dpo" not in sft.data.tags and "reward" not in sft.text
