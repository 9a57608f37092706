"""The metric names the chart's Grafana dashboard queries, and the series a real /metrics
page exports, so that tests can hold one against the other (the dashboard cannot drift).

A PromQL expression is read with a small tokenizer: strings, label matchers (``{...}``),
ranges and subqueries (``[...]``) and Grafana's variables are dropped; an identifier followed
by ``(`` (or by ``by``/``without``) is a function or an aggregation, one in ``by (...)`` or
``on (...)`` a label, and the rest are metric names. Grafana's ``label_values(metric,
label)`` keeps its metric only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "ftjob" / "dashboards" / "ftjob.json"

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<open_brace>\{) | (?P<close_brace>\}) | (?P<open_bracket>\[) | (?P<close_bracket>\])
  | (?P<open_paren>\() | (?P<close_paren>\)) | (?P<comma>,)
  | (?P<variable>\$\{[^}]*\}|\$\w+)
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)(?:ms|[smhdwy])?)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<operator>==|!=|=~|!~|>=|<=|[-+*/%^<>=@])
  | (?P<space>\s+)
    """,
    re.VERBOSE,
)
# Words that are PromQL syntax, not series (binary set operators, modifiers, constants).
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "start", "end", "inf", "nan"}
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<arg>.*)\)\s*$", re.DOTALL)


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot read PromQL at {expr[pos : pos + 20]!r} in {expr!r}")
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana label_values query) reads."""
    if m := _LABEL_VALUES.match(expr):
        toks = tokens(m["arg"])
        depth, cut = 0, len(toks)
        for i, (kind, _) in enumerate(toks):  # label_values(metric{...}, label): drop label
            if kind in ("open_paren", "open_brace"):
                depth += 1
            elif kind in ("close_paren", "close_brace"):
                depth -= 1
            if kind == "comma" and depth == 0:
                cut = i
                break
        toks = toks[:cut]
    else:
        toks = tokens(expr)
    names: set[str] = set()
    inside = 0  # depth of {...} and [...]: label matchers, ranges, subqueries
    skip_list = False  # the next (...) is a label list
    list_depth = 0
    for i, (kind, text) in enumerate(toks):
        if kind in ("open_brace", "open_bracket"):
            inside += 1
        elif kind in ("close_brace", "close_bracket"):
            inside -= 1
        elif inside:
            continue
        elif list_depth:
            list_depth += (kind == "open_paren") - (kind == "close_paren")
        elif kind == "open_paren" and skip_list:
            skip_list, list_depth = False, 1
        elif kind == "name":
            following = toks[i + 1] if i + 1 < len(toks) else ("", "")
            if text in _LABEL_LISTS:
                skip_list = True
            elif following[0] == "open_paren" or following[1] in ("by", "without"):
                continue  # a function or an aggregation (`sum by (le) (...)` too)
            elif text.lower() in _KEYWORDS:
                continue
            else:
                names.add(text)
    return names


def queries(dashboard: dict) -> list[str]:
    """Every PromQL query of the dashboard: its panels' targets (rows' panels included) and
    its query variables."""
    out = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        out += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def exported_series(exposition: str) -> set[str]:
    """The series names Prometheus stores from one /metrics page: a gauge's own name, a
    counter's ``_total``, a histogram's ``_bucket``, ``_sum`` and ``_count`` (and
    ``_created`` of both). A family declared with no sample yet (a labelled gauge before
    its first job) counts: its ``# TYPE`` line is on the page."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
    }
    out = set()
    for family in text_string_to_metric_families(exposition):
        out |= {family.name + s for s in suffixes.get(family.type, ("",))}
        out |= {s.name for s in family.samples}
    return out


def families(exposition: str) -> set[str]:
    """The metric names one /metrics page declares (its ``# TYPE`` lines): a counter's
    without ``_total``, as Prometheus' metadata and the exposition's type lines name it."""
    return {family.name for family in text_string_to_metric_families(exposition)}


def unexported(dashboard: dict, exported: set[str]) -> dict[str, list[str]]:
    """Metric name -> the dashboard's queries that name it, for names not in ``exported``."""
    missing: dict[str, list[str]] = {}
    for query in queries(dashboard):
        for name in sorted(metric_names(query) - exported):
            missing.setdefault(name, []).append(query)
    return missing
