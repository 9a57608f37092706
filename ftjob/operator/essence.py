"""kopf's diff base, for an operator whose handlers read no diff.

For every watch event kopf builds the object's "essence" (a deep copy of the whole body, less
metadata and status) and diffs it with the one stored at the last change handler, before it
looks at which handlers there are. Only change handlers (``on.create``/``on.update``) and
daemons read that diff. This operator has neither: its handlers are events and indexes, and
its own work queue decides (handlers.py). So the essence is built empty and none is stored.
At 1,000 jobs the deep copies of pods were a sixth of the operator's CPU in the burst
(py-spy, bench/RESULTS.md, fleet). A change handler added later needs kopf's storage back:
:func:`readers` names it, and the operator refuses to start.
"""

from __future__ import annotations

from typing import Any

import kopf


class Unused(kopf.DiffBaseStorage):
    """Builds, fetches and stores nothing."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def readers(registry: kopf.OperatorRegistry) -> list[str]:
    """The registered handlers that would read the diff this storage never keeps (change
    handlers, daemons and timers; kopf's own registries, as pinned in constraints.txt)."""
    found = [*registry._changing.get_all_handlers(), *registry._spawning.get_all_handlers()]
    return [str(h.id) for h in found]
