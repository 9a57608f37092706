"""Every limit the suite sets on a wait is a hang guard far above an honest duration on a busy
machine (tests/hangs.py): a literal under hangs.FLOOR seconds fails here unless its line says
why it is not a hang guard (``# not a hang guard: ...`` on its lines or a comment line right
above: one try of a poll that is retried, a product's promised bound under test, the grace
before a SIGKILL, a check that something is still blocked)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import hangs

TESTS = Path(__file__).resolve().parents[1]
MARK = "not a hang guard:"
CLOCKS = {"monotonic", "perf_counter", "time"}
# Calls whose positional numbers are limits: proc.wait(10), cluster.wait(check, 10, "what").
WAITS = {"wait", "join", "communicate", "wait_phase", "wait_for_phase"}
NAMED = re.compile(r"TIMEOUT|GUARD|DEADLINE|PROMPT|WAIT|LIMIT")


def _number(node) -> float | None:
    """A literal number of seconds (or ``timedelta(seconds=N)``), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "timedelta":
        return next((_number(k.value) for k in node.keywords if k.arg == "seconds"), None)
    return None


def _clock(node) -> bool:
    return any(
        isinstance(n, ast.Call) and getattr(n.func, "attr", None) in CLOCKS for n in ast.walk(node)
    )


def _limits(node) -> list[tuple[float | None, ast.AST]]:
    """The seconds a node sets as a limit on a wait, if it is one, each with the node whose
    lines may say why it is short."""
    if isinstance(node, ast.arguments):  # def wait(check, timeout=20)
        positional = [*node.posonlyargs, *node.args]
        defaulted = positional[len(positional) - len(node.defaults) :]
        pairs = [*zip(defaulted, node.defaults, strict=True)]
        pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if d]
        return [(_number(d), d) for a, d in pairs if "timeout" in a.arg]
    found: list = []
    if isinstance(node, ast.Call):
        found = [_number(k.value) for k in node.keywords if k.arg == "timeout"]
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        if name in WAITS or name == "timeout":  # .wait(10), pytest.mark.timeout(20)
            found += [_number(a) for a in node.args]
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _clock(node.left):
        found = [_number(node.right)]  # a deadline: time.monotonic() + 60
    elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.Lt) and _clock(node.left):
        found = [_number(c) for c in node.comparators]  # elapsed: monotonic() - began < 60
    elif isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and NAMED.search(t.id) for t in node.targets
    ):
        found = [_number(node.value)]
    return [(seconds, node) for seconds in found]


def short_limits() -> list[str]:
    """file:line: seconds, for each literal limit under the floor whose lines give no reason."""
    short = []
    for path in sorted(TESTS.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            for seconds, where in _limits(node):
                # Its own lines, or a comment line right above them.
                said = lines[max(where.lineno - 2, 0) : where.end_lineno]
                if not said[0].strip().startswith("#"):
                    said = said[1:]
                if (
                    seconds is not None
                    and seconds < hangs.FLOOR
                    and not any(MARK in line for line in said)
                ):
                    short.append(f"{path.relative_to(TESTS)}:{where.lineno}: {seconds} s")
    return sorted(short)


def test_every_limit_on_a_wait_is_far_above_a_busy_machines_honest_time():
    assert short_limits() == [], (
        f"limits under {hangs.FLOOR} s: use tests/hangs.py (hangs.after(seconds alone)), or "
        f"say on the line why it is not a hang guard ('# {MARK} ...')"
    )


def test_the_check_finds_a_short_limit_of_each_kind(tmp_path, monkeypatch):
    """The scan sees each way a test sets a limit (so an empty list above means something)."""
    kinds = {
        "subprocess.run(cmd, timeout=30)",
        "proc.wait(10)",
        "thread.join(timeout=5)",
        "proc.communicate(timeout=20)",
        "cluster.wait(ready, 15, 'pods')",
        "pytestmark = pytest.mark.timeout(20)",
        "deadline = time.monotonic() + 40",
        "assert time.monotonic() - began < 5",
        "RUN_TIMEOUT = 45",
        "barrier(timeout=timedelta(seconds=10))",
        "def wait(check, timeout=20): pass",
    }
    fine = [
        "proc.wait(600)",
        "proc.wait(hangs.RUN)",
        "urlopen(url, timeout=1)  # not a hang guard: one try of a poll",
        "rows.get(key, 0)",
        "def run(cmd, timeout=None, retries=3): pass",
    ]
    (tmp_path / "test_x.py").write_text("\n".join([*sorted(kinds), *fine]) + "\n")
    monkeypatch.setattr(sys.modules[__name__], "TESTS", tmp_path)
    assert len(short_limits()) == len(kinds)


def test_a_whole_tests_limit_leaves_room_for_the_runs_it_waits_for():
    """pytest-timeout's default (pyproject) is the outer guard: a test that waits for two runs,
    each up to hangs.RUN, is not cut short by it."""
    import tomllib

    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    assert config["tool"]["pytest"]["ini_options"]["timeout"] >= 2 * hangs.RUN
