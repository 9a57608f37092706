"""What every suite shares: the machine's description, model folders, `ftjob run` of a
generated job, and reading what the trainer published (progress.json / progress.jsonl)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY_MODEL = EXAMPLES / "tiny-model"
CHAT_DATA = EXAMPLES / "data" / "tiny-chat.jsonl"

# Llama shapes built from a config (no download): the tiny model's tokenizer and vocabulary,
# wider and deeper. Sizes are chosen so that a 2-process CPU step takes seconds, not minutes.
SHAPES = {
    "tiny": None,  # examples/tiny-model as committed (~0.3M parameters)
    "medium": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4),  # ~25M
    "large": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4),  # ~80M
    # The memory suite's: big enough that the weights dominate a process (~190M).
    "190m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=8),
    # The same with a 32k vocabulary, where the head's logits are a step's largest tensor.
    "190m-32k": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                     num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8),
    # The GPU suite's: TinyLlama-1.1B's shape (its own vocabulary size, the tiny tokenizer).
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096),
    # The GPU kit's second size for compile's peak: Llama-3.2-3B's shape (~3.2B, tied head).
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=4096,
               tie_word_embeddings=True),
    # The GPU kit's LoRA yardstick: Llama-3-8B's shape (NeMo's published LoRA tokens/s).
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
}  # fmt: skip


def machine() -> dict:
    import torch
    import transformers

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    info = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg": load,
    }
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        pass
    return info


def llama_config(size: str, **overrides):
    """The tiny model's LlamaConfig with SHAPES[size]'s widths and depth (and ``overrides``)."""
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(TINY_MODEL)
    for key, value in {**SHAPES[size], **overrides}.items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def model_dir(size: str, work: Path) -> Path:
    """A model folder of ``size``: the tiny model itself, or a bigger one built once in ``work``
    with the tiny model's tokenizer (random weights; never committed)."""
    if SHAPES[size] is None:
        return TINY_MODEL
    out = work / "models" / size
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    config = llama_config(size)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(tmp)
    tmp.rename(out)
    return out


def param_count(model: Path) -> int:
    from ftjob.plan.modelshape import ModelShape

    config = json.loads((model / "config.json").read_text())
    return ModelShape.from_config(config).params


def job(name: str, model: Path, *, steps: int, nodes: int = 2, micro_batch: int = 4,
        seq: int = 256, method: str = "full", log_every: int = 1, lr: float = 1e-3,
        checkpoint_every: int | None = None) -> dict:  # fmt: skip
    """A FineTuneJob on the tiny chat data: packed, fp32, no eval, one process per node."""
    spec = {
        "model": {"source": str(model)},
        "dataset": {"source": str(CHAT_DATA), "format": "chat", "maxSeqLength": seq,
                    "packing": True},
        "method": {"type": method},
        "training": {"maxSteps": steps, "learningRate": lr, "warmup": 0, "scheduler": "constant",
                     "microBatchSize": micro_batch, "activationCheckpointing": "none",
                     "logEvery": log_every, "evalEvery": 0, "seed": 42, "maxGradNorm": 1.0},
        "resources": {"nodes": nodes, "gpusPerNode": 0},
        "checkpoint": {"volume": {"claimName": "bench"}, "every": checkpoint_every or steps + 1,
                       "keep": 1},
    }  # fmt: skip
    if method in ("lora", "qlora"):
        spec["method"]["lora"] = {"r": 16, "alpha": 16, "dropout": 0.0}
    if method == "qlora":
        spec["method"]["quantization"] = {"type": "nf4"}
    return {"apiVersion": "ftjob.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def steady(rates: list[float]) -> float:
    """A run's steady rate: the median of its per-step rates. On a shared machine another
    tenant's burst slows a step or two of a run (the same step's CPU time was seen to vary
    3.5-4.3 s minutes apart); the median leaves such steps out where the mean carries them,
    and the suites take each side's best run for the same reason."""
    return statistics.median(rates)


@dataclass
class Run:
    wall: float
    progress: dict
    log: list[dict]
    output: str

    def step_rates(self, skip: int) -> list[float]:
        """The trainer's own tokens/s of each logged interval after the first ``skip`` steps
        (warm-up: allocation, first-touch page faults)."""
        steps = [e for e in self.log if e.get("event") == "step"]
        return [e["tokensPerSecond"] for e in steps[skip:] if e.get("tokensPerSecond")]

    def steady_tokens_per_second(self, skip: int) -> float:
        """:func:`steady` of :meth:`step_rates` (as the TRL workers' clocks take theirs)."""
        rates = self.step_rates(skip)
        return steady(rates) if rates else self.progress.get("tokensPerSecond") or 0.0

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.log if e.get("event") == "step"]


_CACHE: dict[str, Run] = {}


def ftjob_run(doc: dict, work: Path, env: dict | None = None, timeout: float = 600,
              tree: Path | None = None) -> Run:  # fmt: skip
    """``ftjob run`` of ``doc`` in a fresh folder; the same doc and env run once per bench.
    ``tree``: a folder holding another commit's ``ftjob`` package, run instead of this one."""
    if tree:  # first on the path: run from there (-m puts the working folder before PYTHONPATH)
        env = {**(env or {}), "PYTHONPATH": str(tree)}
    key = json.dumps([doc, env or {}], sort_keys=True)
    if key in _CACHE:
        return _CACHE[key]
    name = doc["metadata"]["name"]
    folder = work / "runs" / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job_file = folder / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    cmd = [sys.executable, "-m", "ftjob", "run", str(job_file), "--workdir", str(folder / "job")]
    wall, stdout = _timed(cmd, f"ftjob run {name}", env or {}, timeout, cwd=tree or ROOT)
    job_dir = folder / "job"
    progress = json.loads((job_dir / "progress.json").read_text())
    log = [json.loads(x) for x in (job_dir / "progress.jsonl").read_text().splitlines() if x]
    run = Run(wall, progress, log, stdout[-2000:])
    shutil.rmtree(job_dir / "checkpoints", ignore_errors=True)  # keep the temp folder small
    _CACHE[key] = run
    return run


def alternate(
    runs: int, name: str, doc_for, worker: str, args: list[str], work: Path,
    processes: int = 2, env: dict | None = None,
) -> tuple[list[Run], list[dict]]:  # fmt: skip
    """``ftjob run`` of ``doc_for(name)`` and the TRL ``worker`` in turn, ``runs`` times each
    (others' work on a shared machine only ever slows a run down: the suites take each side's
    best), which side goes first flipped every other pair: a machine that drifts faster or
    slower over the minutes of a suite (seen: one side's runs 1,055 to 1,607 tokens/s) favours
    neither. Run i's job is named ``name-i`` (the first ``name``): each is run, not cached. A
    worker's TRL record gets its wall time, and each rank's peak RSS where it tagged them."""
    ours, theirs = [], []

    def baseline() -> None:
        wall, out = torchrun(worker, args, processes, work, env=env)
        record = {**last_json(out, "TRL"), "wall": wall}
        ranks = sorted(tagged(out, "TRL-RANK"), key=lambda r: r["rank"])
        if ranks:
            record["peakRssMiB"] = [r["peakRssMiB"] for r in ranks]
        theirs.append(record)

    for i in range(runs):
        if i % 2:
            baseline()
        ours.append(ftjob_run(doc_for(name + (f"-{i}" if i else "")), work, env=env))
        if not i % 2:
            baseline()
    return ours, theirs


def torchrun_command(module: str, args: list[str], nproc: int) -> list[str]:
    """torchrun (standalone) of a bench worker as a module (``bench.trl_worker``), from the
    repo's root: run as a script, bench/ would come first on its path and bench/operator.py
    would shadow the standard library's operator (it broke TRL's import under torch 2.11)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "--module", module, *args]  # fmt: skip


def torchrun(module: str, args: list[str], nproc: int, work: Path, timeout: float = 600,
             env: dict | None = None) -> tuple[float, str]:  # fmt: skip
    """Run a bench worker under torchrun (:func:`torchrun_command`); (wall, stdout)."""
    tmp = work / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    cmd = torchrun_command(module, args, nproc)
    return _timed(cmd, module, {"OMP_NUM_THREADS": threads, "TMPDIR": str(tmp), **(env or {})},
                  timeout)  # fmt: skip


def _timed(cmd: list[str], what: str, env: dict, timeout: float,
           cwd: Path = ROOT) -> tuple[float, str]:  # fmt: skip
    """Run ``cmd`` in ``cwd`` (the repo) with ``env`` added; (wall seconds, stdout), or raise
    with the output's tail."""
    started = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)  # fmt: skip
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return wall, proc.stdout


def tagged(stdout: str, tag: str) -> list[dict]:
    """Every ``tag {json}`` record a worker printed, in order. Two ranks printing at once can
    share a line of torchrun's output (seen: ``TRL-RANK {...}TRL {...}``), so each record is
    decoded where its marker starts, up to its own end."""
    decoder, found, marker = json.JSONDecoder(), [], tag + " {"
    at = stdout.find(marker)
    while at >= 0:
        try:
            record, end = decoder.raw_decode(stdout, at + len(tag) + 1)
        except ValueError:  # a marker inside other text: look further on
            end = at + 1
        else:
            found.append(record)
        at = stdout.find(marker, end)
    return found


def last_json(stdout: str, tag: str) -> dict:
    """The last ``tag {json}`` record a worker printed (:func:`tagged`)."""
    records = tagged(stdout, tag)
    if not records:
        raise RuntimeError(f"no '{tag}' line in:\n{stdout[-2000:]}")
    return records[-1]


def proc_mib(pid: int | str, names: tuple[str, ...], table: str = "status") -> dict[str, float]:
    """The fields ``names`` of /proc/<pid>/<table> (status or smaps_rollup; kB there), in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/{table}").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names:
            fields[key] = int(value.split()[0]) / 1024
    return fields
