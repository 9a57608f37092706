"""Suite loading (issue 24): each rank's memory and the gang's wall time while loading, every
rank reading its own rows of the mapped files (this tree) against rank 0 reading them all and
broadcasting each tensor (the trainer of commit BASELINE, unpacked with ``git archive``), the
same worker (bench/load_worker.py) and the same files, in the same run.

Checkpoints as users have them: Llama shapes of ~0.2B and ~1B parameters built from a config
with random weights, saved in bf16 as several safetensors files with an index. Jobs: full
(fp32 masters), LoRA and QLoRA (bf16 base; NF4 for QLoRA), 2 CPU processes, one thread each.

glibc's mmap threshold is pinned (bench/planner.py's PINNED), as in the other memory suites:
by default glibc raises it after large blocks are freed and then keeps freed memory, and the
growth measures that retention (measured at 0.2B QLoRA, default settings: 367-566 MiB on both
paths, against 141-153 MiB pinned).

Memory is sampled from outside every SAMPLE_SECONDS from /proc/<pid>/status (RssAnon: the
process's own memory; RssFile: the mapped files' pages it has touched, shared page cache,
reclaimable), between the moment both ranks start loading and the moment each is done. The
goal: each rank's anonymous growth <= what it keeps (its shards) + 2 x the largest tensor +
300 MB. Cold runs start with the checkpoint's files evicted from the page cache
(``posix_fadvise(DONTNEED)`` after a sync: only these files, not the machine's whole cache,
which other work shares; ``fincore`` confirms); warm runs follow at once.

What one machine cannot show: on a parallel file system each reader has its own share of the
aggregate bandwidth, so N ranks reading 1/N each can finish N times sooner than one reader;
here both ranks share one local disk and two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from io import BytesIO
from pathlib import Path

from bench import common
from bench.planner import PINNED
from bench.report import row
from ftjob.job import modelfiles

BASELINE = "35c7540"  # the trainer before issue 24: rank 0 reads, then broadcasts each tensor
SIZES = {"0.2B": "190m", "1B": "1b"}
METHODS = ("full", "lora", "qlora")
SAMPLE_SECONDS = 0.01
SHARD_SIZE = "300MB"  # several files per model, as published checkpoints have (5 GB each)
MIB = 2**20
SLACK = 300 * 10**6  # the goal's fixed allowance: Python objects, allocator, one file's header
RANK0 = "rank 0 reads + broadcasts"


def checkpoint(size: str, work: Path) -> Path:
    """A bf16 Llama of SIZES[size] in several safetensors files with an index, built once."""
    out = work / "checkpoints" / size
    if (out / "model.safetensors.index.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = common.llama_config(SIZES[size], tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=SHARD_SIZE)
    AutoTokenizer.from_pretrained(common.TINY_MODEL).save_pretrained(tmp)
    del model
    tmp.rename(out)
    return out


def baseline_tree(work: Path) -> Path:
    """The ftjob package of commit BASELINE, unpacked once into ``work``."""
    out = work / f"baseline-{BASELINE}"
    if not (out / "ftjob").is_dir():
        archive = subprocess.run(["git", "archive", BASELINE, "ftjob"], cwd=common.ROOT,
                                 capture_output=True, check=True).stdout  # fmt: skip
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(out, filter="data")
    return out


def spec(model: Path, method: str) -> dict:
    """The job's spec: 2 processes on one node, bf16 compute (a GPU job's dtypes)."""
    doc = common.job(f"load-{method}", model, steps=1, seq=64, micro_batch=1, method=method,
                     nodes=1)["spec"]  # fmt: skip
    doc["resources"]["processesPerNode"] = 2
    doc["training"]["precision"] = "bf16"
    return doc


def evict(folder: Path) -> int:
    """Drop ``folder``'s weight files from the page cache; the bytes still cached after."""
    files = modelfiles.weight_files(folder)
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not shutil.which("fincore"):
        return -1
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES",
                          *map(str, files)], capture_output=True, text=True).stdout  # fmt: skip
    return sum(int(x) for x in out.split())


def _sample(out: Path, samples: dict[int, list], stop: threading.Event) -> None:
    """(time, RssAnon, RssFile) of each rank every SAMPLE_SECONDS, from /proc."""
    pids: dict[int, int] = {}
    while not stop.is_set():
        for rank in (0, 1):
            if rank not in pids and (out / f"rank{rank}.pid").exists():
                pids[rank] = int((out / f"rank{rank}.pid").read_text())  # written whole
            if rank in pids:
                try:
                    m = common.proc_mib(pids[rank], ("RssAnon", "RssFile"))
                except (OSError, ValueError):
                    continue
                samples[rank].append((time.time(), m.get("RssAnon", 0.0) * MIB,
                                      m.get("RssFile", 0.0) * MIB))  # fmt: skip
        time.sleep(SAMPLE_SECONDS)


def load_run(tree: Path, doc: dict, out: Path) -> dict:
    """One 2-rank load under ``tree``'s ftjob; per rank: growth and peaks, and the wall time."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps(doc))
    worker = str(common.ROOT / "bench" / "load_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           worker, str(out / "spec.json"), str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "TMPDIR": str(out),
           **PINNED}  # fmt: skip
    samples: dict[int, list] = {0: [], 1: []}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(out, samples, stop), daemon=True)
    sampler.start()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=common.ROOT,
                              timeout=900)  # fmt: skip
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"load worker failed:\n{(out / 'log.txt').read_text()[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        window = [s for s in samples[r["rank"]] if r["started"] <= s[0] <= r["finished"]]
        r["samples"] = len(window)
        r["anonGrowth"] = max(s[1] for s in window) - r["before"]["RssAnon"]
        r["peakFile"] = max(s[2] for s in window)
        r["bound"] = r["held"] + 2 * r["largest"] + SLACK
    started, finished = min(r["started"] for r in ranks), max(r["finished"] for r in ranks)
    return {"wall": finished - started, "ranks": ranks}


def measure(size: str, method: str, work: Path) -> dict:
    """Both loading paths on the same checkpoint, alternating (parallel cold, rank 0 cold,
    parallel warm, rank 0 warm) so that the machine's other work weighs on both alike."""
    folder = checkpoint(size, work)
    doc = spec(folder, method)
    # The spec as recorded: sources named without this machine's paths.
    data = str(common.CHAT_DATA.relative_to(common.ROOT))
    shown = {**doc, "model": {"source": f"checkpoints/{size}"},
             "dataset": {**doc["dataset"], "source": data}}  # fmt: skip
    case: dict = {"size": size, "method": method, "spec": shown}
    trees = {"parallel": common.ROOT, "rank0": baseline_tree(work)}
    for cache in ("cold", "warm"):
        for path, tree in trees.items():
            cached = evict(folder) if cache == "cold" else None
            run = load_run(tree, doc, work / "load" / f"{size}-{method}-{path}-{cache}")
            case.setdefault(path, {})[cache] = {**run, "cachedBefore": cached}
    case["params"] = case["parallel"]["cold"]["ranks"][0]["params"]
    case["fileBytes"] = sum(f.stat().st_size for f in modelfiles.weight_files(folder))
    return case


def _growth(run: dict, rank: int) -> float:
    """A rank's anonymous growth, the larger of its cold and warm runs."""
    return max(run[k]["ranks"][rank]["anonGrowth"] for k in ("cold", "warm"))


def config(size: str) -> dict:
    """SIZES[size]'s config.json as ``checkpoint`` writes it (no weights needed)."""
    return common.llama_config(SIZES[size], tie_word_embeddings=False, dtype="bfloat16").to_dict()


def plan_row(c: dict, label: str) -> dict:
    """`ftjob plan`'s loading per process against the measured one: the process before loading
    (the plan's baseline) plus its anonymous growth (the weight files' pages are page cache)."""
    from ftjob.api.jobspec import parse_spec
    from ftjob.plan.layout import estimate
    from ftjob.plan.modelshape import ModelShape

    shape = ModelShape.from_config(config(c["size"]))
    planned = estimate(parse_spec(c["spec"]), shape).load_cpu_per_node / 2 / MIB
    measured = max(
        (r["before"]["RssAnon"] + r["before"]["RssFile"] + _growth(c["parallel"], r["rank"])) / MIB
        for r in c["parallel"]["cold"]["ranks"]
    )
    ratio = planned / measured
    return row(f"plan's loading per process vs the larger rank's (RSS before + anonymous "
               f"growth) MiB, {label}", planned, measured, "measured", ratio, "0.8-1.2x",
               0.8 <= ratio <= 1.2)  # fmt: skip


def rows_for(c: dict) -> list[dict]:
    files = c["fileBytes"] / 2**30
    label = f"{c['size']} {c['method']} ({c['params'] / 1e9:.2f}B, {files:.2f} GiB bf16)"
    ours, theirs = c["parallel"], c["rank0"]
    rows = []
    for rank in (0, 1):
        r = ours["cold"]["ranks"][rank]
        bound = r["bound"] / MIB
        grew, base = _growth(ours, rank) / MIB, _growth(theirs, rank) / MIB
        what = (
            f"rank-{rank} anonymous growth while loading MiB (shard {r['held'] / MIB:,.0f} "
            f"+ 2 x largest {r['largest'] / MIB:,.0f} + 300 MB = {bound:,.0f}), {label}"
        )
        rows.append(row(what, grew, base, RANK0, grew / base if base else None,
                        f"<= {bound:,.0f}", grew <= bound))  # fmt: skip
    for rank in (0, 1):
        peak = max(ours[k]["ranks"][rank]["peakFile"] for k in ("cold", "warm")) / MIB
        base = max(theirs[k]["ranks"][rank]["peakFile"] for k in ("cold", "warm")) / MIB
        rows.append(row(f"rank-{rank} peak file-backed MiB while loading, {label}", peak, base,
                        RANK0, peak / base if base else None))  # fmt: skip
    for k in ("cold", "warm"):
        rows.append(row(f"load wall s, {k} cache, {label}", ours[k]["wall"], theirs[k]["wall"],
                        RANK0, ours[k]["wall"] / theirs[k]["wall"], "<= 1.0x",
                        ours[k]["wall"] <= theirs[k]["wall"]))  # fmt: skip
    return [*rows, plan_row(c, label)]


def _beyond(c: dict, rank: int) -> float:
    """A rank's growth beyond the shards it keeps."""
    return _growth(c["parallel"], rank) - c["parallel"]["cold"]["ranks"][rank]["held"]


def flat_rows(small: dict, big: dict) -> list[dict]:
    """Growth beyond the shards, the bigger model's minus the smaller's: what loading holds
    besides the shards must not grow with the model beyond the largest tensor's growth."""
    rows = []
    for rank in (0, 1):
        extra = (_beyond(big, rank) - _beyond(small, rank)) / MIB
        largest = [c["parallel"]["cold"]["ranks"][rank]["largest"] for c in (small, big)]
        allowed = 2 * (largest[1] - largest[0]) / MIB
        base = [_growth(c["rank0"], rank) - c["rank0"]["cold"]["ranks"][rank]["held"]
                for c in (small, big)]  # fmt: skip
        rows.append(row(f"rank-{rank} growth beyond its shards, {big['size']} minus "
                        f"{small['size']} MiB, {big['method']}", extra, (base[1] - base[0]) / MIB,
                        RANK0, None, f"<= {allowed:,.0f} (2 x largest's growth)",
                        extra <= allowed))  # fmt: skip
    return rows


def run(work: Path, quick: bool) -> dict:
    sizes = ["0.2B"] if quick else list(SIZES)
    cases = [measure(size, method, work) for size in sizes for method in METHODS]
    return {"cases": cases, "rows": all_rows(cases), "sampleSeconds": SAMPLE_SECONDS,
            "baselineCommit": BASELINE}  # fmt: skip


def all_rows(cases: list[dict]) -> list[dict]:
    rows = [r for c in cases for r in rows_for(c)]
    sizes = list(dict.fromkeys(c["size"] for c in cases))
    for method in METHODS if len(sizes) > 1 else ():
        small, big = (next(c for c in cases if c["size"] == s and c["method"] == method)
                      for s in sizes)  # fmt: skip
        rows += flat_rows(small, big)
    return rows


if __name__ == "__main__":
    # python -m bench.loading RESULTS.json: the rows of a run's cases, with this tree's plan.
    import json as _json

    from bench.report import table_rows

    cases = _json.loads(Path(sys.argv[1]).read_text())["suites"]["loading"]["cases"]
    print("\n".join(table_rows({"suites": {"loading": {"rows": all_rows(cases)}}})))
