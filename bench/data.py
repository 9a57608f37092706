"""Suite data (issue 11): preparing a large JSONL once vs the ``datasets.map`` baseline.

At 20k and 200k synthetic text records (~1.4 kB each, like the issue's 253 MB file), each in
a fresh process so peak RSS is its own (bench/data_worker.py):
- first prepare (rank 0: read, validate, tokenize, pack bfd, write) vs the baseline
  ``load_dataset("json")`` + batched ``.map(num_proc=CPUs)`` tokenization (no packing), run
  alternately, three times each at 20k (the median is reported), once at 200k;
- restart with the prepared data present (a restarted gang): time until it is mapped;
- a waiting rank's RSS growth: memory-map the data and collate 200 micro-batches.
``--quick`` runs 20k only. ``python -m bench.data --huge 2.5`` prepares a 2.5 GB file alone.
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


def synthetic(path: Path, records: int | None = None, size: int | None = None) -> Path:
    """Seeded English-like text records, ~1.4 kB each: ``records`` of them, or ``size`` bytes."""
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    written = count = 0
    with path.open("w") as f:
        while count != records and (size is None or written < size):
            n = rng.randint(100, 340)
            written += f.write(json.dumps({"text": " ".join(rng.choices(words, k=n)) + "."}) + "\n")
            count += 1
    return path


def measure(mode: str, source: Path, root: Path) -> dict:
    wall, out = common._timed([sys.executable, WORKER, mode, str(source), str(root)],
                              f"data worker {mode}", {}, timeout=3600)  # fmt: skip
    return {**common.last_json(out, "data"), "wall": round(wall, 1)}


def case(records: int, work: Path, repeats: int = 1) -> dict:
    source = synthetic(work / f"text-{records}.jsonl", records)
    ours_root, base_root = work / f"prepared-{records}", work / f"hf-cache-{records}"
    for folder in (ours_root, base_root):
        shutil.rmtree(folder, ignore_errors=True)
    runs: dict[str, list] = {"baseline": [], "prepare": []}
    for _ in range(repeats):  # alternately, so that a noisy neighbour hits both alike
        for mode, folder in (("baseline", base_root), ("prepare", ours_root)):
            shutil.rmtree(folder, ignore_errors=True)
            runs[mode].append(measure(mode, source, folder))
    result = {
        "records": records,
        "fileMiB": round(source.stat().st_size / 2**20, 1),
        **{mode: _median(got) for mode, got in runs.items()},
        "runs": runs,
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


def _median(runs: list[dict]) -> dict:
    """The run with the median time (its memory with it)."""
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def rows_for(c: dict) -> list[dict]:
    n = f"{c['records'] // 1000}k records ({c['fileMiB']:.0f} MiB, {c['tokens'] / 1e6:.0f}M tokens)"
    ours, base = c["prepare"], c["baseline"]
    rank = c["rank"]
    growth = rank["peakMiB"] - rank["rssBeforeMiB"]
    return [
        row(f"first prepare s, {n}", ours["seconds"], base["seconds"], BASELINE,
            ours["seconds"] / base["seconds"], "<= 1.0x baseline",
            ours["seconds"] <= base["seconds"]),
        row(f"prepare peak RSS MiB (main / largest worker), {n}",
            [ours["peakMiB"], ours["workersPeakMiB"]], [base["peakMiB"], base["workersPeakMiB"]],
            BASELINE),
        row(f"prepare peak PSS MiB, all processes at once (all / private), {n}",
            [ours["treePssPeakMiB"], ours["treePrivatePeakMiB"]],
            [base["treePssPeakMiB"], base["treePrivatePeakMiB"]], BASELINE),
        row(f"restart: data ready s, {n}", c["restart"]["seconds"], None, "-", None, "<= 5 s",
            c["restart"]["seconds"] <= 5),
        row(f"waiting rank RSS growth MiB (map + 200 batches), {n}", growth, None, "-", None,
            "<= 300 MiB", growth <= 300),
        row(f"waiting rank RSS growth MiB (private / mapped file pages), {n}",
            [rank["anonGrowthMiB"], rank["fileGrowthMiB"]]),
        row(f"waiting rank ms per micro-batch of 4 (read rows + collate), {n}", rank["batchMs"]),
        row(f"prepared size on the volume MiB, {n}", c["preparedMiB"]),
    ]  # fmt: skip


def run(work: Path, quick: bool) -> dict:
    sizes = [20_000] if quick else [20_000, 200_000]
    work.mkdir(parents=True, exist_ok=True)
    cases = [case(n, work, repeats=3 if n == 20_000 else 1) for n in sizes]
    rows = [r for c in cases for r in rows_for(c)]
    if len(cases) > 1:
        small, big = (c["rank"]["peakMiB"] - c["rank"]["rssBeforeMiB"] for c in cases)
        rows.append(row("waiting rank RSS growth, 200k minus 20k MiB", big - small, None, "-",
                        None, "flat (< 50 MiB)", big - small < 50))  # fmt: skip
    return {"cases": cases, "rows": rows}


def huge(work: Path, gigabytes: float = 2.5) -> dict:
    """The issue's "a 2.5 GB JSONL prepares on a 24 GB machine": rank 0's first prepare only
    (no baseline: it would take as long again), with the peak PSS of the whole process tree.

        python -m bench.data --huge 2.5 [--workdir DIR]
    """
    work.mkdir(parents=True, exist_ok=True)
    source = synthetic(work / "huge.jsonl", size=int(gigabytes * 1e9))
    root = work / "prepared-huge"
    shutil.rmtree(root, ignore_errors=True)
    result = {"fileBytes": source.stat().st_size, "prepare": measure("prepare", source, root)}
    info = json.loads(next(root.glob("data/*/info.json")).read_text())["train"]
    result.update(records=info["records"], tokens=info["tokens"], sequences=info["sequences"],
                  preparedBytes=info["bytes"], memTotalMiB=_mem_total_mib())  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)
    source.unlink()
    return result


def _mem_total_mib() -> float:
    with open("/proc/meminfo") as f:
        return round(int(f.readline().split()[1]) / 1024, 1)


if __name__ == "__main__":
    import argparse
    import tempfile

    p = argparse.ArgumentParser(prog="python -m bench.data")
    p.add_argument("--huge", type=float, metavar="GB", required=True)
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    print(json.dumps(huge(a.workdir or Path(tempfile.mkdtemp(prefix="ftjob-huge-")), a.huge)))
