"""The README's two commands: the first runs the example, the second is what CI runs
(`.ci/run`), and it prepares podman first, so that the image tests (tests/images) run on a
fresh machine instead of failing for want of an install."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return block.group(1).strip().splitlines()


def test_the_readme_opens_with_two_commands_the_first_runs_the_example():
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith(".venv/bin/ftjob run examples/tiny.yaml")


def test_ci_runs_exactly_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_the_test_command_installs_podman_before_the_tests():
    first, *rest = readme_commands()[1].split(" && ")
    assert first == "bash scripts/podman-host.sh"
    assert (ROOT / "scripts" / "podman-host.sh").is_file()
    assert rest[-1].endswith("python scripts/tests.py")
    # The venv: cached by its pins outside the checkout, the project installed from it.
    assert rest[0] == "bash scripts/venv.sh" and (ROOT / "scripts" / "venv.sh").is_file()
