"""Hub and object store sources, pinned once per job: an hf:// model fetched into the shared
volume, an hf:// dataset's revision resolved to a commit, an s3:// model or dataset downloaded
into the volume's shared cache (:mod:`ftjob.trainer.fetch.s3`; its failures named by
:mod:`ftjob.trainer.fetch.storeerrors`), by the same one-rank-downloads, others-wait record.

Pods set ``HF_HOME`` to ``<job folder>/hub`` (:mod:`ftjob.job.launch`), so the Hugging Face cache
lives on the shared volume, not in a pod's emptyDir: a restarted gang finds the weights there.
Global rank 0 alone downloads (``snapshot_download``), then writes ``<job folder>/sources.json``
naming the snapshot folder; the other ranks, on any node, wait for that file instead of a
collective (a 140 GB download outlasts any collective timeout; the operator's startup limit
bounds the wait). From then on the job reads the snapshot as a local folder, for all its
restarts: the first attempt pins the revision for the job's life, and no restart asks the Hub
again.

An hf:// dataset is pinned the same way, to the commit its revision (``main`` unless
``dataset.revision`` says) named when the job first started. Only rank 0 reads it (the
data is prepared once, :mod:`ftjob.trainer.data.prepare`), and the commit is part of the prepared
data's key: a dataset updated on the Hub is never mixed with sequences prepared from the old
one, and a restart does not pick up the update halfway through a job.

A failed request is one of two kinds. The Hub's answer that the repository is not there
(404) or not for this token (401, 403) is permanent: BadModel (BadData for a dataset), named
with its fix. No answer (the network down, DNS, a timeout) or a busy Hub (429, 5xx) is
transient: retried here with growing waits, then HubUnreachable, which names the network and
which the operator retries with a new gang (never a job failed for good over a blip).

    python -c "from ftjob.trainer.fetch import sources; help(sources)"
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from ftjob.api.contract import BAD_DATA, BAD_MODEL, HUB_UNREACHABLE, TrainerError
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.jobspec.data import DatasetSpec
from ftjob.api.source import S3, Hub, parse
from ftjob.job import atomic
from ftjob.job.folder import JobFolder
from ftjob.trainer.fetch import s3, storeerrors

# What loading a model reads; not the repositories' other formats (e.g. Llama's original/
# folder of consolidated .pth weights, as large again as the safetensors).
WEIGHTS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
WAIT_POLL_SECONDS = 1.0
# Waits between tries of a transient failure (about two minutes in all): a blip or a Hub
# restart passes within them; a longer outage is the operator's to retry (a new gang).
RETRY_WAITS = (2.0, 5.0, 15.0, 30.0, 60.0)
# Transport errors by name (httpx's, and the copy huggingface_hub vendors, share them).
TRANSPORT = frozenset({"TransportError", "TimeoutException", "NetworkError", "ProtocolError"})


def fetch(
    spec: FineTuneJobSpec,
    job_dir: Path,
    is_main: bool,
    say: Callable[[str], None] = print,
    downloading: Callable[[], None] = lambda: None,
    progress: Callable[[int, int], None] = lambda got, total: None,
) -> FineTuneJobSpec:
    """``spec`` with its hf:// sources pinned: the model's replaced by its local snapshot
    folder, the dataset's revision by the commit it names.
    ``downloading()`` is called when this job has not fetched the model yet (a download, or a
    wait for the rank that downloads): the progress phase of that name; ``progress(bytes so
    far, total)`` while an s3:// source downloads."""
    record = JobFolder(job_dir).sources
    m, ds = spec.model, spec.dataset
    if isinstance(model := parse(m.source), Hub):
        key = f"{m.source}@{m.revision or 'main'}"
        download = lambda: _download(spec, model.repo, key, say)  # noqa: E731
        folder = _once(record, key, is_main, download, downloading, lambda v: Path(v).is_dir())
        spec = dataclasses.replace(spec, model=dataclasses.replace(m, source=folder, revision=None))
    if isinstance(data := parse(ds.source), Hub):
        key = f"dataset {ds.source}@{ds.revision or 'main'}"
        get = lambda: _commit(ds, data.repo, say)  # noqa: E731
        commit = _once(record, key, is_main, get, lambda: None, _is_commit)
        spec = dataclasses.replace(spec, dataset=dataclasses.replace(ds, revision=commit))
    for field in ("model", "dataset"):
        part = getattr(spec, field)
        if isinstance(where := parse(part.source), S3):
            get = lambda w=where, f=field: _from_store(f, w, job_dir, say, progress)  # noqa: E731
            local = _once(record, part.source, is_main, get, downloading, _exists)
            spec = dataclasses.replace(spec, **{field: dataclasses.replace(part, source=local)})
    return spec


def _exists(value: str) -> bool:
    return Path(value).exists()


def _from_store(field: str, where: S3, job_dir: Path, say, progress) -> str:
    """The local copy of an s3:// source in the volume's shared cache; a failure named."""
    try:
        local, _ = s3.download(where, JobFolder(job_dir).s3_cache, say, progress)
    except Exception as e:  # noqa: BLE001 - storeerrors sorts them; the rest raise as they came
        named = storeerrors.refused(field, where, e)
        if named is None:
            raise
        raise named from e
    return str(local)


def _once(record: Path, key: str, is_main: bool, get, starting, valid) -> str:
    """The value recorded for ``key``; rank 0 gets and records it, the others wait for it."""
    value = _recorded(record, key, valid)
    if value is None:
        starting()
    if value is None and is_main:
        value = get()
        _write(record, key, value)
    while value is None:  # another rank is getting it
        time.sleep(WAIT_POLL_SECONDS)
        value = _recorded(record, key, valid)
    return value


def _is_commit(value: str) -> bool:
    return len(value) == 40 and all(c in "0123456789abcdef" for c in value)


def _commit(ds: DatasetSpec, repo: str, say: Callable[[str], None]) -> str:
    """The commit an hf:// dataset's revision names now (a commit names itself); ``repo``:
    its repository."""
    if ds.revision and _is_commit(ds.revision):
        return ds.revision
    from huggingface_hub import HfApi

    token = os.environ.get("HF_TOKEN")
    ask = lambda: HfApi().dataset_info(repo, revision=ds.revision, token=token)  # noqa: E731
    return _from_hub("dataset", ds.source, ask, say).sha


def _download(spec: FineTuneJobSpec, repo: str, key: str, say: Callable[[str], None]) -> str:
    from huggingface_hub import snapshot_download

    patterns = WEIGHTS + (["*.py"] if spec.model.trust_remote_code else [])
    say(f"downloading {key} into {os.environ.get('HF_HOME', 'the Hugging Face cache')}")
    started = time.monotonic()
    get = lambda: snapshot_download(  # noqa: E731
        repo,
        revision=spec.model.revision,
        token=os.environ.get("HF_TOKEN"),
        allow_patterns=patterns,
    )
    folder = _from_hub("model", spec.model.source, get, say)
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    say(f"downloaded {key}: {size / 2**30:.2f} GiB in {time.monotonic() - started:.0f}s")
    return folder


def kind(e: BaseException) -> str:
    """PURE: what a failed Hub request means: "denied" (401, 403), "missing" (404),
    "transient" (no answer: connection, DNS, timeout; or 408, 429, 5xx), else "other".
    The Hub's status wins where one came back; else the causes are searched for a transport
    error (huggingface_hub wraps a refused connection in a LocalEntryNotFoundError)."""
    seen: BaseException | None = e
    while seen is not None:
        status = getattr(getattr(seen, "response", None), "status_code", None)
        if isinstance(status, int):
            if status in (401, 403):
                return "denied"
            if status == 404:
                return "missing"
            return "transient" if status in (408, 429) or status >= 500 else "other"
        names = {c.__name__ for c in type(seen).__mro__}
        if isinstance(seen, ConnectionError | TimeoutError | socket.gaierror) or names & TRANSPORT:
            return "transient"
        seen = seen.__cause__ or seen.__context__
    return "other"


def _from_hub(field: str, source: str, get, say: Callable[[str], None]):
    """``get()``, retried after :data:`RETRY_WAITS` while it fails transiently; a failure
    as the TrainerError its kind calls for."""
    for attempt, wait in enumerate((*RETRY_WAITS, None), start=1):
        try:
            return get()
        except Exception as e:  # noqa: BLE001 - sorted by kind(); the rest raise as they came
            found = kind(e)
            if found == "other" and not isinstance(e, OSError | ValueError):
                raise
            if found != "transient" or wait is None:
                raise _refused(field, source, found, e, attempt) from e
            say(
                f"{field}.source {source}: the Hub request failed ({_short(e)}), try {attempt} of "
                f"{len(RETRY_WAITS) + 1}: the network or the Hub, not the {field}; "
                f"retrying in {wait:.0f}s"
            )
            time.sleep(wait)
    raise AssertionError("unreachable")  # the last try returns or raises


def _short(e: BaseException) -> str:
    """What went wrong on the wire: the Hub's status, else the innermost cause's words."""
    inner: BaseException | None = e
    while inner is not None:
        status = getattr(getattr(inner, "response", None), "status_code", None)
        if isinstance(status, int):
            return f"HTTP {status}"
        e, inner = inner, inner.__cause__ or inner.__context__
    return f"{type(e).__name__}: {e}"


def _refused(field: str, source: str, found: str, e: Exception, tries: int) -> TrainerError:
    reason, where = (BAD_MODEL if field == "model" else BAD_DATA), f"spec.{field}.source"
    token = "secrets.huggingFaceToken (HF_TOKEN on this machine)"
    if found == "transient":
        return TrainerError(
            f"{field}.source {source}: cannot reach the Hugging Face Hub after {tries} tries "
            f"({_short(e)}): the network or the Hub, not the {field}",
            reason=HUB_UNREACHABLE,
            where=where,
            fix="check the network (proxy, DNS, HF_ENDPOINT) and run it again; on a cluster "
            "the operator retries the job with a new gang",
        )
    if found == "denied":
        what, fix = (
            f"the Hub refused access ({type(e).__name__}): a gated or private {field}",
            f"set {token} to a token of an account that may read it (for a gated {field}, "
            "accept its terms on its Hub page first)",
        )
    elif found == "missing":
        what, fix = (
            f"not found on the Hub ({type(e).__name__})",
            f"check the name and {field}.revision (a private {field} also needs {token})",
        )
    else:
        what = f"cannot be read from the Hub ({type(e).__name__}: {e})"
        fix = f"check the name, {field}.revision, and {token} for gated {field}s"
    return TrainerError(f"{field}.source {source}: {what}", reason=reason, where=where, fix=fix)


def _recorded(record: Path, key: str, valid) -> str | None:
    try:
        found = json.loads(record.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and valid(found) else None


def _write(record: Path, key: str, folder: str) -> None:
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    atomic.write_json(record, {**known, key: folder})
