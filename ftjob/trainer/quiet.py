"""Silence torchao's "Failed to load .../_C_mxfp8...so" lines, and nothing else it logs.

torchao tries every compiled extension it ships at import and logs a warning for each that
this machine's torch or GPU cannot load (the MXFP8 and CUTLASS kernels, which ftjob never
uses). Every node log and every adapter load repeated them, and people read them as the
failure. Only those lines are dropped: any other warning or error of torchao still shows.
"""

from __future__ import annotations

import logging
import re

# torchao/__init__.py: logger.warning(f"Failed to load {file}: {e}") for each _C*.so.
_OPTIONAL_KERNEL = re.compile(r"^Failed to load \S*/_C_(?:mxfp8|cutlass)\w*[.\w-]*\.so\b")


class _OptionalKernels(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _OPTIONAL_KERNEL.match(record.getMessage())


_FILTER = _OptionalKernels()


def silence_torchao() -> None:
    """Install the filter on torchao's logger (idempotent); call before torchao is imported."""
    logger = logging.getLogger("torchao")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
