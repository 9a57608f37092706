"""python -m bench [--suite NAME ...] [--quick] [--jobs N] [--json PATH] [--no-results-md]

Runs the suites (default: every CPU suite, plus `gpu` where CUDA is available; `fleet`, a
real control plane with N jobs, only when named), writes bench/results/<time>.json (or
--json PATH) and appends the table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from bench import common, report

CPU_SUITES = [
    "throughput",
    "checkpoints",
    "loading",
    "operator",
    "scaling",
    "planner",
    "memory",
    "data",
    "accumulation",
    "dpo",
    "chunkedloss",
    "kernels",
    "grpo",
    "startup",
]
ALL_SUITES = [*CPU_SUITES, "gpu", "fleet"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--suite", action="append", choices=ALL_SUITES, help="repeatable")
    p.add_argument("--quick", action="store_true", help="smaller models and fewer jobs")
    p.add_argument("--jobs", type=int, help="FineTuneJobs of the fleet suite (default 1000)")
    p.add_argument("--json", type=Path, help="where the JSON goes (default bench/results/)")
    p.add_argument("--no-results-md", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--workdir", type=Path, help="keep models and runs here (default: a temp dir)")
    a = p.parse_args(argv)
    suites = a.suite or [*CPU_SUITES, *(["gpu"] if _cuda() else [])]
    started = datetime.now(timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    out = a.json or common.ROOT / "bench" / "results" / f"{stamp}.json"
    work = a.workdir or Path(tempfile.mkdtemp(prefix="ftjob-bench-"))
    command = "python -m bench" + "".join(f" {shlex.quote(x)}" for x in (argv or sys.argv[1:]))
    results = {"command": command, "started": started.strftime("%Y-%m-%d %H:%M UTC"),
               "machine": common.machine(), "quick": a.quick, "suites": {}}  # fmt: skip
    clock = time.monotonic()
    try:
        for name in suites:
            t, load = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
            print(f"bench: {name} ...", flush=True)
            try:
                module = importlib.import_module(f"bench.{name}")
                if name == "gpu" and not module.available():
                    results["suites"][name] = {"skipped": "no CUDA device", "rows": []}
                    continue
                sized = {"jobs": a.jobs} if name == "fleet" else {}
                results["suites"][name] = module.run(work, a.quick, **sized)
            except Exception as e:  # noqa: BLE001 - one failed suite must not lose the others
                traceback.print_exc()
                results["suites"][name] = {"error": f"{type(e).__name__}: {e}"}
            results["suites"][name]["seconds"] = time.monotonic() - t
            results["suites"][name]["loadavg"] = load  # others' work slows a suite down
            for line in report.table_rows({"suites": {name: results["suites"][name]}}):
                print(line, flush=True)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["seconds"] = time.monotonic() - clock
    results["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    results["json"] = _relative(out)
    report.write_json(out, results)
    if not a.no_results_md:
        report.append(common.ROOT / "bench" / "RESULTS.md", results)
    print(f"bench: {results['seconds']:.0f} s; wrote {results['json']}", flush=True)
    return 1 if any("error" in r for r in results["suites"].values()) else 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(common.ROOT))
    except ValueError:
        return path.name  # no machine paths in RESULTS.md


if __name__ == "__main__":
    sys.exit(main())
