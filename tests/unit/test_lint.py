"""Lint, format and the layering contracts (import-linter, pyproject.toml) are tests too."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def tool(name):
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    assert path, f"{name} is not installed: pip install -e '.[test]'"
    return str(path)


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["lint-imports"]],
    ids=["ruff-check", "ruff-format", "import-contracts"],
)
def test_clean(command):
    result = subprocess.run(
        [tool(command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles of ``graph`` (module -> modules it imports): its strongly connected
    components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            step = next((w for w in edges if w not in index or w in stack), None)
            if step is not None and step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                work.append((step, iter(sorted(graph[step]))))
                continue
            if step is not None:
                low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                circle = set()
                while circle.isdisjoint({node}):
                    circle.add(stack.pop())
                if len(circle) > 1:
                    circles.append(circle)
    return circles


def test_no_module_imports_itself_through_others():
    """The layers contracts hold between folders and within the plan and the trainer; this
    holds everywhere, imports inside functions ("imported late") included: no circle."""
    import grimp

    graph = grimp.build_graph("ftjob")
    modules = set(graph.modules)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & modules for m in modules}
    assert strongly_connected(edges) == []


def test_the_circle_check_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert strongly_connected(edges) == [{"a", "b", "c"}]
