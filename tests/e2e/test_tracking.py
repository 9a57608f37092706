"""Experiment trackers end to end: `ftjob run` (2 processes) reporting to a real MLflow tracking
server on loopback (its own SQLite store), W&B in offline mode and TensorBoard event files, each
read back with the tracker's own client or reader; killed mid-run and rerun, the job stays one
run in each. A job that fails ends its MLflow run failed (the trainer in this process, as a
gang of one: tests/in_process.py).

    python -m pytest tests/e2e/test_tracking.py -q
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from unittest import mock

import hangs
import in_process
import mlflow
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_trainer_run import RUN_TIMEOUT, final, history, job, losses

STEPS, EVERY = 16, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on loopback with a SQLite store of its own; its address."""
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{folder}/mlflow.db", "--workers", "1",
           "--default-artifact-root", str(folder / "artifacts")]  # fmt: skip
    log = open(folder / "server.log", "w")  # noqa: SIM115 - open while the server runs
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(OSError):
            # not a hang guard: one try of a poll under the deadline
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                break
        assert server.poll() is None, (folder / "server.log").read_text()
        assert time.monotonic() < deadline, (folder / "server.log").read_text()
        time.sleep(0.5)
    yield url
    # SIGKILL at once: its workers' graceful shutdown takes ~20 s, and the store (SQLite,
    # committed per request) and the tests' reads are done.
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(hangs.FLOOR)
    log.close()


def tracked(name: str, tracking: dict) -> dict:
    return job(
        name,
        training={"maxSteps": STEPS, "logEvery": 1, "evalEvery": EVERY},
        checkpoint={"every": EVERY},
        tracking=tracking,
    )


def start(doc: dict, workdir: Path, **env: str) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    job_file = workdir.parent / f"{workdir.name}.yaml"
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    cmd = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(workdir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0", **env}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, out
    return out


@pytest.fixture(scope="module")
def killed_and_rerun(tmp_path_factory, mlflow_server):
    """One job with all three trackers: the whole gang SIGKILLed past its first checkpoint
    (steps after it are trained twice), then `ftjob run` again to the end."""
    base = tmp_path_factory.mktemp("tracked")
    workdir, wandb_dir = base / "job", base / "wandb-dir"
    doc = tracked("tracked", {
        "mlflow": {"trackingUri": mlflow_server, "experiment": "e2e"},
        "wandb": {"project": "ftjob-e2e", "mode": "offline"},
        "tensorboard": {"enabled": True},
    })  # fmt: skip
    env = {"WANDB_DIR": str(wandb_dir)}  # W&B's own files too: nothing lands in HOME
    proc = start(doc, workdir, **env)
    deadline = time.monotonic() + RUN_TIMEOUT
    committed = workdir / "checkpoints" / f"step-{EVERY:08d}" / "COMMITTED"
    while not (committed.exists() and max(losses(workdir), default=0) >= EVERY + 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    ids_before_kill = json.loads((workdir / "tracking.json").read_text())
    # The whole gang at once, as a lost node takes it (each node runs in its own session).
    gang = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in gang:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(losses(workdir))
    assert killed_at < STEPS
    out = finish(start(doc, workdir, **env))
    assert f"resuming from checkpoint {committed.parent}" in out, out
    return workdir, wandb_dir, ids_before_kill, killed_at, out


def test_mlflow_holds_one_run_with_the_spec_and_the_whole_history(killed_and_rerun, mlflow_server):
    workdir, _, ids, killed_at, _ = killed_and_rerun
    client = mlflow.MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("e2e")
    (run,) = client.search_runs([experiment.experiment_id])  # the rerun continued it
    assert run.info.run_id == ids["mlflow"]["runId"]
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["training.learningRate"] == "0.003"
    assert run.data.params["training.maxSteps"] == str(STEPS)
    assert run.data.params["resources.nodes"] == "2"
    assert run.data.tags["ftjob.export"] == str(workdir / "model")
    trained = losses(workdir)
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    # Every step once: the steps the rerun trained again were not sent twice, and those the
    # killed run's tracker had not yet sent were sent by the rerun.
    assert sorted(m.step for m in loss) == list(range(1, STEPS + 1)), (killed_at, loss)
    assert {m.step: m.value for m in loss} == pytest.approx(trained)
    lr = client.get_metric_history(run.info.run_id, "train/learning_rate")
    assert sorted(m.step for m in lr) == list(range(1, STEPS + 1))
    tps = client.get_metric_history(run.info.run_id, "train/tokens_per_second")
    assert len(tps) == STEPS and all(m.value > 0 for m in tps)
    evals = client.get_metric_history(run.info.run_id, "eval/loss")
    expected = {r["evalStep"]: r["evalLoss"] for r in history(workdir, "eval")}
    assert {m.step: m.value for m in evals} == pytest.approx(expected)
    assert sorted(expected) == list(range(EVERY, STEPS + 1, EVERY))


def test_tensorboard_event_files_hold_the_loss_series_once(killed_and_rerun):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir = killed_and_rerun[0]
    assert len(list((workdir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # 2 runs
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    # Each step once: the rerun's file holds the whole history, the killed run's is hidden.
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    trained = losses(workdir)
    assert [e.value for e in loss] == pytest.approx([trained[s] for s in range(1, STEPS + 1)])
    assert [e.step for e in events.Scalars("eval/loss")] == list(range(EVERY, STEPS + 1, EVERY))


def wandb_records(path: Path):
    """The records of a W&B run file (W&B's framing: a ':W&B' header, then 32 KiB blocks of
    leveldb-log records), decoded with W&B's own protobuf. A file cut by SIGKILL ends early."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 or len(body) < length:
            return
        parts += body
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_history(path: Path) -> dict[int, dict]:
    rows = {}
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            rows[items["_step"]] = items
    return rows


def test_wandb_offline_writes_each_attempts_run_files_under_the_one_run_id(killed_and_rerun):
    workdir, wandb_dir, ids, killed_at, _ = killed_and_rerun
    run_id = ids["wandb"]["id"]
    folders = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(folders) == 2, list((wandb_dir / "wandb").iterdir())  # `wandb sync` joins them
    first, rerun = (wandb_history(f / f"run-{run_id}.wandb") for f in folders)
    assert sorted(first) == list(range(1, len(first) + 1)) and len(first) <= killed_at
    assert sorted(rerun) == list(range(EVERY + 1, STEPS + 1))  # from its checkpoint on
    trained = losses(workdir)
    assert {s: r["train/loss"] for s, r in rerun.items()} == pytest.approx(
        {s: trained[s] for s in rerun}
    )
    assert rerun[STEPS]["eval/loss"] == pytest.approx(final(workdir)["evalLoss"])
    config = {}
    for r in wandb_records(folders[1] / f"run-{run_id}.wandb"):
        if r.WhichOneof("record_type") == "config":
            config |= {i.key: json.loads(i.value_json) for i in r.config.update}
    assert config["training.learningRate"] == "0.003"


# The slow tier (tests/deadline.py): a hanging tracker is test_trackers.py's; this, a real run.
@pytest.mark.slow
def test_a_tracker_that_is_down_never_fails_training_and_is_said_once(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    doc = tracked("down", {"mlflow": {"trackingUri": closed}})
    doc["spec"]["training"]["maxSteps"] = EVERY
    out = finish(start(doc, tmp_path / "down"))
    said = "tracking: mlflow is off for this run"
    assert out.count(said) == 1, out
    (warning,) = final(tmp_path / "down")["trackingWarnings"]
    assert warning.startswith(said) and "training goes on" in warning
    assert final(tmp_path / "down")["phase"] == "succeeded"
    assert (tmp_path / "down" / "model" / "config.json").is_file()


def test_a_failed_job_ends_its_run_failed(tmp_path, mlflow_server, monkeypatch):
    """How a failure ends the tracker's run is rank 0's alone: the trainer runs here as a
    gang of one (tests/in_process.py), no process start."""
    # Parquet: read by the trainer itself (ftjob run reads JSON lines, JSON and CSV first)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["fine", None]}), bad)
    doc = tracked("failing", {"mlflow": {"trackingUri": mlflow_server, "experiment": "fails"}})
    doc["spec"]["dataset"]["source"] = str(bad)
    doc["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 0}
    # The tracker sets MLflow's retry variables where unset: in this process, for this test.
    with mock.patch.dict(os.environ):
        failed = in_process.fails(doc, tmp_path / "failing", monkeypatch)
    assert "record 2: field 'text' must be a str" in str(failed), failed
    assert final(tmp_path / "failing")["phase"] == "failed"
    client = mlflow.MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("fails").experiment_id])
    assert run.info.status == "FAILED" and "ftjob.export" not in run.data.tags
    assert run.data.params["dataset.source"] == str(bad)
