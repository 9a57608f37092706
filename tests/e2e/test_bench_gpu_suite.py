"""The GPU suite's code, run on CPU: bench/gpu.py's ``compare`` with ``SMOKE`` (the tiny
model, 2 CPU processes, fp32) instead of the ~1B model on GPUs.

    python -m pytest tests/e2e/test_bench_gpu_suite.py -q

It checks the plumbing a GPU session relies on (the generated job, ``ftjob run``, the TRL
worker with the same packing and attention as ftjob, reading both sides' numbers into rows),
not speed: no timing is asserted.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder of the repo, not an installed package

from bench import gpu  # noqa: E402
from ftjob.trainer.model import attention  # noqa: E402


def test_gpu_suite_compares_ftjob_and_trl_for_full_and_lora(tmp_path):
    result = gpu.compare(tmp_path, gpu.SMOKE, ["full", "lora"])
    assert [c["method"] for c in result["cases"]] == ["full", "lora"]
    for case in result["cases"]:
        assert case["ftjob"] > 0 and case["trl"] > 0
        assert case["trlWrapper"] == "DistributedDataParallel"  # accelerate on CPU
        # Like with like: TRL packs as ftjob does, through ftjob's packed attention.
        assert case["trlPacking"] == "bfd" and case["trlAttention"] == attention.NAME
        assert 1 < case["attentionLength"] <= gpu.SMOKE.seq  # documents, not whole rows
        assert case["ftjobMfu"] is None and case["trlMfu"] is None  # no peak FLOP/s on CPU
        for losses in (case["ftjobLosses"], case["trlLosses"]):
            assert len(losses) == gpu.SMOKE.steps and all(math.isfinite(x) for x in losses)
    rows = result["rows"]
    assert len(rows) == 4
    assert rows[0]["measurement"].startswith("tokens/s, ") and rows[0]["ratio"] > 0
    assert rows[1]["goal"] == f">= {gpu.MFU_GOAL}" and rows[1]["met"] is False
