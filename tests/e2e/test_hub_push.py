"""Push to the Hub: `ftjob run` with output.push uploads the export and a model card.

    python -m pytest tests/e2e/test_hub_push.py -q

The Hub is a local server that speaks its upload API as huggingface_hub calls it
(tests/e2e/hubserver.py: repository creation, preupload, Git LFS batch and basic transfer,
NDJSON commit); what it stores is downloaded back with huggingface_hub's own
snapshot_download from the local mirror (tests/e2e/hubmirror.py) and loaded. A full
fine-tune's push fails at the commit (PushFailed naming the Hub repository, the export kept);
run again with the server healthy it pushes, training nothing, and a third run pushes nothing.
Another job fails once and is retried by the restart in place, its commit answered after the
collective timeout; a LoRA job trains and pushes its merged model and adapter in one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
import yaml
from hubmirror import HubMirror
from hubserver import HubServer
from test_trainer_run import EXAMPLES, RUN_TIMEOUT, final, history, job

TOKEN = "hf_ftjob_test_token"


def doc(name: str, repo: str, **changes) -> dict:
    changes.setdefault("training", {})
    changes["training"] = {"maxSteps": 6, **changes["training"]}
    return job(
        name,
        checkpoint={"every": 4, "keep": 1},
        output={"push": [f"hf://{repo}"], **changes.pop("output", {})},
        secrets={"huggingFaceToken": {"name": "hf-token"}},
        **changes,
    )


def ftjob_run(d: dict, workdir: Path, server: HubServer) -> tuple[int, str]:
    job_file = workdir.parent / f"{workdir.name}.yaml"
    job_file.write_text(yaml.safe_dump(d, sort_keys=False))
    cmd = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(workdir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}
    # The token as the Secret gives it to a pod (HF_TOKEN); the local server speaks Git LFS's
    # basic transfer, so huggingface_hub's Xet upload is off (the real Hub takes both).
    env |= {"HF_ENDPOINT": server.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


def download(server: HubServer, repo: str, cache: Path) -> Path:
    """The repository as huggingface_hub's snapshot_download gets it from a Hub serving what
    the server stored."""
    from huggingface_hub import snapshot_download

    mirror = HubMirror({repo: server.folder(repo)})
    try:
        return Path(snapshot_download(repo, endpoint=mirror.url, cache_dir=cache))
    finally:
        mirror.close()


# Session-wide, these two: the slow tier runs last, after this module, and reuses them
# (tests/deadline.py).
@pytest.fixture(scope="session")
def server(tmp_path_factory):
    hub = HubServer(tmp_path_factory.mktemp("hub"), TOKEN)
    yield hub
    hub.close()


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


# ------------------------------------------------- a full model: a failed push, then a retry


@pytest.fixture(scope="module")
def failed(runs, server):
    """The commit fails (500) and the run ends (no restart in place); then the same command
    again with the server healthy. Returns the job folder, what the first run left, and the
    second run's exit code and output."""
    d = doc("retried", "ftjob-test/retried", runPolicy={"inPlaceRestarts": 0})
    workdir = runs / "retried"
    server.fail_commits = 1
    code, out = ftjob_run(d, workdir, server)
    assert server.fail_commits == 0, out  # the commit was reached, and failed
    first = {
        "code": code,
        "out": out,
        "record": json.loads((workdir / "logs" / "node-0.termination").read_text()),
        "steps": len(history(workdir)),
        "export": files(workdir / "model"),
        "pushed": (workdir / "pushed.json").exists(),
    }
    code, out = ftjob_run(d, workdir, server)
    return workdir, first, code, out


@pytest.fixture(scope="module")
def pushed(failed):
    """The job folder and output of the run that pushed: the retry, which trained nothing."""
    workdir, _, code, out = failed
    assert code == 0, out
    return workdir, out


def test_a_failed_push_fails_the_job_as_push_failed_and_keeps_the_export(failed, server):
    workdir, first, _, _ = failed
    assert first["code"] != 0
    assert first["record"]["outcome"] == "failed"
    assert first["record"]["reason"] == "PushFailed"
    assert first["record"]["where"] == "spec.output.push"
    assert "the push to the Hub repository hf://" in first["record"]["message"]
    assert "500" in first["record"]["message"] and "HF_TOKEN" in first["record"]["fix"]
    assert "PushFailed" in first["out"] and "run it again" in first["out"], first["out"]
    assert "model.safetensors" in first["export"] and not first["pushed"]
    assert first["steps"] > 0  # it trained before the push failed


def test_the_operator_restarts_the_gang_on_the_real_record(failed):
    """The record the failed push left, as a trainer container's termination message: the
    operator names PushFailed with its fix and replaces the gang (it is not permanent)."""
    from ftjob.api import manifest
    from ftjob.api.jobspec import parse_resource
    from ftjob.operator import lifecycle, render

    _, first, _, _ = failed
    name, spec = parse_resource(manifest.load(EXAMPLES / "tiny.yaml")[0])

    def pod(rank: int, state: dict) -> dict:
        p = render.pod(name, "ns", spec, rank, 0, "uid")
        phase = "Running" if "running" in state else "Failed"
        p["status"] = {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}]}
        p["spec"]["nodeName"] = f"node-{rank}"
        return p

    now = datetime.now(timezone.utc)
    running = [pod(0, {"running": {}}), pod(1, {"running": {}})]
    created = lifecycle.decide(spec, name, 1, None, [], now, None)
    seen = lifecycle.decide(spec, name, 1, created.status, running, now, None)
    message = json.dumps(first["record"])
    ended = pod(0, {"terminated": {"exitCode": 1, "reason": "Error", "message": message}})
    decision = lifecycle.decide(spec, name, 1, seen.status, [ended, running[1]], now, None)
    assert decision.phase == "Restarting", decision.status
    assert decision.status["failure"]["reason"] == "PushFailed"
    assert first["record"]["fix"] in decision.status["failure"]["message"]


def test_the_rerun_pushes_without_training_again(failed, pushed):
    workdir, first, _, out = failed
    assert "already trained" in out
    assert len(history(workdir)) == first["steps"]  # not one more training step
    assert files(workdir / "model") == first["export"]


def test_push_uploads_the_export_byte_for_byte_in_one_private_commit(pushed, server):
    workdir, out = pushed
    stored, export = files(server.folder("ftjob-test/retried")), files(workdir / "model")
    assert "model.safetensors" in export and "README.md" not in export
    assert {k: v for k, v in stored.items() if k != "README.md"} == export
    assert "README.md" in stored
    repo = server.repos["ftjob-test/retried"]
    assert repo["private"] is True  # output.private defaults to true
    assert len(repo["commits"]) == 1  # the failed one left none
    assert server.requests["lfs upload"] >= 1  # the weights went through LFS, not inline
    assert server.requests["unauthorized"] == 0  # every call carried HF_TOKEN
    # Recorded in the job folder and progress, and said in the log.
    url = f"{server.url}/ftjob-test/retried/commit/{repo['commits'][0]['oid']}"
    pushes = json.loads((workdir / "pushed.json").read_text())["pushes"]
    record = pushes["hf://ftjob-test/retried"]
    assert record["commitUrl"] == url and record["revision"] == repo["commits"][0]["oid"]
    assert record["repo"] == "hf://ftjob-test/retried" and record["trainedSteps"] == 6
    assert final(workdir)["pushedTo"] == [url] and final(workdir)["phase"] == "succeeded"
    assert "pushed the export to hf://ftjob-test/retried in" in out and url in out, out
    # The operator shows it in status.progress, read from the trainer's real snapshot.
    from ftjob.operator import status

    assert status.progress(final(workdir))["pushedTo"] == [url]


def test_pushed_model_downloads_and_loads_as_the_export(pushed, server, tmp_path):
    from transformers import AutoModelForCausalLM

    workdir, _ = pushed
    got = AutoModelForCausalLM.from_pretrained(download(server, "ftjob-test/retried", tmp_path))
    want = AutoModelForCausalLM.from_pretrained(workdir / "model")
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_model_card_names_base_model_data_method_hyper_parameters_and_losses(pushed, server):
    """The card of a push that trained nothing still carries the losses of the run that
    trained (progress.json kept them)."""
    from huggingface_hub import ModelCard

    workdir, _ = pushed
    card = ModelCard.load(server.folder("ftjob-test/retried") / "README.md")
    snap = final(workdir)
    assert f"**Base model:** `{EXAMPLES / 'tiny-model'}`" in card.text
    assert f"**Data:** `{EXAMPLES / 'data' / 'tiny-text.jsonl'}`" in card.text
    assert "**Method:** full fine-tune" in card.text
    assert f"**Final train loss:** {snap['loss']:.4f}" in card.text
    assert f"**Final eval loss:** {snap['evalLoss']:.4f}" in card.text
    assert "| training.learningRate | 0.003 |" in card.text
    assert card.data.library_name == "transformers" and "ftjob" in card.data.tags
    assert card.data.base_model is None  # a local path is no Hub id


def test_a_pushed_job_run_again_pushes_nothing(pushed, server):
    workdir, _ = pushed
    d = doc("retried", "ftjob-test/retried", runPolicy={"inPlaceRestarts": 0})
    code, out = ftjob_run(d, workdir, server)
    assert code == 0, out
    assert "already trained" in out
    assert len(server.commits("ftjob-test/retried")) == 1


# ------------------------------------------------------------------------- a LoRA adapter


@pytest.mark.slow  # tests/deadline.py: the push is the full model's tests; the LoRA export's
# files are test_trainer_run's
def test_lora_push_uploads_adapter_and_merged_model_that_load(runs, server, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d = doc("lora", "ftjob-test/lora", method={"type": "lora", "lora": {"r": 8, "alpha": 16}},
            output={"mergeAdapter": True, "private": False})  # fmt: skip
    code, out = ftjob_run(d, runs / "lora", server)
    assert code == 0, out
    export = files(runs / "lora" / "model")
    stored = files(server.folder("ftjob-test/lora"))
    # The merged model at the root, the adapter in adapter/; the export's own README.md (peft
    # writes one) gives way to ftjob's card.
    want = {k.removeprefix("merged/"): v for k, v in export.items() if k.startswith("merged/")}
    want |= {f"adapter/{k}": v for k, v in export.items() if "/" not in k and k != "README.md"}
    assert {"model.safetensors", "adapter/adapter_model.safetensors"} <= set(want)
    assert {k: v for k, v in stored.items() if k != "README.md"} == want
    assert server.repos["ftjob-test/lora"]["private"] is False
    card = stored["README.md"].decode()
    assert "**Method:** LoRA adapter (r 8, alpha 16" in card and "adapter/" in card
    path = download(server, "ftjob-test/lora", tmp_path)
    merged = AutoModelForCausalLM.from_pretrained(path)  # as the card says
    base = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model")
    adapted = PeftModel.from_pretrained(base, path, subfolder="adapter")
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        a, m = adapted(ids).logits, merged(ids).logits
    assert torch.allclose(a, m, atol=1e-4)
    plain = AutoModelForCausalLM.from_pretrained(EXAMPLES / "tiny-model")
    assert not torch.allclose(plain(ids).logits, m, atol=1e-4)  # it did train the adapter


# ----------------------------------------------- a restart in place, then a long upload


@pytest.mark.slow  # tests/deadline.py: a retry in place; a failed push's record is the core's
def test_a_failed_push_is_retried_in_place_and_the_others_wait_out_a_long_upload(runs, server):
    """The first rung of recovery: the node's agent restarts the workers in place, which find
    the job trained and only push. That commit is answered after 31 s, beyond
    network.collectiveTimeoutSeconds (30, its minimum; rank 1 waits for the upload before the
    commit too): rank 1 waits for rank 0's upload in a group of its own, so it is no
    collective timeout (which would take another restart)."""
    d = doc("in-place", "ftjob-test/in-place", training={"maxSteps": 2},
            network={"collectiveTimeoutSeconds": 30})  # fmt: skip
    server.fail_commits, server.commit_delay = 1, 31.0
    try:
        code, out = ftjob_run(d, runs / "in-place", server)
    finally:
        server.fail_commits, server.commit_delay = 0, 0.0
    assert code == 0, out
    assert "(after 1 restart in place)" in out, out
    assert server.requests["commit"] >= 2 and len(server.commits("ftjob-test/in-place")) == 1
    # One history row per step (logEvery 1): the restarted workers trained none again.
    assert [r["step"] for r in history(runs / "in-place")] == [1, 2]
