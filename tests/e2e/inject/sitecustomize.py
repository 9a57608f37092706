"""Faults injected into the trainer of an e2e test, from outside the product code.

A test puts this folder first on PYTHONPATH and sets FTJOB_TEST_INJECT; Python imports this
module at start-up in every process of the run, and only a worker of the named rank patches
``ftjob.trainer.step`` as it is imported:

* ``raise:RANK:CALL:MARKER`` -- the CALL-th train_step of the process raises once (MARKER is a
  file created then, so the worker restarted in place does not raise again);
* ``slow:RANK:SECONDS`` -- every step's data takes SECONDS longer on that rank.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

_SPEC = os.environ.get("FTJOB_TEST_INJECT", "").split(":")


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "ftjob.trainer.step":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _patch(step) -> None:
    kind = _SPEC[0]
    if kind == "raise":
        call, marker = int(_SPEC[2]), _SPEC[3]
        original, calls = step.train_step, [0]

        def train_step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == call and not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError("injected failure (tests/e2e/inject)")
            return original(*args, **kwargs)

        step.train_step = train_step
    elif kind == "slow":
        seconds, fetch = float(_SPEC[2]), step.Prefetch.next

        def slow_next(self, n):
            time.sleep(seconds)
            return fetch(self, n)

        step.Prefetch.next = slow_next


if len(_SPEC) > 2 and os.environ.get("RANK") == _SPEC[1]:
    sys.meta_path.insert(0, _Patch())
