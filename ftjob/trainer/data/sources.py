"""Hub sources, pinned once per job: the model fetched into the shared volume, the dataset's
revision resolved to a commit.

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

    python -c "from ftjob.trainer.data import sources; help(sources)"
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from ftjob.api.contract import BAD_DATA, BAD_MODEL, TrainerError
from ftjob.api.spec import DatasetSpec, FineTuneJobSpec
from ftjob.job import atomic
from ftjob.job.folder import JobFolder

HF = "hf://"
# What loading a model reads; not the repositories' other formats (e.g. Llama's original/
# folder of consolidated .pth weights, as large again as the safetensors).
WEIGHTS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
WAIT_POLL_SECONDS = 1.0


def fetch(
    spec: FineTuneJobSpec,
    job_dir: Path,
    is_main: bool,
    say: Callable[[str], None] = print,
    downloading: Callable[[], None] = lambda: None,
) -> FineTuneJobSpec:
    """``spec`` with its hf:// sources pinned: the model's replaced by its local snapshot
    folder, the dataset's revision by the commit it names.
    ``downloading()`` is called when this job has not fetched the model yet (a download, or a
    wait for the rank that downloads): the progress phase of that name."""
    record = JobFolder(job_dir).sources
    m, ds = spec.model, spec.dataset
    if m.source.startswith(HF):
        key = f"{m.source}@{m.revision or 'main'}"
        download = lambda: _download(spec, key, say)  # noqa: E731
        folder = _once(record, key, is_main, download, downloading, lambda v: Path(v).is_dir())
        spec = dataclasses.replace(spec, model=dataclasses.replace(m, source=folder, revision=None))
    if ds.source.startswith(HF):
        key = f"dataset {ds.source}@{ds.revision or 'main'}"
        commit = _once(record, key, is_main, lambda: _commit(ds), lambda: None, _is_commit)
        spec = dataclasses.replace(spec, dataset=dataclasses.replace(ds, revision=commit))
    return spec


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


def _commit(ds: DatasetSpec) -> str:
    """The commit an hf:// dataset's revision names now (a commit names itself)."""
    if ds.revision and _is_commit(ds.revision):
        return ds.revision
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi().dataset_info(
            ds.source[len(HF) :], revision=ds.revision, token=os.environ.get("HF_TOKEN")
        )
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise _refused("dataset", ds.source, "cannot find it on the Hub", BAD_DATA, e) from e
    return info.sha


def _download(spec: FineTuneJobSpec, key: str, say: Callable[[str], None]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    repo = spec.model.source[len(HF) :]
    patterns = WEIGHTS + (["*.py"] if spec.model.trust_remote_code else [])
    say(f"downloading {key} into {os.environ.get('HF_HOME', 'the Hugging Face cache')}")
    started = time.monotonic()
    try:
        folder = snapshot_download(
            repo,
            revision=spec.model.revision,
            token=os.environ.get("HF_TOKEN"),
            allow_patterns=patterns,
        )
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise _refused("model", spec.model.source, "cannot download it", BAD_MODEL, e) from e
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    say(f"downloaded {key}: {size / 2**30:.2f} GiB in {time.monotonic() - started:.0f}s")
    return folder


def _refused(field: str, source: str, what: str, reason: str, e: Exception) -> TrainerError:
    return TrainerError(
        f"{field}.source {source}: {what} ({type(e).__name__}: {e}); check the name, "
        f"{field}.revision, and secrets.huggingFaceToken for gated {field}s",
        reason=reason,
        where=f"spec.{field}.source",
    )


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
