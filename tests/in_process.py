"""The trainer in this test's own process, as a gang of one.

``python -m ftjob.trainer`` without torchrun is a world of one over gloo: this runs the same
``train.run`` in pytest's process, so a test can watch the real loop from inside (patch a
function, count what a step does, look at the model it trains). A process group is made
and destroyed by the run itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftjob.api.spec import parse_resource


def train(doc: dict, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Train the FineTuneJob ``doc`` with ``folder`` as its job folder; the export's path."""
    from ftjob.trainer import train as trainer

    monkeypatch.setenv("FTJOB_JOB_DIR", str(folder))
    monkeypatch.setenv("FTJOB_PROGRESS_PORT", "0")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    name, spec = parse_resource(doc)
    return trainer.run(spec, name)
