"""What training.compile cost this process: its first step, and how much of the compile
came from the cache on the job's volume.

The launcher points ``TORCHINDUCTOR_CACHE_DIR`` at ``<job folder>/compile-cache``
(:mod:`ftjob.job.launch`), where inductor's FX graph cache and AOT autograd's cache (both on
by default in torch) keep every compiled graph and its kernels. A restart in place, a new gang
or a resumed run traces the layers again (dynamo's part, seconds) but loads the compiled graphs
instead of generating and building their code. The first step's line says which happened:

    compiled layers: first step <S> s; <H> of <N> graphs from the compile cache in <folder>

    python -c "from ftjob.trainer.model import compile_cache; help(compile_cache)"
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheUse:
    """This process's compiled graphs so far: loaded from the cache, compiled, not cacheable."""

    hits: int
    misses: int
    bypassed: int

    def note(self, first_step_seconds: float, folder: str) -> str:
        """The line the trainer logs after its first compiled step."""
        total = self.hits + self.misses + self.bypassed
        said = f"compiled layers: first step {first_step_seconds:.1f} s; "
        if not total:
            return said + "no graph compiled"
        said += f"{self.hits} of {total} graphs from the compile cache in {folder}"
        if self.misses:
            said += f" ({self.misses} compiled now and saved there for a restart)"
        if self.bypassed:
            said += f" ({self.bypassed} not cacheable)"
        return said


def used() -> CacheUse:
    """Inductor's FX graph cache counters for this process (forward and backward graphs)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return CacheUse(
        inductor["fxgraph_cache_hit"],
        inductor["fxgraph_cache_miss"],
        inductor["fxgraph_cache_bypass"],
    )


def folder() -> str:
    """Where this process's compile cache is (the launcher's setting, else torch's default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir()
