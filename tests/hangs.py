"""How long the suite waits before it calls something hung: one rule for every limit.

Every limit in tests/ (a subprocess's timeout, a wait for a process, a server, a phase or a
run, a pytest-timeout mark) guards against a hang; none measures speed. CI shares 2-core
machines with other work (load average 2-4, more beside a second CI run), where a test runs
several times as long as on an idle machine. So a limit is what the wait takes alone times
SLOWER, and never under FLOOR; tests/unit/test_hang_guards.py holds every literal limit in
tests/ to FLOOR, unless its line says why it is not a hang guard. pyproject's pytest-timeout
is the outer guard of a whole test.
"""

import time

SLOWER = 5  # a busy 2-core machine's slowest against an idle one's, with room
FLOOR = 60  # seconds: no wait for a process, a server, a phase or a run is given less


def after(alone: float) -> float:
    """The limit for a wait that takes ``alone`` seconds on an idle machine."""
    return max(FLOOR, SLOWER * alone)


# One `ftjob run` of a tiny job, or a wait within one (its first step, a checkpoint). 150 s
# alone is above the slowest such run, a compiled model's, which failed the old 240 s limit
# only on a loaded machine (it compiled its layers again at every step until the per-document
# attention was kept out of the trace; since then 4 compiled steps took 186 s end to end at
# load average 13, 50 s resumed with the compile cache): 750 s.
RUN = after(150)


def poll(predicate, timeout: float = FLOOR, what: str = "condition", every: float = 0.05):
    """Call ``predicate()`` until it returns something truthy, and return that; past
    ``timeout`` seconds, fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
