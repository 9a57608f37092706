"""What a committed checkpoint holds, checked before it is trusted.

A checkpoint folder is committed by its manifest (``COMMITTED``): every file of the folder
with its size and CRC-32, written last, by rank 0, from the checksums every rank took of its
own shards. A shard cut short by a node lost mid-flush, a file emptied by a bad block or a
missing ``.metadata`` then shows as a list of problems instead of a ``torch.load`` traceback.

The work is split by file: rank r reads the files it wrote (``__r_*.distcp``,
``rng-rankr.pt``, still in its page cache at commit), rank 0 also the rest; a folder is
intact when every rank found nothing wrong with its share.
"""

from __future__ import annotations

import json
import re
import zlib
from datetime import datetime, timezone
from pathlib import Path

COMMITTED = "COMMITTED"
DAMAGED = "damaged"  # damaged checkpoints are moved here, never deleted
CHUNK = 8 << 20
_WRITER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng-rank(\d+)\.pt)$")


def writer(name: str, world: int) -> int:
    """The rank that checks file ``name``: its writer where the name tells, else rank 0."""
    found = _WRITER.match(name)
    if not found:
        return 0
    return int(found.group(1) or found.group(2)) % world


def share(names: list[str], rank: int, world: int) -> list[str]:
    return sorted(n for n in names if n != COMMITTED and writer(n, world) == rank)


def crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def checksums(folder: Path, names: list[str]) -> dict[str, dict]:
    """Size and checksum of each file in ``names``."""
    return {n: {"size": (folder / n).stat().st_size, "crc32": crc32(folder / n)} for n in names}


def manifest(step: int, files: dict[str, dict]) -> str:
    return json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=1) + "\n"


def read_manifest(folder: Path) -> dict[str, dict]:
    """The files a committed folder must hold; ValueError when the manifest is unreadable."""
    try:
        doc = json.loads((folder / COMMITTED).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"its manifest {COMMITTED} is unreadable ({e})") from e
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise ValueError(f"its manifest {COMMITTED} has no list of files")
    if ".metadata" not in files:
        raise ValueError(f"its manifest {COMMITTED} lists no .metadata")
    return files


def problems(folder: Path, rank: int, world: int) -> list[str]:
    """What is wrong with this rank's share of ``folder`` (empty: intact)."""
    try:
        files = read_manifest(folder)
    except ValueError as e:
        return [str(e)] if rank == 0 else []
    found = []
    for name in share(list(files), rank, world):
        want, path = files[name], folder / name
        if not path.is_file():
            found.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != want.get("size"):
            found.append(f"{name} has {size} bytes, {want.get('size')} were written")
        elif crc32(path) != want.get("crc32"):
            found.append(f"{name} does not match its checksum")
    return found


def move_aside(folder: Path) -> Path:
    """Move a damaged checkpoint to ``damaged/`` beside it (kept for a post-mortem)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = folder.parent / DAMAGED / f"{folder.name}-{stamp}"
    target.parent.mkdir(exist_ok=True)
    folder.rename(target)
    return target
