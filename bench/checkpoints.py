"""Suite b: checkpoints of a 2-process FSDP2 gang (bench/ckpt_worker.py): ftjob's sharded DCP
save vs gather-to-rank-0 + safetensors, async stall (and what the background save costs the
steps it overlaps) vs synchronous save, resume time."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench import common
from bench.report import row


def run(work: Path, quick: bool) -> dict:
    size = "medium" if quick else "large"
    model = common.model_dir(size, work)
    out = work / "ckpt"
    shutil.rmtree(out, ignore_errors=True)
    args = ["--model", str(model), "--out", str(out), "--repeats", "1" if quick else "2"]
    wall, stdout = common.torchrun("bench.ckpt_worker", args, 2, work)
    shutil.rmtree(out, ignore_errors=True)
    r = common.last_json(stdout, "CKPT")
    label = f"{size} ({common.param_count(model) / 1e6:.0f}M, {r['bytes'] / 2**20:.0f} MiB/ckpt)"
    shard_ratio = r["sharded"] / r["full"]
    stall_ratio = r["asyncStall"] / r["sharded"]
    steps = r["stepsAfter"]
    rows = [
        row(
            f"save s, sharded DCP vs rank-0 safetensors, {label}",
            r["sharded"],
            r["full"],
            "gather + save_file",
            shard_ratio,
            "<= 0.25x",
            shard_ratio <= 0.25,
        ),
        row(
            f"sync sharded save s vs its floor here (each rank torch.save + fsync of the same "
            f"tensors, no DCP), {label}",
            r["sharded"],
            r["rawWrite"],
            "raw write per rank",
            r["sharded"] / r["rawWrite"],
        ),
        row(
            f"async save stall s (save() + waits before the next {steps} optimizer updates) "
            f"vs sync sharded save, {label}",
            r["asyncStall"],
            r["sharded"],
            "sync DCP save",
            stall_ratio,
            "<= 0.05x",
            stall_ratio <= 0.05,
        ),
        row(
            f"async save: extra s over {steps} training steps while it copies and writes "
            f"(stall + CPU shared with the writer; steps alone {r['stepsAlone']:.2f} s), {label}",
            r["asyncOverlapCost"],
            r["sharded"],
            "sync DCP save",
            r["asyncOverlapCost"] / r["sharded"],
        ),
        row(f"async save start to commit s, with the {steps} steps, {label}", r["asyncTotal"]),
        row(f"resume (load) s, sharded, {label}", r["resume"]),
        row(
            f"checksums of one rank's files at commit s (in the sync save above), {label}",
            r["checksums"],
            r["sharded"],
            "sync DCP save",
            r["checksums"] / r["sharded"],
        ),
        row(
            f"verify before resume s (every rank its share, then agree), {label}",
            r["verify"],
            r["resume"],
            "resume (load)",
            r["verify"] / r["resume"],
        ),
    ]
    return {"model": size, "wall": wall, "timings": r, "rows": rows}
