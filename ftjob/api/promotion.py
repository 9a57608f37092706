"""PURE: ``output.promoteWhen``, a condition on the final evaluation's metrics that the push
(output.push) waits for: ``evalLoss < 1.8``, ``evalRewardAccuracy >= 0.7 and evalLoss < 0.6``.

A condition names metrics the job's objective evaluates (evalLoss for every objective, and
``eval`` + each of the objective's declared metrics: :mod:`ftjob.api.objectives`), compared
with <, <=, > or >= to a number; several are joined by ``and``. The CRD checks the words
against the objective (:func:`cel_rule`), so a misspelt or foreign metric is refused at the
door; the trainer decides with the final evaluation's numbers (:func:`decide`).

    python -c "from ftjob.api import promotion as p; print(p.decide('evalLoss < 1.8', {}))"
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from ftjob.api.objectives import OBJECTIVES

OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
# No backslashes, so the same text is a Python, an OpenAPI and a CEL regex as it is.
NUMBER = "-?[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?"
CLAUSE = re.compile(rf"^ *([A-Za-z]+) *(<=|>=|<|>) *({NUMBER}) *$")


@dataclass(frozen=True)
class Clause:
    metric: str
    op: str
    value: float

    def words(self, found: float | None) -> str:
        shown = "absent" if found is None else f"{found:.4g}"
        return f"{self.metric} {shown} {self.op} {self.value:g}"


def eval_metrics(objective: str) -> list[str]:
    """The metrics a job of ``objective`` evaluates, as progress names them."""
    return ["evalLoss", *(m.eval_key for m in OBJECTIVES[objective].metrics)]


def pattern(objective: str) -> str:
    """The regex a condition for ``objective`` matches (the CRD's check of its words)."""
    names = "|".join(eval_metrics(objective))
    one = f" *({names}) *(<=|>=|<|>) *{NUMBER} *"
    return f"^{one}( and {one})*$"


def cel_rule(field: str = "self.output.promoteWhen") -> str:
    """CEL: the condition matches its objective's pattern."""
    tests = [f"self.training.objective == '{o}' ? {field}.matches('{pattern(o)}')"
             for o in OBJECTIVES]  # fmt: skip
    return f"!has({field}) || ({' : '.join(tests)} : false)"


def parse(text: str) -> list[Clause]:
    out = []
    for part in text.split(" and "):
        m = CLAUSE.match(part)
        if m is None:
            raise ValueError(f"{part.strip()!r} is not METRIC OP NUMBER (e.g. evalLoss < 1.8)")
        out.append(Clause(m.group(1), m.group(2), float(m.group(3))))
    return out


def decide(text: str, final: dict) -> tuple[bool, str]:
    """Whether ``text`` holds of the final evaluation's numbers (``final``: progress keys ->
    values), and the words that say so with the numbers: "evalLoss 1.62 < 1.8"."""
    clauses = parse(text)
    held = [c for c in clauses if final.get(c.metric) is not None
            and OPS[c.op](final[c.metric], c.value)]  # fmt: skip
    words = "; ".join(
        c.words(final.get(c.metric)) + ("" if c in held else " does not hold") for c in clauses
    )
    return len(held) == len(clauses), words
