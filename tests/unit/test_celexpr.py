"""The one CEL evaluator (ftjob/api/celexpr.py): a rule's verdict as the API server gives it, and
the interpreter loaded without the cel package's command line."""

from __future__ import annotations

import subprocess
import sys

from ftjob.api import celexpr


def test_a_rule_holds_fails_or_cannot_be_evaluated():
    scope = celexpr.Scope({"nodes": 2, "sharding": "hybrid"})
    assert scope.failure("self.sharding != 'hybrid' || self.nodes >= 2") is None
    assert scope.failure("self.nodes >= 4") == ""  # false: the rule's own message is shown
    # A missing key is an evaluation error, which refuses, as in the API server.
    assert scope.failure("self.gpus > 0").startswith("rule evaluation failed: ")


def test_a_transition_rule_reads_the_old_object():
    assert celexpr.uses_old("self == oldSelf") and not celexpr.uses_old("self.a == 1")
    assert celexpr.Scope({"a": 1}, {"a": 1}).failure("self == oldSelf") is None
    assert celexpr.Scope({"a": 1}, {"a": 2}).failure("self == oldSelf") == ""


def test_the_interpreter_loads_without_the_packages_command_line_and_cel_still_imports():
    """typer and prompt_toolkit (the cel package's CLI) stay out of every ftjob process, and a
    later `import cel` gets the same interpreter (a second initialisation would panic)."""
    code = (
        "import sys; from ftjob.api import celexpr; "
        "assert 'typer' not in sys.modules and 'prompt_toolkit' not in sys.modules; "
        "import cel; assert cel.compile is celexpr._cel.compile; "
        "print(cel.compile('1 + 2').execute(cel.Context(variables={})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"
