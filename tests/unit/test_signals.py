"""The processes the tests start hear Ctrl-C however the suite itself was started: a CI that
runs it as a background job (SIGINT ignored, inherited by every child) must not turn the
Ctrl-C tests (tests/e2e/test_run_display.py, test_recovery.py) into runs that never stop.

    python -m pytest tests/unit/test_signals.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hangs

ROOT = Path(__file__).resolve().parents[2]
PROBE = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"]
# Starts its arguments with SIGINT ignored, as a non-interactive shell starts `cmd &`.
IGNORING = "import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); " \
    "sys.exit(subprocess.call(sys.argv[1:]))"  # fmt: skip


def test_a_process_the_tests_start_gets_ctrl_c():
    said = subprocess.run(PROBE, capture_output=True, text=True, timeout=hangs.FLOOR).stdout
    assert said.strip() == "<built-in function default_int_handler>", said


def test_a_suite_started_with_ctrl_c_ignored_still_gives_it_to_what_it_starts():
    this = f"{Path(__file__).relative_to(ROOT)}::test_a_process_the_tests_start_gets_ctrl_c"
    inner = [sys.executable, "-c", IGNORING, sys.executable, "-m", "pytest", this, "-q",
             "-p", "no:cacheprovider"]  # fmt: skip
    done = subprocess.run(inner, capture_output=True, text=True, cwd=ROOT, timeout=hangs.after(60))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
