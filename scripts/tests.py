"""The whole suite as two pytest sessions side by side: ``python scripts/tests.py [option...]``.

One pytest process keeps this machine's two cores about half busy: a test on the control
plane mostly waits for it, a trainer test mostly computes (CI of b65faeb, one process: 1.02
cores busy on average over 2,429 s). So the suite runs in two lanes at once, each a whole
pytest session with its own fixtures, builds (tests/prebuilds.py), slow tier and deadline
(tests/deadline.py):

- ``planes``: the control planes and the real nodes (tests/cluster), their images
  (tests/images), the emulator, and the trainer modules that share no session fixture with
  the rest (PLANES);
- ``trainer``: every other path under tests/. It is "tests/ without PLANES", so a new test
  file runs in one lane or the other by construction, never in none and never in both.

A lane's lines are printed as they come, after its name. Each lane writes a JUnit XML
under test-results/, and the slowest tests and the time by folder are printed from both at
the end (scripts/ci_report.py). The exit status is the worse lane's. Options (``-x``,
``-k EXPR``, ``-m slow``) go to both lanes. ``python -m pytest`` still runs everything in one
process, as before.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "test-results"
# Balanced by CI's per-test figures (docs/testing.md): ~1,200 s of one process's time each.
# The e2e modules here use no session fixture of tests/e2e/conftest.py (those stay together
# in the other lane, where each is made once).
PLANES = (
    "tests/cluster",
    "tests/images",
    "tests/emulator",
    "tests/e2e/test_fp8.py",
    "tests/e2e/test_s3.py",
    "tests/e2e/test_hub_push.py",
    "tests/e2e/test_speed_settings.py",
)
NO_TESTS = 5  # pytest's exit status when a lane's options select nothing


def lanes(options: list[str]) -> dict[str, list[str]]:
    """Each lane's pytest arguments."""
    pytest = [sys.executable, "-m", "pytest"]
    return {
        name: pytest + paths + [f"--junitxml={RESULTS / name}.xml", *options]
        for name, paths in (
            ("planes", list(PLANES)),
            ("trainer", ["tests", *(f"--ignore={path}" for path in PLANES)]),
        )
    }


def _relay(name: str, proc: subprocess.Popen, ended: dict[str, float]) -> None:
    """The lane's lines as they come, after its name; when it ended."""
    for line in proc.stdout:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()
    proc.wait()
    ended[name] = time.monotonic()


def status(codes: dict[str, int]) -> int:
    """The worse lane's exit status; a lane that selected nothing is no failure while the
    other ran tests."""
    ran = [code for code in codes.values() if code != NO_TESTS]
    return max(ran) if ran else NO_TESTS


def main(options: list[str]) -> int:
    RESULTS.mkdir(exist_ok=True)
    argvs = lanes(options)
    for name in argvs:  # a lane that ends before writing its XML must not report the last run's
        (RESULTS / f"{name}.xml").unlink(missing_ok=True)
    started = time.monotonic()
    procs = {
        name: subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )  # fmt: skip
        for name, argv in argvs.items()
    }
    ended: dict[str, float] = {}
    relays = [threading.Thread(target=_relay, args=(*item, ended)) for item in procs.items()]
    for relay in relays:
        relay.start()
    while any(relay.is_alive() for relay in relays):
        try:
            for relay in relays:
                relay.join()
        except KeyboardInterrupt:  # Ctrl-C reached the lanes too (one process group)
            continue  # they end with their summaries: wait for them
    reports = [str(RESULTS / f"{name}.xml") for name in procs]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "ci_report.py"),
                    *(r for r in reports if Path(r).exists())])  # fmt: skip
    for name, proc in procs.items():
        print(f"lane {name}: exit {proc.returncode}, {ended[name] - started:.0f} s")
    return status({name: proc.returncode for name, proc in procs.items()})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
