"""Suite data (issue 11): preparing a large JSONL once vs the ``datasets.map`` baseline.

At 20k and 200k synthetic text records (~1.3 kB each, like the issue's 253 MB file), each in
a fresh process so peak RSS is its own (bench/data_worker.py):
- first prepare (rank 0: read, validate, tokenize, pack bfd, save) vs the baseline
  ``load_dataset("json")`` + batched ``.map(num_proc=CPUs)`` tokenization (no packing);
- restart with the prepared data present (a restarted gang): time until it is mapped;
- a waiting rank's RSS growth: memory-map the data and collate 200 micro-batches.
``--quick`` runs 20k only.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

from bench import common
from bench.report import row

WORKER = str(Path(__file__).with_name("data_worker.py"))
BASELINE = "datasets.map"


def synthetic(path: Path, records: int) -> Path:
    """Seeded English-like text records, ~1.3 kB each."""
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    with path.open("w") as f:
        for _ in range(records):
            n = rng.randint(100, 340)
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=n)) + "."}) + "\n")
    return path


def measure(mode: str, source: Path, root: Path) -> dict:
    wall, out = common._timed([sys.executable, WORKER, mode, str(source), str(root)],
                              f"data worker {mode}", {}, timeout=3600)  # fmt: skip
    return {**common.last_json(out, "data"), "wall": round(wall, 1)}


def case(records: int, work: Path) -> dict:
    source = synthetic(work / f"text-{records}.jsonl", records)
    ours_root, base_root = work / f"prepared-{records}", work / f"hf-cache-{records}"
    for folder in (ours_root, base_root):
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "records": records,
        "fileMiB": round(source.stat().st_size / 2**20, 1),
        "baseline": measure("baseline", source, base_root),
        "prepare": measure("prepare", source, ours_root),
        "restart": measure("restart", source, ours_root),
        "rank": measure("rank", source, ours_root),
    }
    info = json.loads(next(ours_root.glob("data/*/info.json")).read_text())
    result["preparedMiB"] = round(info["train"]["bytes"] / 2**20, 1)
    result["tokens"] = info["train"]["tokens"]
    for folder in (ours_root, base_root):
        shutil.rmtree(folder, ignore_errors=True)
    source.unlink()
    return result


def rows_for(c: dict) -> list[dict]:
    n = f"{c['records'] // 1000}k records ({c['fileMiB']:.0f} MiB, {c['tokens'] / 1e6:.0f}M tokens)"
    ours, base = c["prepare"], c["baseline"]
    rank = c["rank"]
    growth = rank["peakMiB"] - rank["rssBeforeMiB"]
    return [
        row(f"first prepare s, {n}", ours["seconds"], base["seconds"], BASELINE,
            ours["seconds"] / base["seconds"], "<= 1.0x baseline",
            ours["seconds"] <= base["seconds"]),
        row(f"prepare peak RSS MiB (main / workers), {n}",
            [ours["peakMiB"], ours["workersPeakMiB"]], [base["peakMiB"], base["workersPeakMiB"]],
            BASELINE),
        row(f"restart: data ready s, {n}", c["restart"]["seconds"], None, "-", None, "<= 5 s",
            c["restart"]["seconds"] <= 5),
        row(f"waiting rank RSS growth MiB (map + 200 batches), {n}", growth, None, "-", None,
            "<= 300 MiB", growth <= 300),
        row(f"prepared size on the volume MiB, {n}", c["preparedMiB"]),
    ]  # fmt: skip


def run(work: Path, quick: bool) -> dict:
    sizes = [20_000] if quick else [20_000, 200_000]
    work.mkdir(parents=True, exist_ok=True)
    cases = [case(n, work) for n in sizes]
    rows = [r for c in cases for r in rows_for(c)]
    if len(cases) > 1:
        small, big = (c["rank"]["peakMiB"] - c["rank"]["rssBeforeMiB"] for c in cases)
        rows.append(row("waiting rank RSS growth, 200k minus 20k MiB", big - small, None, "-",
                        None, "flat (< 50 MiB)", big - small < 50))  # fmt: skip
    return {"cases": cases, "rows": rows}


def mapped_rank(work: Path, sequences: int = 70_000, seq: int = 2048) -> dict:
    """A waiting rank's RSS growth with a 200k-record-sized prepared folder (70k x 2048 tokens,
    ~1.1 GB) built directly from random ids: what a rank maps does not depend on the tokens,
    and tokenizing 200k records takes half an hour on 2 busy cores."""
    import datasets
    import numpy as np
    import pyarrow as pa
    from transformers import AutoTokenizer

    from bench.data_worker import TOKENIZER, spec_for
    from ftjob.trainer import prepare

    source = work / "mapped.jsonl"
    source.write_text('{"text": "a"}\n')
    spec = spec_for(source)
    folder = work / "mapped" / "data" / prepare.key(spec, AutoTokenizer.from_pretrained(TOKENIZER))
    # One flat array of random ids cut into rows: Arrow builds it without per-row Python.
    values = pa.array(np.random.default_rng(0).integers(3, 1000, sequences * seq, dtype=np.int32))
    offsets = pa.array(np.arange(0, sequences * seq + 1, seq, dtype=np.int32))
    ids = pa.ListArray.from_arrays(offsets, values)
    halves = pa.array(np.tile(np.array([seq // 2, seq - seq // 2], dtype=np.int32), sequences))
    lengths = pa.ListArray.from_arrays(
        pa.array(np.arange(0, 2 * sequences + 1, 2, dtype=np.int32)), halves
    )
    table = datasets.Dataset(pa.table({"input_ids": ids, "labels": ids, "seq_lengths": lengths}))
    table.save_to_disk(str(folder / "train"))
    (folder / "info.json").write_text("{}")
    result = measure("rank", source, work / "mapped")
    shutil.rmtree(work / "mapped", ignore_errors=True)
    return {
        **result,
        "sequences": sequences,
        "growthMiB": result["peakMiB"] - result["rssBeforeMiB"],
    }
