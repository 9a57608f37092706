"""What a test run spent, from its JUnit XML: the slowest tests and the time by folder.

scripts/tests.py prints this after its lanes (``python scripts/ci_report.py
test-results/*.xml``), so every CI run says where its minutes went and a cut is chosen from
figures, not guesses. A test's time is pytest's whole-test figure (setup, call and teardown:
a fixture's cost lands on the test that built it). Two lanes run side by side, so the figures
add up to more than the run's wall time, which scripts/tests.py prints per lane."""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def cases(path: str) -> list[tuple[str, str, float, str]]:
    """(folder, test id, seconds, outcome) for every test case in the XML."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        folder = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        rows.append((folder, f"{module}::{case.get('name')}", float(case.get("time", 0)), outcome))
    return rows


def report(rows: list[tuple[str, str, float, str]], slowest: int) -> str:
    lines = [f"the {slowest} slowest tests (s, setup + call + teardown):"]
    for _, name, seconds, outcome in sorted(rows, key=lambda r: -r[2])[:slowest]:
        lines.append(f"{seconds:9.1f}  {name}" + ("" if outcome == "passed" else f"  [{outcome}]"))
    by_folder: dict[str, list[float]] = defaultdict(list)
    for folder, _, seconds, _ in rows:
        by_folder[folder].append(seconds)
    lines.append("time by folder (s, tests):")
    for folder, times in sorted(by_folder.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(times):9.1f}  {len(times):5d}  {folder}")
    total = sum(r[2] for r in rows)
    skipped = sum(1 for r in rows if r[3] == "skipped")
    lines.append(f"{total:9.1f}  {len(rows):5d}  all ({skipped} skipped)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+", help="pytest's --junitxml files (one a lane)")
    parser.add_argument("--slowest", type=int, default=30)
    args = parser.parse_args(argv)
    print(report([row for path in args.junit for row in cases(path)], args.slowest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
