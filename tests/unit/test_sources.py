"""trainer/data/sources.py: an hf:// dataset is pinned to one commit for the job's life.

python -m pytest tests/unit/test_sources.py -q
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import huggingface_hub.constants
import pytest
from transformers import AutoTokenizer

from ftjob.api.contract import BAD_DATA, TrainerError
from ftjob.api.spec import parse_spec
from ftjob.job.folder import JobFolder
from ftjob.trainer.data import prepare, sources
from tests.e2e.hubmirror import COMMIT, HubMirror

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REPO = "org/chats"


@pytest.fixture
def mirror(monkeypatch):
    hub = HubMirror({}, datasets=(REPO,))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    yield hub
    hub.close()


def spec(**dataset):
    return parse_spec(
        {
            "model": {"source": str(EXAMPLES / "tiny-model")},
            "dataset": {"source": f"hf://{REPO}", **dataset},
            "training": {"maxSteps": 1},
        }
    )


def test_rank_zero_pins_the_commit_once_and_restarts_keep_it(mirror, tmp_path):
    got = {}
    waiter = threading.Thread(
        target=lambda: got.update(rank1=sources.fetch(spec(), tmp_path, False, say=print)),
        daemon=True,
    )
    waiter.start()
    rank0 = sources.fetch(spec(), tmp_path, True, say=print)
    waiter.join(timeout=60)
    assert rank0.dataset.revision == got["rank1"].dataset.revision == COMMIT
    assert mirror.requests["dataset info"] == 1  # the waiting rank never asked the Hub
    recorded = json.loads(JobFolder(tmp_path).sources.read_text())
    assert recorded == {f"dataset hf://{REPO}@main": COMMIT}
    # The Hub moves on; a restart of this job keeps its commit and asks nothing.
    mirror.commit = "f" * 40
    assert sources.fetch(spec(), tmp_path, True).dataset.revision == COMMIT
    assert mirror.requests["dataset info"] == 1


def test_a_new_commit_gets_a_new_prepared_data_key(mirror, tmp_path):
    tok = AutoTokenizer.from_pretrained(EXAMPLES / "tiny-model")
    old = sources.fetch(spec(), tmp_path / "a", True)
    mirror.commit = "f" * 40
    new = sources.fetch(spec(), tmp_path / "b", True)
    assert new.dataset.revision == "f" * 40
    assert prepare.key(old, tok) != prepare.key(new, tok)
    # A commit given in the spec is used as it is, without asking.
    pinned = sources.fetch(spec(revision=COMMIT), tmp_path / "c", True)
    assert pinned.dataset.revision == COMMIT and mirror.requests["dataset info"] == 2
    assert prepare.key(pinned, tok) == prepare.key(old, tok)


def test_an_unknown_dataset_names_the_field_and_the_fix(mirror, tmp_path):
    with pytest.raises(TrainerError) as e:
        sources.fetch(spec(source="hf://org/missing"), tmp_path, True)
    assert e.value.reason == BAD_DATA
    assert "dataset.source hf://org/missing: cannot find it" in str(e.value)
    assert "dataset.revision" in str(e.value)
    assert not JobFolder(tmp_path).sources.exists()
