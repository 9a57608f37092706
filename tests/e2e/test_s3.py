"""s3:// sources against a real S3-compatible server (SeaweedFS, scripts/s3.sh): downloads once
per content into the volume's shared cache, verified, resumed after the downloader is killed
and after the server stops mid-download; each refusal named; a job run from them.

    python -m pytest tests/e2e/test_s3.py -q
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hangs
import psutil
import pytest
import yaml
from hubserver import HubServer
from test_trainer_run import EXAMPLES, RUN_TIMEOUT, final, job

from ftjob.api.contract import BAD_DATA, BAD_MODEL, STORE_UNREACHABLE, TrainerError
from ftjob.api.jobspec import parse_resource
from ftjob.api.source import parse
from ftjob.trainer.fetch import s3, sources

MODEL = EXAMPLES / "tiny-model"
DATA = EXAMPLES / "data" / "tiny-text.jsonl"
HF_TOKEN = "hf_ftjob_test_token"  # the token the local Hub server takes


@pytest.fixture(scope="module")
def store(s3_server):
    """The server with the tiny model and data set in bucket ``models`` and ``data``."""
    s3_server.upload("models", MODEL, "tiny-model")
    s3_server.upload("data", DATA, "tiny-text.jsonl")
    return s3_server


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith(".")}  # fmt: skip


def test_downloaded_once_per_content_and_verified(store, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
    for k, v in store.env("admin").items():
        monkeypatch.setenv(k, v)
    said: list[str] = []
    folder, objects = s3.download(parse("s3://models/tiny-model"), tmp_path, said.append)
    assert files(folder) == files(MODEL)  # every byte, at the same relative paths
    assert any("downloaded s3://models/tiny-model" in m for m in said), said
    # A second job asking for the same content reads the same copy and downloads nothing.
    said.clear()
    again, _ = s3.download(parse("s3://models/tiny-model/"), tmp_path, said.append)
    assert again == folder and said == []
    # One object is a file of its own name (a data set); a changed object is a new copy.
    data, _ = s3.download(parse("s3://data/tiny-text.jsonl"), tmp_path, said.append)
    assert data.name == "tiny-text.jsonl" and data.read_bytes() == DATA.read_bytes()
    store.upload("data", DATA.with_name("tiny-pairs.jsonl"), "changed.jsonl")
    first, _ = s3.download(parse("s3://data/changed.jsonl"), tmp_path, said.append)
    store.upload("data", DATA, "changed.jsonl")
    second, _ = s3.download(parse("s3://data/changed.jsonl"), tmp_path, said.append)
    assert first.parent != second.parent and second.read_bytes() == DATA.read_bytes()
    assert first.read_bytes() == DATA.with_name("tiny-pairs.jsonl").read_bytes()


def _fetch(source: str, job_dir: Path, field: str = "model") -> TrainerError:
    doc = job("s3", model={"source": str(MODEL)}, dataset={"source": str(DATA)})
    doc["spec"][field]["source"] = source
    _, spec = parse_resource(doc)
    with pytest.raises(TrainerError) as e:
        sources.fetch(spec, job_dir, True, say=lambda m: None)
    return e.value


@pytest.mark.parametrize(
    ("who", "source", "field", "reason", "words"),
    [
        ("admin", "s3://no-such-bucket/tiny-model", "model", BAD_MODEL, "no bucket 'no-such-b"),
        ("admin", "s3://models/no-such-model", "model", BAD_MODEL, "no object at this key"),
        ("admin", "s3://data/no-such.jsonl", "dataset", BAD_DATA, "no object at this key"),
        ("stranger", "s3://models/tiny-model", "model", BAD_MODEL, "refused the credentials"),
        ("reader", "s3://models/tiny-model", "model", BAD_MODEL, "denied the request"),
        ("reader", "s3://data/tiny-text.jsonl", "dataset", BAD_DATA, "denied the request"),
    ],
)  # fmt: skip
def test_each_refusal_named(store, tmp_path, monkeypatch, who, source, field, reason, words):
    for k, v in store.env(who).items():
        monkeypatch.setenv(k, v)
    e = _fetch(source, tmp_path / "job", field)
    assert e.reason == reason and e.where == f"spec.{field}.source", str(e)
    assert source in str(e) and words in str(e), str(e)
    assert e.fix and ("AWS_" in e.fix or "aws s3 ls" in e.fix or "bucket" in e.fix), e.fix
    # Nothing was recorded: the fixed spec's next run asks again.
    assert not (tmp_path / "job" / "sources.json").exists()


def test_an_endpoint_that_does_not_answer_is_transient(store, tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for k, v in {**store.env("admin"), "AWS_ENDPOINT_URL": closed}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FTJOB_S3_RETRY_SECONDS", "2")
    started = time.monotonic()
    e = _fetch("s3://models/tiny-model", tmp_path / "job")
    assert e.reason == STORE_UNREACHABLE and "did not answer" in str(e), str(e)
    # A refused connection takes a millisecond: a second of them is retries (0.2 s, 0.4 s...).
    assert time.monotonic() - started >= 1  # retried before it gave up
    assert STORE_UNREACHABLE not in {BAD_DATA, BAD_MODEL}


# A download in its own process, as a pod's rank 0 is: small parts, so that it is killed and
# the server stopped while most of the object is still to come.
DOWNLOADER = """
import sys
from pathlib import Path
from ftjob.api.source import parse
from ftjob.trainer.fetch import s3
s3.PART_BYTES, s3.PARALLEL, s3.RECORD_BYTES, s3.SAY_EVERY_SECONDS = 2**20, 2, 2**21, 0.5
path, _ = s3.download(parse(sys.argv[1]), Path(sys.argv[2]), lambda m: print(m, flush=True))
print("LOCAL", path, flush=True)
"""


def _downloader(url: str, cache: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DOWNLOADER, url, str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env})  # fmt: skip


def _recorded_offset(cache: Path) -> int:
    states = list(cache.rglob("*.part.json"))
    return json.loads(states[0].read_text())["done"] if states else 0


def _wait_for(check, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _crash(store) -> None:
    """The server killed (SIGKILL), as a lost node takes it, not stopped as scripts/s3.sh down
    stops it. Its state stays for store.up()."""
    pid = int((store.dir / "pid").read_text())
    os.kill(pid, signal.SIGKILL)

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    _wait_for(gone, hangs.FLOOR)
    store.down()  # forgets the pid (no weed runs there now)


def test_resumes_after_a_kill_and_a_server_restart(store, tmp_path):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(os.urandom(48 * 2**20))
    store.upload("models", blob, "big/weights.bin")
    cache, env = tmp_path / "cache", store.env("admin")
    # 1. The downloader dies (a pod evicted) with part of the object on the volume.
    first = _downloader("s3://models/big", cache, env)
    _wait_for(lambda: _recorded_offset(cache) >= 4 * 2**20, hangs.after(30))
    first.kill()
    first.wait()
    kept = _recorded_offset(cache)
    assert 0 < kept < blob.stat().st_size
    # 2. The next one starts while the server is down (killed under it: waiting for the
    # rest to be under way raced a quiet machine, where 44 MiB from loopback come between two
    # looks), retries until it is back, and resumes there.
    _crash(store)
    second = _downloader("s3://models/big", cache, env)
    try:
        time.sleep(3)
        assert second.poll() is None, second.communicate()[0]  # still retrying
        store.up()
        out, _ = second.communicate(timeout=hangs.after(60))
    finally:
        second.kill()
    assert second.returncode == 0, out
    assert f"resuming big/weights.bin at {kept // 2**20} of 48 MiB" in out, out
    local = Path(out.split("LOCAL ")[1].strip()) / "weights.bin"
    assert hashlib.sha256(local.read_bytes()).digest() == hashlib.sha256(blob.read_bytes()).digest()
    assert not list(cache.rglob("*.part*"))  # nothing half-written left behind


@pytest.fixture(scope="module")
def from_s3(store, tmp_path_factory) -> tuple[Path, str]:
    """`ftjob run` of a two-node job whose model and data are s3:// sources, in a folder of
    job folders (a volume): the folder and the run's output."""
    env = {**os.environ, **store.env("admin"), "OMP_NUM_THREADS": "1",
           "FTJOB_PROGRESS_PORT": "0"}  # fmt: skip
    env.pop("AWS_ENDPOINT_URL")  # the job says where the store is (storage.s3.endpoint)
    runs = tmp_path_factory.mktemp("runs")
    doc = job("s3-first", model={"source": "s3://models/tiny-model"},
              dataset={"source": "s3://data/tiny-text.jsonl"}, training={"maxSteps": 4},
              storage={"s3": {"endpoint": store.endpoint}})  # fmt: skip
    job_file = runs / "s3-first.yaml"
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    cmd = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(runs / "s3-first")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return runs, out


def test_a_job_runs_from_s3(from_s3):
    """Rank 0 downloads into the volume's shared cache while the other waits (a second job
    reads the same copy: the promoted push's job, below)."""
    runs, out = from_s3
    workdir = runs / "s3-first"
    assert final(workdir)["phase"] == "succeeded", final(workdir)
    assert (workdir / "model" / "config.json").is_file()
    assert "downloaded s3://models/tiny-model" in out, out[-3000:]
    # Progress (status.progress.download) counted the bytes; the data set came last.
    first = final(workdir)
    assert first["downloadedBytes"] == first["downloadBytes"] == DATA.stat().st_size


def _run(doc: dict, runs: Path, env: dict) -> tuple[int, str]:
    runs.mkdir(exist_ok=True)
    name = doc["metadata"]["name"]
    job_file = runs / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    cmd = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(runs / name)]
    env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


def _objects(store, bucket: str, prefix: str) -> dict[str, bytes]:
    """What the bucket holds under the prefix: nothing where the bucket is not there yet (the
    server makes one with its first object; a job that pushed nothing made none)."""
    import obstore

    s = store.store(bucket)
    try:
        keys = [m["path"] for chunk in obstore.list(s, prefix=prefix) for m in chunk]
    except obstore.exceptions.GenericError as error:
        if "NoSuchBucket" not in str(error):
            raise
        return {}
    return {k[len(prefix) + 1 :]: obstore.get(s, k).bytes().to_bytes() for k in keys}


def test_the_export_is_uploaded_once_and_a_refused_upload_keeps_it(store, tmp_path):
    """output.push to the Hub (the local server speaking its upload API) and an s3:// prefix:
    an identity that may not write to the store fails the job as PushFailed naming the S3
    prefix, after the Hub commit, with the export kept; run again with one that may, it
    uploads to S3 only, without training; a third run does nothing."""
    store.upload("public", MODEL, "tiny-model")
    store.upload("public", DATA, "tiny-text.jsonl")
    doc = job("s3-export", model={"source": "s3://public/tiny-model"},
              dataset={"source": "s3://public/tiny-text.jsonl"}, training={"maxSteps": 4},
              output={"push": ["hf://ftjob-test/v1", "s3://exports/tiny/v1"]},
              secrets={"huggingFaceToken": {"name": "hf-token"}},
              storage={"s3": {"endpoint": store.endpoint}},
              # The refused run ends at its first failure: restarts in place would be refused
              # alike, and a restart another node starts can empty node 0's record, leaving
              # ftjob run the log tail's words instead of the record's fix.
              runPolicy={"inPlaceRestarts": 0})  # fmt: skip
    runs, workdir = tmp_path / "runs", tmp_path / "runs" / "s3-export"
    hub = HubServer(tmp_path / "hub", HF_TOKEN)
    try:
        # The reader reads public and may write nowhere in the store.
        code, out = _run(doc, runs, {**store.env("reader"), **_hub_env(hub)})
        assert code != 0 and "PushFailed" in out and "s3:PutObject" in out, out[-3000:]
        assert "the push to the S3 prefix s3://exports/tiny/v1 failed" in out, out[-3000:]
        assert (workdir / "model" / "config.json").is_file()  # the export stays
        assert len(hub.commits("ftjob-test/v1")) == 1  # the Hub's push, before, is kept
        steps = final(workdir)["step"]
        code, out = _run(doc, runs, {**store.env("admin"), **_hub_env(hub)})
        assert code == 0, out[-3000:]
        assert len(hub.commits("ftjob-test/v1")) == 1  # not pushed there again
    finally:
        hub.close()
    assert final(workdir)["step"] == steps  # nothing trained again
    uploaded = _objects(store, "exports", "tiny/v1")
    local = files(workdir / "model")
    assert {k: v for k, v in uploaded.items() if k in local} == local
    manifest = json.loads(uploaded["ftjob-upload.json"])["files"]
    assert set(manifest) == set(local) | {"README.md"} and "# v1" in uploaded["README.md"].decode()
    for name, body in local.items():
        assert manifest[name]["sha256"] == hashlib.sha256(body).hexdigest()
    code, out = _run(doc, runs, store.env("admin"))
    # Trained and pushed: ftjob run answers from the job folder's records, starting nothing.
    assert code == 0 and "already trained" in out and "pushing" not in out, out[-3000:]


def test_an_export_pushed_over_another_is_complete_or_absent(store, tmp_path, monkeypatch):
    """The push itself (one rank's, in this process): a second export pushed under a prefix
    that holds one takes the older manifest away before its first file, with the files only
    that manifest listed, so a push cut half-way leaves nothing that says complete; once whole,
    the prefix holds the new export, and an object no export listed is left where it was."""
    import obstore

    from ftjob.trainer.state import s3upload

    for name, value in store.env("admin").items():
        monkeypatch.setenv(name, value)
    url, here = parse("s3://exports/replaced"), tmp_path / "files"
    here.mkdir()

    def written(name: str, body: bytes) -> Path:
        (here / name).write_bytes(body)
        return here / name

    s3upload.upload(url, {"a.bin": written("a", b"old a"), "b.bin": written("b", b"old b")}, "#")
    store.upload("exports", written("notes", b"the team's"), "replaced/notes.txt")
    new = {"a.bin": written("a2", b"new a"), "c.bin": written("c", b"new c")}
    put = obstore.put

    def cut_at_c(s, key, *args, **kwargs):  # the connection lost at the second file
        if key.endswith("c.bin"):
            raise ConnectionResetError(f"lost while putting {key}")
        return put(s, key, *args, **kwargs)

    with monkeypatch.context() as lost:
        lost.setattr(obstore, "put", cut_at_c)
        with pytest.raises(ConnectionResetError):
            s3upload.upload(url, new, "# new")
    cut = _objects(store, "exports", "replaced")
    assert s3upload.MANIFEST not in cut and "b.bin" not in cut and cut["a.bin"] == b"new a"
    s3upload.upload(url, new, "# new")
    whole = _objects(store, "exports", "replaced")
    assert set(whole) == {"a.bin", "c.bin", "README.md", s3upload.MANIFEST, "notes.txt"}
    assert set(json.loads(whole[s3upload.MANIFEST])["files"]) == {"a.bin", "c.bin", "README.md"}
    assert whole["notes.txt"] == b"the team's"


def _hub_env(hub: HubServer) -> dict[str, str]:
    """The local Hub server, as huggingface_hub is pointed at it (Git LFS's basic transfer:
    Xet off) with the token it takes."""
    return {"HF_ENDPOINT": hub.url, "HF_TOKEN": HF_TOKEN, "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip


def test_an_upload_complete_there_is_not_repeated(store, tmp_path, monkeypatch):
    from ftjob.trainer.state import s3upload

    for k, v in store.env("admin").items():
        monkeypatch.setenv(k, v)
    big = tmp_path / "model.safetensors"
    big.write_bytes(os.urandom(70 * 2**20))  # over one part: a multipart upload
    said: list[str] = []
    where = parse("s3://exports/again")
    first = s3upload.upload(where, {"model.safetensors": big}, "card", said.append)
    assert (
        said == [] and _objects(store, "exports", "again")["model.safetensors"] == big.read_bytes()
    )
    second = s3upload.upload(where, {"model.safetensors": big}, "card", said.append)
    assert second == first and "already holds this export" in said[0]


@pytest.mark.parametrize(
    ("bound", "promoted"),
    # tests/deadline.py: a condition not met, the slow tier's; the unit tests hold its rule
    [(100.0, True), pytest.param(0.001, False, marks=pytest.mark.slow)],
)
def test_the_push_to_the_hub_and_s3_waits_for_its_condition_on_the_final_evaluation(
    store, tmp_path, bound, promoted, request
):
    """output.push to a Hub repository (the local server speaking the Hub's upload API,
    tests/e2e/hubserver.py) and an S3 prefix in one job, output.promoteWhen: evalLoss < bound:
    both get the export when the final evaluation's loss is under it, neither when not, and
    the job succeeds either way; progress (status.progress.promotion, pushedTo) says which,
    with the number, and where. The promoted job runs beside test_a_job_runs_from_s3's
    (the same volume) and reads its copy of the model and data: nothing downloaded again."""
    # The slow tier runs apart from this module's other tests: its own folder, not a run more.
    runs = request.getfixturevalue("from_s3")[0] if promoted else tmp_path / "runs"
    name, prefix, repo = f"promote-{int(promoted)}", f"promoted/{int(promoted)}", "ftjob-test/p"
    doc = job(name, model={"source": "s3://models/tiny-model"},
              dataset={"source": "s3://data/tiny-text.jsonl", "evalFraction": 0.05},
              training={"maxSteps": 4},
              output={"push": [f"hf://{repo}", f"s3://exports/{prefix}"],
                      "promoteWhen": f"evalLoss < {bound}"},
              secrets={"huggingFaceToken": {"name": "hf-token"}},
              storage={"s3": {"endpoint": store.endpoint}})  # fmt: skip
    hub = HubServer(tmp_path / "hub", HF_TOKEN)
    try:
        code, out = _run(doc, runs, {**store.env("admin"), **_hub_env(hub)})
    finally:
        hub.close()
    assert code == 0, out[-3000:]
    progress = final(runs / name)
    loss = progress["evalLoss"]
    assert progress["phase"] == "succeeded"
    if promoted:
        assert progress["promotion"] == f"promoted: evalLoss {loss:.4g} < {bound:g}"
        [commit] = hub.commits(repo)
        hub_url = f"{hub.url}/{repo}/commit/{commit['oid']}"
        assert progress["pushedTo"] == [hub_url, f"s3://exports/{prefix}"]
        # The same export in both places, each with its card.
        export = files(runs / name / "model")
        in_s3, in_hub = _objects(store, "exports", prefix), files(hub.folder(repo))
        assert {k: in_s3[k] for k in export} == export == {k: in_hub[k] for k in export}
        assert "README.md" in in_hub and "ftjob-upload.json" in in_s3
        assert "downloaded s3://" not in out, out[-3000:]  # the shared copy
    else:
        assert progress["promotion"] == f"not promoted: evalLoss {loss:.4g} < 0.001 does not hold"
        assert progress.get("pushedTo") is None
        assert repo not in hub.repos and _objects(store, "exports", prefix) == {}
        assert "not pushed to hf://ftjob-test/p, s3://exports/promoted/0: not promoted" in out


def test_validate_check_sources_asks_the_store_at_the_door(store, tmp_path):
    def validate(model: str, who: str) -> tuple[int, str]:
        doc = job("check", model={"source": model}, dataset={"source": "s3://data/tiny-text.jsonl"},
                  storage={"s3": {"endpoint": store.endpoint}})  # fmt: skip
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(doc))
        env = {**os.environ, **store.env(who)}
        env.pop("AWS_ENDPOINT_URL")  # the job's storage.s3.endpoint says it
        cmd = [sys.executable, "-m", "ftjob", "validate", "--check-sources", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hangs.FLOOR)
        return proc.returncode, proc.stdout + proc.stderr

    code, out = validate("s3://models/tiny-model", "admin")
    assert code == 0 and "valid" in out, out
    code, out = validate("s3://no-such-bucket/tiny-model", "admin")
    assert code == 1 and "spec.model.source" in out and "no bucket 'no-such-bucket'" in out, out
    code, out = validate("s3://models/tiny-model", "stranger")
    assert code == 1 and "refused the credentials" in out and "AWS_ACCESS_KEY_ID" in out, out
    assert "spec.dataset.source" in out  # each source is named
