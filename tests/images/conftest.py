"""The image tests: the images come from the session's ``images`` fixture (tests/built_images.py,
shared with tests/cluster's real nodes, so one build serves both)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The API emulator and its helpers (tests/emulator) serve the operator image's test too.
sys.path.insert(0, str(ROOT / "tests" / "emulator"))
