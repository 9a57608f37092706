"""scripts/ci_report.py reads what pytest's --junitxml wrote: a real pytest run of a small
folder of tests (one slow, one skipped, one failing) is the producer, the report the consumer.

    python -m pytest tests/unit/test_ci_report.py -q
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("ci_report", ROOT / "scripts" / "ci_report.py")
ci_report = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ci_report)

TESTS = {
    "tests/fast/test_a.py": "def test_quick():\n    pass\n",
    "tests/slow/test_b.py": (
        "import time, pytest\n"
        "def test_sleeps():\n    time.sleep(0.3)\n"
        "@pytest.mark.skip(reason='left out')\ndef test_skipped():\n    pass\n"
        "def test_fails():\n    assert False\n"
    ),
}


def test_the_report_names_the_slowest_tests_and_sums_each_folder(tmp_path):
    for name, text in TESTS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "--rootdir", str(tmp_path), f"--junitxml={xml}", "tests"],
                   cwd=tmp_path, capture_output=True, check=False)  # fmt: skip
    rows = ci_report.cases(str(xml))
    assert {(r[0], r[1].rsplit("::", 1)[1], r[3]) for r in rows} == {
        ("tests/fast", "test_quick", "passed"),
        ("tests/slow", "test_sleeps", "passed"),
        ("tests/slow", "test_skipped", "skipped"),
        ("tests/slow", "test_fails", "failure"),
    }
    lines = ci_report.report(rows, slowest=1).splitlines()
    assert lines[1].endswith("tests.slow.test_b::test_sleeps")
    assert float(lines[1].split()[0]) >= 0.3
    assert lines[2] == "time by folder (s, tests):"
    folders = [(line.split()[2], int(line.split()[1])) for line in lines[3:-1]]
    assert folders == [("tests/slow", 3), ("tests/fast", 1)]  # the costlier first
    assert lines[-1].split()[1:] == ["4", "all", "(1", "skipped)"]
