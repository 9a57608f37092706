"""What a job's own settings need installed beyond the trainer extra, read from this machine
(find_spec: nothing is imported): QLoRA's 4-bit storage, ftjob's ``qlora`` extra.

``ftjob run`` refuses such a job before any process starts (ftjob.cli.run), and a trainer
started otherwise (torchrun, a pod) before it reads a weight (ftjob.trainer.model.load): one
check, one message, both places.
"""

from __future__ import annotations

import importlib.util

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import FieldError

# The qlora extra's modules (pyproject.toml; ftjob.cli.extras.MODULES names them from here).
# Its own extra: transformers imports torchao whenever it is installed, and torchao's import
# prints warnings in every script of a user that loads a model (an export too).
QLORA = ("torchao",)


def missing(spec: FineTuneJobSpec) -> list[FieldError]:
    """The extras the job's settings need that this Python cannot import, with the install
    command (the trackers' clients: ftjob.trainer.report.trackers.not_installed)."""
    if spec.method.type != "qlora":
        return []
    absent = [m for m in QLORA if importlib.util.find_spec(m) is None]
    if not absent:
        return []
    return [
        FieldError(
            "spec.method.type",
            f"qlora needs ftjob's qlora extra ({', '.join(absent)} not installed), the 4-bit "
            "storage of the base model",
            fix="pip install 'ftjob[qlora]' (or use method.type lora)",
        )
    ]
