"""Model downloads: fetched once per job into the shared volume, then read from there.

Pods set ``HF_HOME`` to ``<job folder>/hub`` (:mod:`ftjob.launch`), so the Hugging Face cache
lives on the shared volume, not in a pod's emptyDir: a restarted gang finds the weights there.
Global rank 0 alone downloads (``snapshot_download``), then writes ``<job folder>/sources.json``
naming the snapshot folder; the other ranks, on any node, wait for that file instead of a
collective (a 140 GB download outlasts any collective timeout; the operator's startup limit
bounds the wait). From then on the job reads the snapshot as a local folder, for all its
restarts: the first attempt pins the revision for the job's life, and no restart asks the Hub
again.

    python -c "from ftjob.trainer import sources; help(sources)"
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from ftjob import atomic
from ftjob.contract import BAD_MODEL, TrainerError
from ftjob.spec import FineTuneJobSpec

RECORD = "sources.json"
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
    """``spec`` with an hf:// model source replaced by its local snapshot folder.
    ``downloading()`` is called when this job has not fetched it yet (a download, or a wait
    for the rank that downloads): the progress phase of that name."""
    source = spec.model.source
    if not source.startswith(HF):
        return spec
    key = f"{source}@{spec.model.revision or 'main'}"
    record = job_dir / RECORD
    folder = _recorded(record, key)
    if folder is None:
        downloading()
    if folder is None and is_main:
        folder = _download(spec, key, say)
        _write(record, key, folder)
    while folder is None:  # another rank is downloading
        time.sleep(WAIT_POLL_SECONDS)
        folder = _recorded(record, key)
    local = dataclasses.replace(spec.model, source=folder, revision=None)
    return dataclasses.replace(spec, model=local)


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
        raise TrainerError(
            f"model.source {spec.model.source}: cannot download it ({type(e).__name__}: {e}); "
            "check the name, model.revision, and secrets.huggingFaceToken for gated models",
            reason=BAD_MODEL,
            where="spec.model.source",
        ) from e
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    say(f"downloaded {key}: {size / 2**30:.2f} GiB in {time.monotonic() - started:.0f}s")
    return folder


def _recorded(record: Path, key: str) -> str | None:
    try:
        found = json.loads(record.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and Path(found).is_dir() else None


def _write(record: Path, key: str, folder: str) -> None:
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    atomic.write_json(record, {**known, key: folder})
