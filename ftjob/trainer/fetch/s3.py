"""s3:// sources: the objects under a bucket prefix (or one object), downloaded once per content
into the volume's shared cache, in parallel ranged parts, resumable, verified.

The client is obstore, configured from the AWS environment (:mod:`ftjob.trainer.state.
objectstore`, which the s3:// exports share).

The cache: ``<volume>/s3-cache/<content key>/`` where the key hashes the bucket and every
object's key, local name, size and ETag, so two jobs reading the same objects share one copy
and a changed object is a new download. A folder holds the objects under the prefix at their
relative paths (a model folder); one object lands as its own file name (a data file).
``.complete`` marks a finished, verified copy; it is written last. Each object is written to
``<name>.part`` with its ranges in order as they arrive; ``<name>.part.json`` records the
offset below which every byte is written, so a download killed mid-object (a pod evicted)
resumes there, and only while the object's ETag is still the one it started with. A finished
object is checked against its size, and against its MD5 where the ETag is one (a single-part
upload's), before it takes its name.

    python -c "from ftjob.trainer.fetch import s3; help(s3)"
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ftjob.api.source import S3
from ftjob.job import atomic
from ftjob.trainer.state.objectstore import store

COMPLETE = ".complete"
PART_BYTES = 16 * 2**20  # one ranged GET
PARALLEL = 8  # ranged GETs in flight (and 2 more queued: at most 10 parts held in memory)
RECORD_BYTES = 128 * 2**20  # written and fsynced between two resume records
SAY_EVERY_SECONDS = 10.0


@dataclass(frozen=True)
class Obj:
    """One object to download: its key in the bucket, where it lands, size and ETag."""

    key: str
    name: str  # the path below the cache folder
    size: int
    etag: str


def listing(bucket_store, prefix: str) -> list[Obj]:
    """The objects ``prefix`` names: itself when it is an object's key, else those below
    ``prefix/`` (named by their paths below it); empty when none."""
    import obstore

    if prefix:
        try:
            m = obstore.head(bucket_store, prefix)
            return [Obj(m["path"], Path(m["path"]).name, m["size"], m["e_tag"] or "")]
        except (FileNotFoundError, obstore.exceptions.PermissionDeniedError):
            # Not an object (or a HEAD, which has no body to say why it was refused): the
            # listing below says what there is, or S3's error code.
            pass
    under = f"{prefix}/" if prefix else ""
    # object_store lists by path: a prefix lists the objects below prefix/.
    found = [
        Obj(m["path"], m["path"][len(under) :], m["size"], m["e_tag"] or "")
        for chunk in obstore.list(bucket_store, prefix=prefix or None)
        for m in chunk
        if not m["path"].endswith("/")  # a folder marker some tools write
    ]
    return sorted(found, key=lambda o: o.key)


def content_key(where: S3, objects: list[Obj]) -> str:
    """PURE: the cache folder's name: the bucket and every object's key, local name, size and
    ETag (not the URL's spelling: s3://b/p and s3://b/p/ share a copy)."""
    text = json.dumps([where.bucket, [[o.key, o.name, o.size, o.etag] for o in objects]])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def local_path(folder: Path, where: S3, objects: list[Obj]) -> Path:
    """PURE: what a job reads: the one object's file, or the folder of a prefix's objects."""
    one = len(objects) == 1 and objects[0].key == where.key
    return folder / objects[0].name if one else folder


def download(
    where: S3,
    cache_root: Path,
    say: Callable[[str], None] = print,
    progress: Callable[[int, int], None] = lambda got, total: None,
) -> tuple[Path, list[Obj]]:
    """The local copy of ``where`` in ``cache_root`` (fetched unless a complete copy is there),
    and the objects it holds; ``progress(bytes so far, total)`` as ``say`` is told. Raises
    ValueError when the prefix names no object, and the client's errors as they come
    (sources.py names them)."""
    bucket_store = store(where.bucket)
    objects = listing(bucket_store, where.key)
    if not objects:
        raise ValueError(f"no object at {where} or under {where.under}")
    folder = cache_root / content_key(where, objects)
    if not (folder / COMPLETE).exists():
        folder.mkdir(parents=True, exist_ok=True)
        # Two jobs (or two attempts) that want the same content: one downloads, the other
        # waits here and then finds it complete.
        with open(folder.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / COMPLETE).exists():
                meter = _Meter(where.url, objects, say, progress)
                _fetch_all(bucket_store, where.url, objects, folder, meter)
    return local_path(folder, where, objects), objects


def _fetch_all(bucket_store, url: str, objects: list[Obj], folder: Path, meter: _Meter) -> None:
    gib = meter.total / 2**30
    meter.say(f"downloading {url}: {len(objects)} object(s), {gib:.2f} GiB into {folder}")
    for o in objects:
        _fetch_one(bucket_store, o, folder / o.name, meter)
    manifest = [{"key": o.key, "name": o.name, "size": o.size, "etag": o.etag} for o in objects]
    atomic.write_json(folder / COMPLETE, {"source": url, "objects": manifest})
    meter.done()


def _fetch_one(bucket_store, o: Obj, dest: Path, meter: _Meter) -> None:
    """One object into ``dest``, resuming a ``.part`` left by a killed download."""
    if dest.exists() and dest.stat().st_size == o.size:
        meter.add(o.size)  # fetched and verified before this download died
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    part, state = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.json")
    start = _resume_offset(state, part, o)
    if start:
        meter.say(f"resuming {o.key} at {start / 2**20:.0f} of {o.size / 2**20:.0f} MiB")
    meter.add(start)
    with open(part, "r+b" if start else "wb") as f, ThreadPoolExecutor(PARALLEL) as pool:
        f.truncate(o.size)
        _write_ranges(f, pool, bucket_store, o, start, state, meter)
    _verify(part, o)
    os.replace(part, dest)
    atomic.discard(state)  # with a killed download's half-written record, if any


def _write_ranges(f, pool, bucket_store, o: Obj, start: int, state: Path, meter) -> None:
    """Ranges from ``start`` to the end, PARALLEL in flight, written in order as each arrives:
    the file's first bytes up to the last one written are always whole, so the resume record
    (every RECORD_BYTES, after an fsync) can name that offset while later ranges still run.
    A slow range holds back only the record, not the other ranges."""
    ranges = iter((s, min(s + PART_BYTES, o.size)) for s in range(start, o.size, PART_BYTES))
    get = lambda r: (r, pool.submit(_get, bucket_store, o, r))  # noqa: E731
    queued = deque(get(r) for r in itertools.islice(ranges, PARALLEL + 2))
    unrecorded = 0
    while queued:
        (begin, end), future = queued.popleft()
        data = future.result()
        os.pwrite(f.fileno(), data, begin)
        meter.add(len(data))
        queued.extend(get(r) for r in itertools.islice(ranges, 1))
        unrecorded += len(data)
        if unrecorded >= RECORD_BYTES or not queued:
            f.flush()
            os.fsync(f.fileno())
            atomic.write_json(state, {"etag": o.etag, "size": o.size, "done": end})
            unrecorded = 0


def _resume_offset(state: Path, part: Path, o: Obj) -> int:
    """Where a killed download of ``o`` stopped: 0 unless its record names the same content."""
    try:
        found = json.loads(state.read_text())
    except (OSError, ValueError):
        return 0
    same = found.get("etag") == o.etag and found.get("size") == o.size and part.exists()
    return int(found.get("done", 0)) if same else 0


def _get(bucket_store, o: Obj, r: tuple[int, int]) -> bytes:
    """One range of ``o``, and only of the version whose ETag was listed (If-Match): an
    object replaced mid-download fails the download instead of mixing two versions."""
    import obstore

    options = {"range": r, **({"if_match": o.etag} if o.etag else {})}
    return obstore.get(bucket_store, o.key, options=options).bytes().to_bytes()


def _verify(part: Path, o: Obj) -> None:
    size = part.stat().st_size
    if size != o.size:
        raise OSError(f"{o.key}: downloaded {size} bytes, the store lists {o.size}")
    etag = o.etag.strip('"')
    # A single-part upload's ETag is its MD5 (a multipart one's has a "-N" suffix, the MD5 of
    # its parts' MD5s, which needs the upload's part size: size and If-Match cover it).
    if len(etag) == 32 and "-" not in etag:
        md5 = hashlib.md5(usedforsecurity=False)
        with open(part, "rb") as f:
            while chunk := f.read(2**24):
                md5.update(chunk)
        if md5.hexdigest() != etag:
            raise OSError(f"{o.key}: the download's MD5 {md5.hexdigest()} is not its ETag {etag}")


class _Meter:
    """Bytes so far, said every SAY_EVERY_SECONDS (a terminal and a pod log alike) and given to
    ``progress`` (the job's progress: status.progress.download)."""

    def __init__(self, url: str, objects: list[Obj], say, progress):
        self.url, self.total, self.say, self.progress = (
            url,
            sum(o.size for o in objects),
            say,
            progress,
        )
        self.got, self.started, self.last = 0, time.monotonic(), time.monotonic()

    def add(self, n: int) -> None:
        self.got += n
        now = time.monotonic()
        if now - self.last >= SAY_EVERY_SECONDS:
            self.last = now
            self.progress(self.got, self.total)
            rate = self.got / max(now - self.started, 1e-9)
            self.say(
                f"downloading {self.url}: {self.got / 2**30:.2f} of {self.total / 2**30:.2f} GiB "
                f"({100 * self.got / max(self.total, 1):.0f}%), {rate / 2**20:.0f} MiB/s"
            )

    def done(self) -> None:
        self.progress(self.total, self.total)
        seconds = time.monotonic() - self.started
        self.say(
            f"downloaded {self.url}: {self.total / 2**30:.2f} GiB in {seconds:.0f}s "
            f"({self.total / 2**20 / max(seconds, 1e-9):.0f} MiB/s)"
        )
