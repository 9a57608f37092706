"""Upload an export under an s3:// prefix (``output.push: [s3://bucket/prefix]``).

Each file goes up with obstore's put: multipart above PART_BYTES (parts in parallel), each
part with its SHA-256 (x-amz-checksum-sha256), which the store checks before it keeps it; an
object is whole or absent (an aborted multipart upload leaves no object). The model card
(README.md) follows, and last ``ftjob-upload.json``, the manifest: every file's size and
SHA-256. Its presence says the upload under the prefix is complete, and a run that finds the
same manifest there uploads nothing (a rerun after the job folder's record was lost, or a
second job that exported the same bytes). An export pushed where another is: the older
manifest goes first (until the new one is whole, nothing there says complete), with the files
only it listed; nothing else under the prefix is touched.

    python -c "from ftjob.trainer.state import s3upload; help(s3upload)"
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from ftjob.api.source import S3
from ftjob.trainer.state.objectstore import store

MANIFEST = "ftjob-upload.json"
PART_BYTES = 64 * 2**20  # one part of a multipart upload
PARALLEL = 8  # parts in flight


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            h.update(chunk)
    return h.hexdigest()


def manifest(files: dict[str, Path], card: bytes) -> dict:
    """PURE but for reading the files: name -> size and SHA-256, the card's included."""
    out = {name: {"size": p.stat().st_size, "sha256": sha256(p)} for name, p in files.items()}
    out["README.md"] = {"size": len(card), "sha256": hashlib.sha256(card).hexdigest()}
    return {"files": dict(sorted(out.items()))}


def upload(where: S3, files: dict[str, Path], card: str, say=print) -> dict:
    """Upload ``files`` (name under the prefix -> local file) and ``card`` under ``where``,
    unless the same upload is complete there; what the job folder records of it."""
    import obstore

    url, prefix = where.url, where.key
    s = store(where.bucket, checksums=True)
    body = card.encode()
    want = manifest(files, body)
    text = json.dumps(want, indent=1, sort_keys=True).encode()
    revision = hashlib.sha256(text).hexdigest()[:16]
    found = {"commitUrl": url, "revision": revision}
    key = f"{prefix}/{MANIFEST}"
    older = _remote_manifest(s, key)
    if older == want:
        say(f"{url} already holds this export (its {MANIFEST} lists the same files)")
        return found
    # First, in one request: the older manifest (a half-replaced export must not look
    # complete) and the files only it listed (it alone knew them).
    gone = [n for n in ((older or {}).get("files") or {}) if n not in want["files"]]
    _delete(s, [key, *(f"{prefix}/{name}" for name in gone)])
    for name, path in files.items():
        obstore.put(s, f"{prefix}/{name}", path, chunk_size=PART_BYTES, max_concurrency=PARALLEL)
    obstore.put(s, f"{prefix}/README.md", body)
    obstore.put(s, key, text)  # last: the upload is complete
    return found


def _delete(s, keys: list[str]) -> None:
    import obstore

    # Not there (a missing key, a bucket the store makes with its first object): done.
    with contextlib.suppress(FileNotFoundError):
        obstore.delete(s, keys)


def _remote_manifest(s, key: str) -> dict | None:
    import obstore

    try:
        return json.loads(obstore.get(s, key).bytes().to_bytes())
    except (FileNotFoundError, ValueError):
        return None
