"""Files replaced whole: a reader sees the old file or the new one, never half.

The job folder's small records (spec.json, owner, sources.json, progress.json) are read by
other processes -- other ranks, another node, ``ftjob run``, a person -- while they change.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` through a temporary file beside it and a rename (atomic on
    POSIX file systems). The temporary name is per process and thread, so concurrent writers
    (a heartbeat thread, several ranks) never share one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def discard(path: Path) -> None:
    """Remove ``path`` and what its writers left when killed mid-write (:func:`write_json`'s
    temporary files beside it): once ``path`` is no longer wanted, none of them is either."""
    path.unlink(missing_ok=True)
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        tmp.unlink(missing_ok=True)


def create_json(path: Path, value: Any) -> bool:
    """Write ``value`` to ``path`` only if no file is there: True if this call made it.

    The file appears whole, by a hard link of a complete temporary file, which fails if
    ``path`` exists: atomic on local and network file systems alike (``O_EXCL`` is not on
    every network file system), so of two callers at the same instant exactly one gets True.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def new_folder(folder: Path, marker: str = "info.json"):
    """A temporary folder beside ``folder`` to fill, renamed into place whole when the block
    ends without an error: a crash leaves no half-written folder, only a temporary one the
    next attempt removes. Folders made this way are named by a key of their contents, so when
    another process committed the same folder first (its ``marker`` is there) its copy is as
    good as ours and ours is dropped."""
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
