"""``ftjob run job.yaml``: the job's nodes as local processes; progress on screen, logs on disk.

    ftjob run examples/tiny.yaml                 # 2 CPU processes, about a minute
    ftjob run examples/tiny.yaml --workdir /tmp/tiny

Each node gets exactly the command and environment a pod would (:mod:`ftjob.job.launch`), with
node 0 at 127.0.0.1 on a free port. The job's volume is a local folder (``runs/<name>/`` by
default) and relative sources are read beside the job file. Any node failing stops the
others (a gang, as on a cluster); running it again resumes from the newest checkpoint.

The screen shows rank 0's own lines and, on a terminal, a live bar (:mod:`ftjob.cli.screen`);
each node's full output is kept in ``<job folder>/logs/node-<rank>.log``, and a failure is
summarised first (:mod:`ftjob.cli.failure`): which node and rank, what, the fix, where the log is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

from ftjob.api import manifest
from ftjob.api.contract import EXIT_PREEMPTED, TrainerError
from ftjob.api.jobspec import KIND, ineffective, parse_resource
from ftjob.api.profile import Profile
from ftjob.api.schema import SpecError, check_rules
from ftjob.cli import failure
from ftjob.cli.nodes import Node, free_port, interrupt, start_node, stop_all, wait_first
from ftjob.cli.screen import Screen
from ftjob.cli.validate import with_profile
from ftjob.job import folder as jobfolder
from ftjob.job import inputs, installed, lease, processes
from ftjob.job.folder import JobFolder
from ftjob.trainer.data import records
from ftjob.trainer.report import trackers

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


def run(
    job_file: str,
    workdir: str | None = None,
    out=None,
    restart: bool = False,
    profile: Profile | None = None,
) -> int:
    """Run every node of the job in ``job_file`` locally (``profile`` applied as the operator
    would); return an exit code."""
    out = out or sys.stdout
    doc, refused, _ = with_profile(manifest.load_one(job_file, KIND), profile)
    try:
        name, spec = parse_resource(doc, strict=True)
        if refused:  # over a limit of the profile
            raise SpecError(refused)
    except SpecError as e:
        print(f"{job_file}: invalid {KIND}:", file=sys.stderr)
        for err in e.errors:
            print(f"  {err}", file=sys.stderr)
        return EXIT_FAILED
    for warning in ineffective(spec, doc.get("spec") or {}) + _unset_secrets(spec):
        print(f"ftjob run: warning: {warning}", file=out, flush=True)
    job_dir = Path(workdir or Path.cwd() / "runs" / name).resolve()
    source_root = Path(job_file).resolve().parent
    if not _can_start(job_file, spec, source_root, None if restart else job_dir, out):
        return EXIT_FAILED
    if restart and job_dir.exists() and not _set_aside(job_dir, out):
        return EXIT_FAILED
    # The rendezvous id, unique per `ftjob run`: the trainer's rank 0 finds the folder held by
    # its own run and carries the lease on.
    run_id = f"{name}-{os.getpid()}-{int(time.time())}"
    held = lease.Lease(job_dir, run=run_id)
    try:
        held.take(wait_seconds=0)  # before anything is written there (spec.json); exclusive
    except TrainerError as e:
        print(f"ftjob run: {e}", file=sys.stderr)
        return EXIT_FAILED
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        return _run_held(job_file, name, spec, job_dir, source_root, run_id, out)
    finally:
        held.release()
        # Restored only now: a Ctrl-C that comes while the run is stopped and summarised
        # must not cut the summary short (ftjob.cli.nodes.stop_all leaves its handler in place).
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _can_start(job_file: str, spec, source_root: Path, job_dir: Path | None, out) -> bool:
    """This machine has what the job needs: its GPUs, its model and its data (``job_dir``:
    the folder whose downloads count, None for --restart)."""
    refusal = _missing_gpus(spec)
    if refusal:
        print(f"ftjob run: {job_file}: {refusal}", file=out, flush=True)
        return False
    # Named here in a moment, not by the trainer after torch's 10-20 s start-up (the trainer
    # keeps its own checks: pods on a cluster read the volume, not this machine).
    missing = (
        inputs.missing(spec, source_root, job_dir)
        + installed.missing(spec)
        + trackers.not_installed(spec)
    )
    for problem in missing:
        print(f"ftjob run: {job_file}: {problem.path}: {problem.message}", file=out)
        print(f"  fix: {problem.fix}", file=out, flush=True)
    return not missing and _data_readable(job_file, spec, source_root, out)


def _data_readable(job_file: str, spec, source_root: Path, out) -> bool:
    """Every record of a local data file reads as the trainer reads it: a missing field or a
    cut line is named now, with the trainer's words and fix, before any process starts."""
    try:
        records.check(spec.dataset, source_root)
    except records.DataError as e:
        print(f"ftjob run: {job_file}: {e.reason}: {e}", file=out)
        if e.fix:
            print(f"  fix: {e.fix}", file=out)
        print("  nothing was started; once fixed, run it again", file=out, flush=True)
        return False
    return True


def _set_aside(job_dir: Path, out) -> bool:
    """--restart: move the earlier run's folder aside (never one in use); False if in use."""
    busy = lease.in_use(job_dir)  # a folder in use is not moved from under its run
    if busy:
        print(f"ftjob run: {busy}", file=sys.stderr)
        return False
    aside = job_dir.with_name(f"{job_dir.name}.old-{time.strftime('%Y%m%dT%H%M%S')}")
    os.rename(job_dir, aside)
    print(f"ftjob run: --restart: the earlier run is kept in {aside}", file=out, flush=True)
    return True


def _run_held(job_file, name, spec, job_dir: Path, source_root: Path, run_id: str, out) -> int:
    """The rest of :func:`run`, with the job folder held by this run."""
    answered = _answered(name, spec, job_dir, out)
    if answered is not None:
        return answered
    logs, spec_file = _prepare_folder(job_dir, name, spec)
    r = spec.resources
    print(
        f"ftjob run: {name}: {r.nodes} node(s) x {r.nproc_per_node} process(es) on this "
        f"machine, job folder {job_dir}, logs in {logs}",
        file=out,
        flush=True,
    )
    # Orphans of the run (a worker whose agent died) are handed to this process, which ends
    # them with the rest (ftjob.job.processes).
    processes.become_subreaper()
    screen = Screen(out, JobFolder(job_dir).progress, since=time.time())
    gangs = 0
    while True:
        args = (spec, name, run_id, spec_file, job_dir, source_root, screen, out)
        nodes, first, interrupted, hurried = _gang(*args, again=gangs > 0)
        gangs += 1
        stopped = None if interrupted or first is not None else _preempted(nodes)
        if stopped is None:
            return _ended(job_dir, nodes, first, interrupted, hurried, out)
        # A SIGTERM to a node from outside (as the cluster evicts a pod): the gang saved at
        # the step it reached; a new gang resumes there at once, as the operator's would.
        print(f"ftjob run: {stopped}; starting the gang again, resuming from "
              f"{_newest_checkpoint(job_dir)}", file=out, flush=True)  # fmt: skip


def _gang(spec, name, run_id, spec_file, job_dir, source_root, screen, out, again: bool):
    """Start every node, wait until all end or one fails, and end every process; returns
    (nodes, the first to fail or None, interrupted, hurried)."""
    if again:  # the last gang's stop_all left its handler: Ctrl-C interrupts again
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # `kill`, a closed terminal or a CI timeout stop the gang the same way as Ctrl-C.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    port = free_port()
    nodes: list[Node] = []
    first, interrupted, hurried = None, False, False
    try:
        with screen:
            for rank in range(spec.resources.nodes):
                nodes.append(
                    start_node(
                        spec, name, rank, run_id, spec_file, port, job_dir, source_root, screen
                    )
                )
            first = wait_first(nodes, screen)
    except KeyboardInterrupt:
        interrupted = True
        print("\nftjob run: interrupted; stopping every process (Ctrl-C again: at once)",
              file=out, flush=True)  # fmt: skip
    finally:
        # Every exit path ends every process of the run (an exception included); a second
        # Ctrl-C only hurries this along.
        hurried = stop_all(nodes)
    return nodes, first, interrupted, hurried


def _preempted(nodes: list[Node]) -> str | None:
    """What the gang's records say when it stopped for a SIGTERM (None: it did not)."""
    if not any(n.proc.returncode == EXIT_PREEMPTED for n in nodes):
        return None
    records = [n.outcome().record or {} for n in nodes]
    said = [r for r in records if r.get("outcome") == "preempted"]
    return (said[0].get("message") if said else None) or "the gang stopped for a SIGTERM"


def _answered(name: str, spec, job_dir: Path, out) -> int | None:
    """The exit code when the folder's record answers without a run: it was trained with
    another spec (refused), or this one is trained already; None: run."""
    recorded = jobfolder.read(job_dir)
    diff = jobfolder.conflicts(job_dir, recorded, spec)
    if diff:
        fix = (
            "Keep it and train elsewhere (--workdir DIR), or start over here (--restart: "
            "the earlier run is moved aside, not deleted)."
        )
        held = jobfolder.trained(job_dir, recorded, spec)
        print(f"ftjob run: {jobfolder.refusal(job_dir, diff, fix, held)}", file=sys.stderr)
        return EXIT_FAILED
    export = inputs.already_trained(spec, job_dir, recorded)
    if export is not None:
        # Answered without starting torch; progress.json stays as the finished run left it.
        print(
            f"ftjob run: {name}: already trained ({recorded.get('trainedSteps', '?')} steps); the "
            f"exported model is in {export}. To train on, raise spec.training.maxSteps; to "
            "start over, --restart",
            file=out,
            flush=True,
        )
        return EXIT_OK
    return None


def _prepare_folder(job_dir: Path, name: str, spec) -> tuple[Path, Path]:
    """The folders the nodes write to, and the folder's record, also the spec file the nodes
    read (safe changes update it): (the logs folder, the spec file)."""
    folder = JobFolder(job_dir)
    folder.logs.mkdir(parents=True, exist_ok=True)
    folder.tmp.mkdir(exist_ok=True)
    jobfolder.write(job_dir, name, spec)
    return folder.logs, folder.record


def _ended(job_dir: Path, nodes: list[Node], first, interrupted: bool, hurried: bool, out) -> int:
    """Say how the run ended (interrupted, failed, done) and return its exit code."""
    restarts = _restarts(job_dir)
    if interrupted:
        how = " (killed at once on the second Ctrl-C)" if hurried else ""
        print(
            f"ftjob run: interrupted; every process stopped{how}{restarts}. Run the same "
            f"command again to resume from {_newest_checkpoint(job_dir)}",
            file=out,
            flush=True,
        )
        return EXIT_INTERRUPTED
    if first is not None:
        # The first node to fail leads, so that a tie between unnamed causes goes to it.
        ordered = [first, *(n for n in nodes if n is not first)]
        for line in _describe(failure.summarize([n.outcome() for n in ordered])):
            print(line, file=out)
        if restarts:  # the last failure is the one shown; the log has the earlier ones
            print(f"ftjob run: failed{restarts}; the nodes' logs say why in their "
                  "'ftjob agent:' lines", file=out)  # fmt: skip
        print(f"ftjob run: once fixed, run it again: it resumes from "
              f"{_newest_checkpoint(job_dir)}", file=out, flush=True)  # fmt: skip
        return EXIT_FAILED
    export = _export_path(job_dir)
    print(f"ftjob run: done{restarts}; the exported model is in {export}", file=out, flush=True)
    return EXIT_OK


def _restarts(job_dir: Path) -> str:
    """ " (after N restarts in place)" as rank 0 last reported it; "" when none."""
    try:
        count = int(json.loads(JobFolder(job_dir).progress.read_text()).get("restartsInPlace") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        count = 0
    if not count:
        return ""
    return f" (after {count} restart{'s' if count > 1 else ''} in place)"


def _describe(summary: failure.Summary) -> list[str]:
    """The failure, most important first: the headline, its details, the fix, the log."""
    lines = [f"ftjob run: {summary.headline()}"]
    lines += [f"  {x}" for x in summary.details]
    if summary.fix:
        lines.append(f"  fix: {summary.fix}")
    lines.append(f"  full log: {summary.log}")
    return lines


def _missing_gpus(spec) -> str | None:
    """Why this machine cannot run a GPU job (None if it can), said before any process starts."""
    r = spec.resources
    if not r.on_gpu:
        return None
    import torch  # only GPU jobs pay for the import

    need, have = r.nodes * r.gpus_per_node, torch.cuda.device_count()
    if have >= need:
        return None
    # The CPU variant must pass the spec's rules too: name what else it has to change.
    cpu = dataclasses.replace(spec, resources=dataclasses.replace(r, gpus_per_node=0))
    also = sorted({e.path.removeprefix("spec.") for e in check_rules(cpu, "spec")})
    then = f" (then also change {', '.join(also)})" if also else ""
    return (
        f"needs {need} GPUs (resources.nodes {r.nodes} x resources.gpusPerNode "
        f"{r.gpus_per_node}) but this machine has {have}; run it on a cluster "
        f"(kubectl apply -f), or on CPU with resources.gpusPerNode: 0{then}"
    )


def _newest_checkpoint(job_dir: Path) -> str:
    """Where a rerun resumes, as rank 0 last reported it (the trainer decides on the rerun)."""
    root = JobFolder(job_dir).checkpoints
    try:
        snap = json.loads(JobFolder(job_dir).progress.read_text())
    except (OSError, ValueError):
        snap = {}
    last = snap.get("lastCheckpoint")
    if last and Path(last).is_dir():
        return f"the newest checkpoint in {root} (step {snap.get('lastCheckpointStep')})"
    return f"the newest checkpoint in {root}, if any (else from the start)"


def _export_path(job_dir: Path) -> str:
    try:
        return json.loads(JobFolder(job_dir).progress.read_text())["exportPath"]
    except (OSError, ValueError, KeyError):
        return str(job_dir)


def _unset_secrets(spec) -> list[str]:
    """A variable a cluster takes from a Secret (env's valueFrom) comes from this machine's
    environment under ``ftjob run``: one it lacks is said, not guessed."""
    return [
        f"spec.env[{i}]: {e.name} comes from Secret {e.value_from.secret_key_ref.name} on a "
        f"cluster; ftjob run takes it from this environment, where it is not set (export "
        f"{e.name}=...)"
        for i, e in enumerate(spec.env)
        if e.value_from is not None and e.name not in os.environ
    ]
