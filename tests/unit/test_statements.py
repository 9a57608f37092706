"""No function in ftjob/ holds more than 40 statements (the house rule: code for the next
person). A statement is what Python's ``ast`` calls one, nested ones included: a function's
count is every statement in its body, at any depth."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "ftjob"
LIMIT = 40  # not a hang guard: statements per function


def statements(fn: ast.AST) -> int:
    return sum(isinstance(node, ast.stmt) for node in ast.walk(fn)) - 1  # not the def itself


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = statements(node)
                if n > LIMIT:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {n}")
    return found


def test_no_function_in_ftjob_is_over_40_statements():
    assert long_functions(ROOT) == []


def test_the_count_finds_a_long_function_and_counts_nested_statements(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f"def short():\n    pass\n\n\ndef long():\n    if True:\n{body}\n"
    )
    assert long_functions(tmp_path / "pkg") == [f"pkg/m.py:5 long: {LIMIT + 1}"]
