"""Entry point of every training process: ``python -m ftjob.trainer --spec FILE``.

    torchrun --standalone --nproc-per-node 2 -m ftjob.trainer --spec examples/tiny.yaml

FILE is a FineTuneJob document, YAML or JSON (the job file itself, or what ``ftjob render``
prints). The environment torchrun and ftjob set is described in docs/progress.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ftjob.api import manifest
from ftjob.api.contract import (
    BAD_SPEC,
    EXIT_PREEMPTED,
    RESTARTS_IN_PLACE_ENV,
    Preempted,
    TrainerError,
    preempted_record,
)
from ftjob.api.jobspec import KIND, parse_resource
from ftjob.api.schema import SpecError
from ftjob.trainer.gang import termination
from ftjob.trainer.report import secrecy

EXIT_FAILED = 1


def load_spec(path: str):
    """(name, spec) of the one FineTuneJob in ``path``."""
    return parse_resource(manifest.load_one(path, KIND))


@record  # torchrun reports the traceback of the first failing rank
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftjob.trainer", description=__doc__)
    parser.add_argument("--spec", required=True, metavar="FILE", help="FineTuneJob YAML/JSON")
    args = parser.parse_args(argv)
    secrecy.install()  # before any logger takes hold of stderr
    try:
        name, spec = load_spec(args.spec)
    except (SpecError, manifest.ManifestError) as e:
        return _bad_spec(args.spec, e)
    # Imported after the spec check: a bad spec fails before torch and transformers load.
    from ftjob.trainer import train
    from ftjob.trainer.gang import owner

    try:
        train.run(spec, name)
    except (KeyboardInterrupt, SystemExit):
        raise  # stopped from outside: whoever stopped it knows why
    except Preempted as e:
        # Not a failure: its own record and exit code, which neither the agent, `ftjob run`
        # nor the operator spends a restart on.
        termination.write(preempted_record(e.step, e.checkpoint, str(e)))
        if RESTARTS_IN_PLACE_ENV not in os.environ:
            owner.release_held()  # no agent: the next run need not wait for the folder
        return EXIT_PREEMPTED
    except BaseException as e:  # noqa: BLE001 - dcp's CheckpointException is a BaseException
        # Every failure leaves a record for whoever watches (the operator decides from it);
        # train.run wrote one already for a failure in training.
        record = getattr(e, "ftjob_record", None)
        if record is None:
            record = termination.failure(e, step=getattr(e, "ftjob_step", None))
            termination.write(record)
        if RESTARTS_IN_PLACE_ENV not in os.environ:
            # No ftjob agent runs this process: nobody else gives the folder up, and the next
            # run need not wait for it. (ftjob's agent decides whether its workers restart in
            # place, keeps the folder for them, and releases it when the gang is over.)
            owner.release_held()
        if not isinstance(e, TrainerError):
            raise  # unforeseen: the traceback is worth having (torchrun's @record keeps it)
        # A known problem: its message says it all, no traceback needed.
        where = f" ({record['where']})" if record.get("where") else ""
        fix = f"\n  fix: {record['fix']}" if record.get("fix") else ""
        print(f"error: rank {record['rank']}: {record['reason']}: {e}{where}{fix}",
              file=sys.stderr, flush=True)  # fmt: skip
        return EXIT_FAILED
    return 0


def _bad_spec(path: str, e: Exception) -> int:
    """The job file cannot be read: say why, for people and in the termination record."""
    if isinstance(e, SpecError):
        lines = [f"{path}: invalid {KIND}:", *(f"  {err}" for err in e.errors)]
    else:
        lines = [str(e)]
    print("error: " + "\n".join(lines), file=sys.stderr, flush=True)
    termination.write(termination.named(BAD_SPEC, "\n".join(lines), where=path))
    return EXIT_FAILED


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
