"""Faults injected into the trainer of an e2e test, from outside the product code.

A test puts this folder first on PYTHONPATH and sets FTJOB_TEST_INJECT; Python imports this
module at start-up in every process of the run, and only a worker of the named rank patches
``ftjob.trainer.step`` (or ``ftjob.trainer.gang.preflight``) as it is imported:

* ``raise:RANK:CALL:MARKER`` -- the CALL-th train_step of the process raises once (MARKER is a
  file created then, so the worker restarted in place does not raise again);
* ``hold:RANK:CALL:GATE`` -- the CALL-th train_step of the process waits until the file GATE
  exists or this worker has noted a SIGTERM (its agent passes the pod's on in its own time;
  GATE is made then, so the gang started again does not wait). A test acts on a run that
  cannot pass that step meanwhile;
* ``slow:RANK:SECONDS`` -- every step's data takes SECONDS longer on that rank;
* ``slowsave:RANK:SECONDS:MARKER`` -- the first checkpoint that rank writes takes SECONDS
  longer once its files are written (MARKER is created as the wait starts: a test signals
  the run while that save is being written);
* ``unhealthy:RANK:NODE`` -- that rank runs on a node named NODE (FTJOB_NODE_NAME, as the
  operator sets it) whose GPU fails the preflight's matmul. There is no GPU here, so the GPU
  check's verdict is what is injected: the same TrainerError a failed matmul raises; the
  gang's gather, verdict and records that follow are the trainer's own.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

_SPEC = os.environ.get("FTJOB_TEST_INJECT", "").split(":")
_MODULE = "ftjob.trainer.gang.preflight" if _SPEC[0] == "unhealthy" else "ftjob.trainer.step"


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            (_patch_preflight if name == "ftjob.trainer.gang.preflight" else _patch)(module)

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
    elif kind == "hold":
        call, gate = int(_SPEC[2]), _SPEC[3]
        original, calls = step.train_step, [0]

        def held_step(*args, **kwargs):
            calls[0] += 1
            vote = kwargs.get("vote", args[5] if len(args) > 5 else None)
            while calls[0] == call and not os.path.exists(gate):
                if vote.request.asked:
                    open(gate, "w").close()
                time.sleep(0.05)
            return original(*args, **kwargs)

        step.train_step = held_step
    elif kind == "slow":
        seconds, fetch = float(_SPEC[2]), step.Prefetch.next

        def slow_next(self, n):
            time.sleep(seconds)
            return fetch(self, n)

        step.Prefetch.next = slow_next
    elif kind == "slowsave":
        seconds, marker = float(_SPEC[2]), _SPEC[3]
        checksums = step.checkpoint.Checkpointer._checksums

        def slow_checksums(self, tmp):
            if not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(seconds)
            return checksums(self, tmp)

        step.checkpoint.Checkpointer._checksums = slow_checksums


def _patch_preflight(preflight) -> None:
    from ftjob.api import contract

    def check_gpu(spec, device, node):
        raise contract.TrainerError(
            f"preflight: GPU 0 of node {node} failed a matmul: injected ECC error "
            "(tests/e2e/inject)",
            reason=contract.NODE_UNHEALTHY,
            node=node,
            fix="the node is kept away from the next gang",
        )

    preflight.check_gpu = check_gpu  # unhealthy: the only fault injected here


if len(_SPEC) > 2 and os.environ.get("RANK") == _SPEC[1]:
    if _SPEC[0] == "unhealthy":
        os.environ["FTJOB_NODE_NAME"] = _SPEC[2]
    sys.meta_path.insert(0, _Patch())
