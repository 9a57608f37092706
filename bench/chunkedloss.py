"""Suite chunkedloss (issue 50 item 4): a DPO step's peak memory with the head's log-probabilities
computed chunk by chunk (this tree) against whole logits (the trainer of commit BASELINE, the
last before the change, unpacked with ``git archive`` and run by the same ``ftjob run``).

The job: the 190M shape with a 32k vocabulary (Llama 2's size; the tiny tokenizer's ids use the
first 1,024 rows), DPO with LoRA, one pair of 2,048-token sequences a rank, 2 processes, fp32,
every layer recomputed, so that the head's logits are the largest thing a step holds: whole,
they are 2 x 2,048 x 32,000 fp32 (500 MiB) a forward, plus the log-softmax autograd keeps.
Measured: rank 1's trainPeakRssMiB, with glibc's mmap threshold pinned (bench/planner.py), and
``ftjob plan``'s estimate for the chunked job. One step: its loss is log 2 on both sides (the
policy is the reference), so the losses say nothing here; tests/unit/test_loss.py holds the
chunked loss and gradients equal to the whole-logits ones to 1e-6.
"""

from __future__ import annotations

import tarfile
from io import BytesIO
from pathlib import Path
from subprocess import run as sh

from bench import common, dpo
from bench.planner import MIB, PINNED, estimate_of
from bench.report import row

BASELINE = "92eec7b"  # DPO's log-probabilities from whole logits (before issue 50 item 4)
FULL = dpo.Setup("190m-32k", seq=2048, steps=1, skip=0, pairs=8)
QUICK = dpo.Setup("tiny", seq=256, steps=1, skip=0, pairs=8)


def baseline_tree(work: Path) -> Path:
    """The ftjob package of commit BASELINE, unpacked once into ``work``."""
    out = work / f"baseline-{BASELINE}"
    if not (out / "ftjob").is_dir():
        archive = sh(["git", "archive", BASELINE, "ftjob"], cwd=common.ROOT,
                     capture_output=True, check=True).stdout  # fmt: skip
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(out, filter="data")
    return out


def job(name: str, work: Path, s: dpo.Setup) -> dict:
    from transformers import AutoTokenizer

    model = common.model_dir(s.size, work)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = dpo.synthetic(work / "chunkedloss" / f"pairs-{s.seq}.jsonl", tokenizer, s.seq, s.pairs)
    doc = dpo.job(name, model, data, s)
    doc["spec"]["training"]["activationCheckpointing"] = "all"
    return doc


def measure(work: Path, s: dpo.Setup) -> dict:
    env = {**PINNED, "OMP_NUM_THREADS": "1"}
    chunked = job("chunkedloss-now", work, s)
    whole = job("chunkedloss-before", work, s)
    now = common.ftjob_run(chunked, work, env=env)
    before = common.ftjob_run(whole, work, env=env, tree=baseline_tree(work))
    return {
        "setup": s.__dict__,
        "params": common.param_count(common.model_dir(s.size, work)),
        "planMiB": estimate_of(chunked).per_device / MIB,
        "chunked": {"peakMiB": now.progress["trainPeakRssMiB"], "losses": now.losses()},
        "whole": {"peakMiB": before.progress["trainPeakRssMiB"], "losses": before.losses()},
    }


def run(work: Path, quick: bool) -> dict:
    c = measure(work, QUICK if quick else FULL)
    s = c["setup"]
    what = (f"{s['size']} ({c['params'] / 1e6:.0f}M) DPO LoRA, 2 procs, 1 pair of "
            f"{s['seq']} tokens a rank, every layer recomputed")  # fmt: skip
    now, before = c["chunked"]["peakMiB"][1], c["whole"]["peakMiB"][1]
    return {"cases": [c], "rows": [
        row(f"rank-1 train peak RSS MiB, chunked vs whole logits, {what}", now, before,
            f"whole logits (commit {BASELINE})", now / before),
        row(f"plan vs rank-1 train peak RSS MiB (chunked), {what}", c["planMiB"], now,
            "measured (pinned)", c["planMiB"] / now, "0.7-1.3x", 0.7 <= c["planMiB"] / now <= 1.3),
    ]}  # fmt: skip
