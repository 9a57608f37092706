"""trainer/fetch/sources.py: an hf:// dataset is pinned to one commit for the job's life.

python -m pytest tests/unit/test_sources.py -q
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import huggingface_hub.constants
import pytest
from transformers import AutoTokenizer

from ftjob.api import contract
from ftjob.api.contract import BAD_DATA, BAD_MODEL, HUB_UNREACHABLE, TrainerError
from ftjob.api.jobspec import parse_spec
from ftjob.cli import failure
from ftjob.job.folder import JobFolder
from ftjob.operator import status
from ftjob.trainer.data import prepare
from ftjob.trainer.fetch import sources
from tests.e2e.hubmirror import COMMIT, HubMirror

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REPO = "org/chats"
MODEL = "org/tiny"


def point_at(monkeypatch, url: str) -> None:
    """huggingface_hub's requests go to ``url`` (its API's and its files' addresses)."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    template = url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)


@pytest.fixture
def mirror(monkeypatch):
    hub = HubMirror({MODEL: EXAMPLES / "tiny-model"}, datasets=(REPO,))
    point_at(monkeypatch, hub.url)
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
    assert "dataset.source hf://org/missing: not found on the Hub" in str(e.value)
    assert "dataset.revision" in e.value.fix
    assert not JobFolder(tmp_path).sources.exists()


# ------------------------------------------------------- transient and permanent failures


def model_spec():
    return parse_spec(
        {
            "model": {"source": f"hf://{MODEL}"},
            "dataset": {"source": "d.jsonl"},
            "training": {"maxSteps": 1},
        }
    )


@pytest.fixture
def quick(monkeypatch, tmp_path):
    """No real waits between tries; downloads in a cache of the test's own (a cached
    snapshot would answer for an unreachable Hub)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "RETRY_WAITS", (0.0, 0.0, 0.0))
    monkeypatch.setattr(sources.time, "sleep", lambda s: None)


def test_a_busy_hub_is_retried_in_place_and_the_download_completes(mirror, tmp_path, quick):
    mirror.answers = [503, 429]
    said = []
    fetched = sources.fetch(model_spec(), tmp_path, True, say=said.append)
    assert (Path(fetched.model.source) / "config.json").is_file()
    retries = [x for x in said if "retrying in" in x]
    # (huggingface_hub retries some requests itself: at least one failure reaches ftjob's.)
    assert retries and "the Hub request failed (HTTP 4" in " ".join(retries), said
    assert "try 1 of 4" in retries[0] and "the network or the Hub, not the model" in retries[0]
    assert "the network or the Hub, not the model" in retries[0]


def test_the_network_down_is_named_as_the_network_and_is_retryable(monkeypatch, tmp_path, quick):
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    point_at(monkeypatch, f"http://127.0.0.1:{port}")
    for fetch_it in (
        lambda: sources.fetch(model_spec(), tmp_path / "m", True, say=print),
        lambda: sources.fetch(spec(), tmp_path / "d", True, say=print),
    ):
        with pytest.raises(TrainerError) as e:
            fetch_it()
        assert e.value.reason == HUB_UNREACHABLE, str(e.value)
        assert "cannot reach the Hugging Face Hub after 4 tries" in str(e.value)
        assert "Connect" in str(e.value) and "not the " in str(e.value)
        assert "check the network" in e.value.fix and "token" not in e.value.fix
    # Not a bad model: the operator retries with a new gang, and ftjob run says what to do.
    assert HUB_UNREACHABLE not in status.PERMANENT | contract.PERMANENT
    assert "transient" in status.ADVICE[HUB_UNREACHABLE]
    assert "network" in failure.FIXES[HUB_UNREACHABLE]


@pytest.mark.parametrize(
    ("answer", "said", "fix"),
    [
        (401, "the Hub refused access", "secrets.huggingFaceToken"),
        (403, "the Hub refused access", "accept its terms"),
        (404, "not found on the Hub", "check the name and model.revision"),
    ],
)
def test_a_refusal_or_a_missing_model_fails_at_once_with_its_fix(
    mirror, tmp_path, quick, answer, said, fix
):
    mirror.always = answer
    with pytest.raises(TrainerError) as e:
        sources.fetch(model_spec(), tmp_path, True, say=print)
    assert e.value.reason == BAD_MODEL and said in str(e.value), str(e.value)
    assert fix in e.value.fix
    assert mirror.requests[f"answered {answer}"] == 1  # asked once: retrying cannot help


@pytest.mark.parametrize(
    ("status_code", "kind"),
    [(401, "denied"), (403, "denied"), (404, "missing"), (408, "transient"), (429, "transient"),
     (500, "transient"), (503, "transient"), (400, "other")],
)  # fmt: skip
def test_hub_answers_are_sorted_by_what_they_mean(status_code, kind):
    class Answered(OSError):
        response = type("R", (), {"status_code": status_code})()

    assert sources.kind(Answered()) == kind
    assert sources.kind(TimeoutError()) == sources.kind(socket.gaierror()) == "transient"
    assert sources.kind(PermissionError("cache not writable")) == "other"
