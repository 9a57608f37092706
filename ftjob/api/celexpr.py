"""PURE: CEL expressions evaluated as the API server evaluates a CRD's rules.

One evaluator for every door: :mod:`ftjob.api.admission` (the CRD's rules, as ``kubectl apply``
meets them) and :func:`ftjob.api.schema.check_rules` (the same rules on a parsed spec, for
``ftjob validate``, the operator, ``ftjob run`` and the trainer). A rule holds when it
evaluates to true; false, or an evaluation error, refuses, as in the API server.

Only core CEL (no Kubernetes extensions such as ``quantity()``), which is all our rules use.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any


def _interpreter() -> Any:
    """The ``cel`` package's compiled interpreter, without the package's ``__init__``: that also
    imports its command line (typer, prompt_toolkit, rich), which every ``ftjob`` command and
    trainer process would otherwise load for nothing (bench: ``python -X importtime -c 'import
    cel'``). Registered as ``cel.cel``, so a later ``import cel`` reuses it, as it must: the
    extension refuses to initialise twice."""
    if "cel.cel" in sys.modules:
        return sys.modules["cel.cel"]
    package = importlib.util.find_spec("cel")
    if package is None or package.origin is None:
        raise ImportError("the CEL interpreter is missing: pip install common-expression-language")
    folder = Path(package.origin).parent
    path = next(
        folder / f"cel{suffix}"
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
        if (folder / f"cel{suffix}").exists()
    )
    loader = importlib.machinery.ExtensionFileLoader("cel.cel", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("cel.cel", loader))
    sys.modules["cel.cel"] = module
    loader.exec_module(module)
    return module


_cel = _interpreter()


@lru_cache(maxsize=1024)
def _program(expr: str) -> Any:
    return _cel.compile(expr)


def uses_old(expr: str) -> bool:
    """A transition rule: it reads ``oldSelf``, so it runs only on an update."""
    return "oldSelf" in expr


class Scope:
    """``self`` (and ``oldSelf``) for the rules of one object: its values are converted to CEL
    once, on its first rule, not once per rule (nor for an object without rules)."""

    def __init__(self, value: Any, old: Any = None):
        self._value, self._old = value, old
        self._envs: dict[bool, Any] = {}

    def _env(self, with_old: bool) -> Any:
        if with_old not in self._envs:
            names = {"self": self._value} | ({"oldSelf": self._old} if with_old else {})
            self._envs[with_old] = _cel.Context(variables=names)
        return self._envs[with_old]

    def failure(self, expr: str) -> str | None:
        """None when ``expr`` holds; else why not: "" for false, the error's words for a rule
        that could not be evaluated."""
        try:
            ok = _program(expr).execute(self._env(uses_old(expr)))
        except Exception as e:  # noqa: BLE001 - any evaluation error refuses, as in the API server
            return f"rule evaluation failed: {e}"
        return None if ok is True else ""
