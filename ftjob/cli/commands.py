"""The ftjob command line.

ftjob run examples/tiny.yaml        # fine-tune on this machine (2 CPU processes here)
ftjob validate examples/*.yaml      # the answer kubectl apply would get, offline
ftjob validate -o json examples/*.yaml     # ... as one JSON document, for CI (docs/cli.md)
ftjob plan examples/*.yaml          # will it fit? memory, time, traffic
ftjob render examples/tiny.yaml     # what would be created for the job
ftjob render --children examples/tiny.yaml  # ... with the operator's Service, ConfigMap, Pods
ftjob crd > manifests/crd.yaml      # the CustomResourceDefinition (--profile: the profile's)
ftjob operator --all-namespaces     # the operator, against the kubeconfig's cluster
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ftjob import __version__
from ftjob.api import contract, crd, manifest
from ftjob.api.jobspec import API_VERSION, KIND
from ftjob.api.profile import KIND as PROFILE_KIND
from ftjob.api.profile import Profile, parse_profile
from ftjob.api.schema import SpecError, to_dict
from ftjob.cli import extras, output, sources, validate
from ftjob.job import machine
from ftjob.plan import modelshape
from ftjob.plan.describe import describe
from ftjob.plan.options import Plan, plan

EXIT_INVALID, EXIT_USAGE = 1, 2


class InvalidJob(Exception):
    """A FineTuneJob that ftjob or the API server refuses; ``lines`` say why."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        super().__init__("\n".join(lines))


def _jobs(path: str) -> list[dict]:
    docs = manifest.load(path)
    jobs = [d for d in docs if d.get("kind") == KIND]
    if not jobs:
        raise manifest.ManifestError(f"{path}: holds no {KIND} (kind: {KIND})")
    return jobs


def _profile(args: argparse.Namespace) -> Profile | None:
    """The FineTuneProfile of ``--profile FILE``, checked; None without one."""
    if not getattr(args, "profile", None):
        return None
    doc = manifest.load_one(args.profile, PROFILE_KIND)
    try:
        return parse_profile(doc)
    except SpecError as e:
        raise InvalidJob([f"{args.profile}: {x}" for x in e.errors]) from None


def _valid_jobs(
    path: str, local: bool = False, profile: Profile | None = None
) -> list[validate.CheckedJob]:
    """The jobs in ``path``, checked (``profile`` applied); :class:`InvalidJob` if any is
    refused. ``local``: the model and data must be beside the job file (plan reads them)."""
    jobs = [validate.check(doc, job_file=path, local=local, profile=profile) for doc in _jobs(path)]
    for job in jobs:
        if not job.ok:
            raise InvalidJob([f"{path}: {x}" for x in job.errors or job.server_errors])
    return jobs


def cmd_validate(args: argparse.Namespace) -> int:
    old, profile = None, _profile(args)
    if args.old:
        old = manifest.load_one(args.old, KIND)
    results, warned = [], {}
    for path in args.files:
        for doc in _jobs(path):
            checked = validate.check(doc, old, job_file=path, profile=profile)
            validate.memory_verdict(checked, strict=args.strict)
            if args.check_sources and checked.ok:
                checked.errors.extend(sources.problems(checked.spec))
            results.append(output.validation_result(path, checked))
            for warning in checked.warnings:
                warned.setdefault(warning, []).append(checked.name or path)
            if not args.output:
                _print_checked(path, checked)
    if args.output:
        print(output.dumps(output.validation_list(results), args.output), end="")
    else:
        _print_warnings(warned)
    return 0 if all(r["valid"] for r in results) else EXIT_INVALID


def _print_checked(path: str, checked: validate.CheckedJob) -> None:
    label = f"{path}: {KIND} {checked.name or '(unnamed)'}"
    if checked.ok:
        print(f"{label}: valid -- {validate.summary(checked.spec)}")
        if checked.profile:
            print(f"  FineTuneProfile {checked.profile['name']} applied: `ftjob render` shows it")
        for note in checked.notes:
            print(f"  {note}")
        return
    print(f"{label}: INVALID")
    for line in checked.errors:
        print(f"  {line}")
    if checked.server_errors:
        print("  kubectl apply would be refused with:")
        for line in checked.server_errors:
            print(f"    {line}")


def _print_warnings(warned: dict[str, list[str]]) -> None:
    """Each warning once, after every job, naming the jobs it is about: one line for a
    directory of jobs, not one per file."""
    for warning, names in warned.items():
        print(f"warning ({', '.join(names)}): {warning}")


def cmd_render(args: argparse.Namespace) -> int:
    out = []
    for job in _valid_jobs(args.file, profile=_profile(args)):
        meta = {"name": job.name, "namespace": args.namespace}
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": meta,
                "spec": to_dict(job.spec),
            }
        )
        if args.children:
            from ftjob.operator import render  # pure: no kopf or kubernetes needed

            out += render.children(job.name, args.namespace, job.spec, args.attempt)
    if args.output:
        print(output.dumps(output.object_list(out), args.output), end="")
        return 0
    print(f"# The trainer's spec with every default filled in: {args.file}")
    print(manifest.dumps(out), end="")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    # Each job is planned on its own: a refused job or an unreadable file is reported (stderr,
    # and under "invalid" with -o) and the exit code says so, but never hides another's plan.
    worst, results, invalid = 0, [], []
    profile = _profile(args)
    for path in args.files:
        try:
            docs = _jobs(path)
        except manifest.ManifestError as e:
            print(f"ftjob: {e}", file=sys.stderr)
            worst = max(worst, EXIT_USAGE)
            continue
        for doc in docs:
            try:
                job, result = _plan_job(path, doc, profile)
            except InvalidJob as e:
                for line in e.lines:
                    print(line, file=sys.stderr)
                invalid.append(output.invalid_plan(path, doc, e.lines))
                worst = max(worst, EXIT_INVALID)
                continue
            if result.fits is False:
                worst = max(worst, EXIT_INVALID)
            if args.output:
                results.append(output.plan_result(path, job.name, job.spec, result, job.notes))
            else:
                _print_plan(path, job, result)
    if args.output:
        print(output.dumps(output.plan_list(results, invalid), args.output), end="")
    return worst


def _plan_job(
    path: str, doc: dict, profile: Profile | None = None
) -> tuple[validate.CheckedJob, Plan]:
    """The job checked and planned; :class:`InvalidJob` if it is refused or has no shape.
    Its model must be read here (the estimate needs its shape); its data need not be."""
    job = validate.check(doc, job_file=path, local=True, profile=profile)
    if not job.ok:
        raise InvalidJob([f"{path}: {x}" for x in job.errors or job.server_errors])
    try:
        shape = job.shape or modelshape.shape_for(job.spec.model.source, None)
    except ValueError as e:
        raise InvalidJob([f"{path}: {e}"]) from None
    # A CPU job without resources.memory is planned as `ftjob run` would run it: here.
    return job, plan(job.spec, shape, machine_bytes=machine.memory_bytes())


def _print_plan(path: str, job: validate.CheckedJob, result: Plan) -> None:
    print(f"{path}: {KIND} {job.name}")
    for line in describe(job.spec, result, Path(path).resolve().parent):
        print(f"  {line}")
    for note in job.notes:
        print(f"  {note}")


def cmd_crd(args: argparse.Namespace) -> int:
    print(crd.render_profile_yaml() if args.profile else crd.render_yaml(), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ftjob.cli import run as local  # starts processes; kept out of the other commands' imports

    if args.profile_steps:  # the nodes' processes inherit it (ftjob.cli.nodes.start_node)
        os.environ[contract.PROFILE_STEPS_ENV] = str(args.profile_steps)
    return local.run(args.file, args.workdir, restart=args.restart, profile=_profile(args))


def cmd_operator(args: argparse.Namespace) -> int:
    from ftjob.operator.__main__ import run  # kopf and kubernetes load only here

    return run(args)


def _output_option(p: argparse.ArgumentParser, what: str = "one document") -> None:
    p.add_argument(
        "-o",
        "--output",
        choices=output.FORMATS,
        help=f"print {what} as json or yaml for scripts (docs/cli.md) instead of text",
    )


def _profile_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="apply this FineTuneProfile as the operator would: its defaults under what the "
        "job leaves unset, its limits checked (docs/platform.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftjob", description="Fine-tune language models on Kubernetes with FineTuneJobs."
    )
    parser.add_argument("--version", action="version", version=f"ftjob {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "validate",
        help="check job files as the API server would (schema + CEL), offline",
        description="Check FineTuneJob files with ftjob's rules and the CRD's schema and CEL "
        "rules, as kubectl apply would. Exit 0 if all are valid, 1 if any is not.",
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument(
        "--old", metavar="FILE", help="check FILEs as updates of this job (immutable fields)"
    )
    p.add_argument(
        "--check-sources",
        action="store_true",
        help="also ask the store whether each s3:// source is there and readable, with this "
        "machine's AWS credentials (the bucket, the key, the key pair, the permission)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="a job the plan says will not fit its memory (spec.plan.enforce on) is invalid, "
        "not only warned of: what the operator and the trainer will refuse",
    )
    _output_option(p)
    _profile_option(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "render",
        help="print what would be created for a job",
        description="Print the job as the trainer and operator see it, every default filled.",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("--namespace", "-n", default="default", help="namespace of the job")
    p.add_argument(
        "--children",
        action="store_true",
        help="also print the ConfigMap, headless Service and Pods the operator creates",
    )
    p.add_argument(
        "--attempt", type=int, default=0, help="gang attempt the Pods belong to (--children)"
    )
    _output_option(p, "a v1 List of the objects (kubectl apply -f takes it)")
    _profile_option(p)
    p.set_defaults(func=cmd_render)

    p = sub.add_parser(
        "plan",
        help="estimate memory, time and traffic; say whether the job fits",
        description="Estimate per-GPU memory, CPU memory while loading, checkpoint size, "
        "step time and network traffic for a job, and what to change if it will not fit. "
        "Exit 0 if all fit (or cannot be checked), 1 if any will not fit.",
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    _output_option(p)
    _profile_option(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "crd",
        help="print the FineTuneJob CustomResourceDefinition",
        description=(
            "Print the CRD generated from ftjob/api/jobspec/ (what manifests/crd.yaml holds)."
        ),
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="print the FineTuneProfile CRD instead (ftjob/api/profile.py; "
        "manifests/profile-crd.yaml)",
    )
    p.set_defaults(func=cmd_crd)

    p = sub.add_parser(
        "run",
        help="train a job on this machine (each node a local process group)",
        description="Run the job's nodes as local processes with the commands the pods would "
        "run (CPU or local GPUs), the volume mapped to a local folder. Exit 0 when the model "
        "is exported, 1 if a rank fails, 130 on Ctrl-C. Running again resumes.",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help="the job's folder: checkpoints, progress and the exported model "
        "(default: runs/<job name> in the current directory)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="start over: move the job folder's earlier run aside (to <folder>.old-<time>, "
        "nothing is deleted) and train from step 0",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="profile N training steps after 2 warm-up steps on rank 0 (torch.profiler): "
        "the device's busy fraction, the longest kernels and the host syncs in "
        "<job folder>/logs/profile/summary.json, beside a Chrome trace (docs/progress.md)",
    )
    _profile_option(p)
    p.set_defaults(func=cmd_run)

    from ftjob.operator.__main__ import add_arguments  # argparse only; kopf loads on run

    p = sub.add_parser(
        "operator",
        help="run the FineTuneJob operator against the cluster of a kubeconfig",
        description="Reconcile FineTuneJobs into gangs of torchrun pods (kopf).",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_operator)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A command whose extra is not installed says which and how, before it imports anything.
    if problem := extras.command_problem(args.command):
        print(f"ftjob: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except ModuleNotFoundError as e:
        # Any other import of an extra's module (a tracker's client, a partial install).
        extra = extras.extra_of(e.name or "")
        if extra is None:
            raise
        print(f"ftjob: {extras.hint(extra, [e.name], f'ftjob {args.command}')}", file=sys.stderr)
        return EXIT_USAGE
    except manifest.ManifestError as e:
        print(f"ftjob: {e}", file=sys.stderr)
        return EXIT_USAGE
    except InvalidJob as e:
        for line in e.lines:
            print(line, file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
