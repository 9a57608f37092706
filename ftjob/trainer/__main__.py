"""Entry point of every training process: ``python -m ftjob.trainer --spec FILE``.

    torchrun --standalone --nproc-per-node 2 -m ftjob.trainer --spec examples/tiny.yaml

FILE is a FineTuneJob document, YAML or JSON (the job file itself, or what ``ftjob render``
prints). The environment torchrun and ftjob set is described in docs/progress.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ftjob import manifest
from ftjob.schema import SpecError
from ftjob.spec import KIND, parse_resource

EXIT_FAILED = 1


def load_spec(path: str):
    """(name, spec) of the one FineTuneJob in ``path``."""
    return parse_resource(manifest.load_one(path, KIND))


@record  # torchrun reports the traceback of the first failing rank
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftjob.trainer", description=__doc__)
    parser.add_argument("--spec", required=True, metavar="FILE", help="FineTuneJob YAML/JSON")
    args = parser.parse_args(argv)
    try:
        name, spec = load_spec(args.spec)
    except SpecError as e:
        print(f"error: {args.spec}: invalid {KIND}:", file=sys.stderr)
        for err in e.errors:
            print(f"  {err}", file=sys.stderr)
        return EXIT_FAILED
    except manifest.ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    # bitsandbytes announces at import that an optional CPU kernel package is missing.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # Imported after the spec check: a bad spec fails before torch and transformers load.
    from ftjob.contract import TrainerError
    from ftjob.trainer import owner, train
    from ftjob.trainer.data import DataError
    from ftjob.trainer.model import SourceError

    try:
        train.run(spec, name)
    except (DataError, SourceError) as e:
        # A known problem with the inputs: its message says it all, no traceback needed.
        kind = "bad data" if isinstance(e, DataError) else "bad model"
        rank = os.environ.get("RANK", "0")
        print(f"error: rank {rank}: {kind}: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except TrainerError as e:  # a failure the trainer named (full disk, busy job folder...)
        rank = os.environ.get("RANK", "0")
        print(f"error: rank {rank}: {e.reason}: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        owner.release_held()  # a failed run gives the job folder up at once
    return 0


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown once everything is written and flushed.

    After a finished run (export written, process group destroyed) torch.distributed's C++
    objects are still destroyed at interpreter exit, and now and then that aborts the process
    ("terminate called without an active exception", SIGABRT, with no Python frame left; seen
    twice on rank 1 among some 60 two-rank CPU runs, after the export was written). The job's
    work is done by then, but that exit code would fail it. Nothing is left to run at exit:
    the trainer's files are closed, and the streams are flushed here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
