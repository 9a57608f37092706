"""The ftjob command line.

ftjob validate examples/*.yaml      # the verdict kubectl apply would get, offline
ftjob render examples/tiny.yaml     # what would be created for the job
ftjob crd > manifests/crd.yaml      # the CustomResourceDefinition
"""

from __future__ import annotations

import argparse
import sys

from ftjob import __version__, crd, manifest, validation
from ftjob.schema import to_dict
from ftjob.spec import API_VERSION, KIND

EXIT_INVALID, EXIT_USAGE = 1, 2


def _jobs(path: str) -> list[dict]:
    docs = manifest.load(path)
    jobs = [d for d in docs if d.get("kind") == KIND]
    if not jobs:
        raise manifest.ManifestError(f"{path}: holds no {KIND} (kind: {KIND})")
    return jobs


def cmd_validate(args: argparse.Namespace) -> int:
    old = None
    if args.old:
        old_jobs = _jobs(args.old)
        if len(old_jobs) != 1:
            raise manifest.ManifestError(f"{args.old}: --old needs exactly one {KIND}")
        old = old_jobs[0]
    failed = 0
    for path in args.files:
        for doc in _jobs(path):
            verdict = validation.check(doc, old)
            label = f"{path}: {KIND} {verdict.name or '(unnamed)'}"
            if verdict.ok:
                print(f"{label}: valid -- {validation.summary(verdict.spec)}")
                continue
            failed += 1
            print(f"{label}: INVALID")
            for line in verdict.errors:
                print(f"  {line}")
            if verdict.server_errors:
                print("  kubectl apply would be refused with:")
                for line in verdict.server_errors:
                    print(f"    {line}")
    return EXIT_INVALID if failed else 0


def cmd_render(args: argparse.Namespace) -> int:
    out = []
    for doc in _jobs(args.file):
        verdict = validation.check(doc)
        if not verdict.ok:
            for line in verdict.errors or verdict.server_errors:
                print(f"{args.file}: {line}", file=sys.stderr)
            return EXIT_INVALID
        meta = {"name": verdict.name, "namespace": args.namespace}
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": meta,
                "spec": to_dict(verdict.spec),
            }
        )
    print(f"# The trainer's spec with every default filled in: {args.file}")
    print(manifest.dumps(out), end="")
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    print(crd.render_yaml(), end="")
    return 0


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
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "render",
        help="print what would be created for a job",
        description="Print the job as the trainer and operator see it, every default filled.",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("--namespace", "-n", default="default", help="namespace of the job")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser(
        "crd",
        help="print the FineTuneJob CustomResourceDefinition",
        description="Print the CRD generated from ftjob/spec.py (what manifests/crd.yaml holds).",
    )
    p.set_defaults(func=cmd_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except manifest.ManifestError as e:
        print(f"ftjob: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
