"""JSON results and the rows appended to bench/RESULTS.md: pure functions of a result dict."""

from __future__ import annotations

import json
import math
from pathlib import Path

HEADER = "| suite | measurement | ftjob | baseline | baseline is | ratio | goal | met |"
RULE = "|---|---|---:|---:|---|---:|---|---|"
TITLE = "# Benchmark results\n\nAppended by `python -m bench`; newest last.\n\n"


def row(measurement: str, ftjob, baseline=None, baseline_name: str = "-", ratio=None,
        goal: str = "-", met: bool | None = None) -> dict:  # fmt: skip
    """One measurement: ftjob's number, the baseline's from the same run, and the goal."""
    return {"measurement": measurement, "ftjob": ftjob, "baseline": baseline,
            "baseline_name": baseline_name, "ratio": ratio, "goal": goal, "met": met}  # fmt: skip


def fmt(value) -> str:
    """A table cell: 3 significant figures, lists joined, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return " / ".join(fmt(v) for v in value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0:
            return "0"
        digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
        return f"{value:,.{digits}f}"
    return str(value).replace("|", "/")


def met_cell(met) -> str:
    return {True: "**met**", False: "not met", None: "-"}[met]


def table_rows(results: dict) -> list[str]:
    """One markdown row per measurement of every suite in ``results['suites']``."""
    lines = []
    for suite, result in results["suites"].items():
        if "error" in result:
            error = fmt(result["error"][:200])
            lines.append(f"| {suite} | failed: {error} | - | - | - | - | - | - |")
            continue
        for r in result.get("rows", []):
            cells = [suite, r["measurement"], fmt(r["ftjob"]), fmt(r["baseline"]),
                     r.get("baseline_name", "-"), fmt(r["ratio"]), r.get("goal", "-"),
                     met_cell(r.get("met"))]  # fmt: skip
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return lines


def markdown(results: dict) -> str:
    """The section appended to RESULTS.md for one run."""
    m = results["machine"]
    versions = ", ".join(f"{k} {m[k]}" for k in ("torch", "transformers", "trl") if m.get(k))
    load = results.get("loadavg_after") or "-"
    lines = [
        f"## {results['started']} — `{results['command']}`",
        "",
        f"- machine: {m['cpus']} CPUs, {m.get('cuda') or 'no GPU'}, Python {m['python']}, "
        f"{versions}",
        f"- load average (1, 5, 15 min) before: {fmt(m.get('loadavg'))}; after: {fmt(load)} "
        "(a shared machine: numbers are noisy)",
        f"- wall time of the whole run: {results['seconds']:.0f} s; JSON: `{results['json']}`",
        "- per suite, seconds (1-min load average at its start): "
        + ", ".join(
            f"{name} {r.get('seconds', 0):.0f} s ({fmt((r.get('loadavg') or [None])[0])})"
            for name, r in results["suites"].items()
        ),
        "",
        HEADER,
        RULE,
        *table_rows(results),
        "",
    ]
    return "\n".join(lines) + "\n"


def append(results_md: Path, results: dict) -> None:
    if not results_md.exists():
        results_md.write_text(TITLE)
    with results_md.open("a") as f:
        f.write(markdown(results))


def write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
