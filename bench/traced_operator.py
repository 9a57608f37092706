"""``python -m bench.traced_operator DIR ARGS...``: ``ftjob ARGS...`` with tracemalloc on.

The fleet suite's memory profile (``FTJOB_BENCH_TRACE=DIR``): each SIGUSR1 writes the live
allocations as DIR/<n>.snap (tracemalloc's own format, 8 frames each), so that the suite can
say which lines hold the memory a job adds, not only the RSS. tracemalloc slows the operator
several times over: a traced run's latencies are not the suite's numbers.
"""

from __future__ import annotations

import signal
import sys
import tracemalloc
from pathlib import Path

FRAMES = 8


def _install(folder: Path) -> None:
    taken = [0]

    def snapshot(*_) -> None:
        taken[0] += 1
        tracemalloc.take_snapshot().dump(str(folder / f"{taken[0]}.snap"))
        (folder / f"{taken[0]}.done").touch()  # the dump is whole once this exists

    signal.signal(signal.SIGUSR1, snapshot)


def _imported() -> None:
    """The operator's modules and the API classes it uses, imported untraced: the kubernetes
    client's generated modules took minutes to import under tracemalloc (seen: CoreV1Api), and
    what they allocate is the same at any number of jobs."""
    from kubernetes import client

    import ftjob.operator.handlers  # noqa: F401 - imported for its side effect

    for name in ("CoreV1Api", "CustomObjectsApi", "AuthorizationV1Api", "V1ResourceAttributes",
                 "V1SelfSubjectAccessReview", "V1SelfSubjectAccessReviewSpec"):  # fmt: skip
        getattr(client, name)


def main() -> None:
    folder, args = Path(sys.argv[1]), sys.argv[2:]
    folder.mkdir(parents=True, exist_ok=True)
    _imported()
    tracemalloc.start(FRAMES)
    _install(folder)
    from ftjob.cli.commands import main as ftjob

    sys.argv = ["ftjob", *args]
    sys.exit(ftjob())


if __name__ == "__main__":
    main()
