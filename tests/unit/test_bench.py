"""bench's pure helpers: the RESULTS.md rows, the JSON shape, the job it generates, and how the
operator benchmark names API requests. No timings are asserted (they belong in RESULTS.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder of the repo, not an installed package

from bench import common, report  # noqa: E402
from ftjob.api.jobspec import parse_resource  # noqa: E402


def results(**suites) -> dict:
    return {
        "command": "python -m bench --quick",
        "started": "2026-11-21 16:30 UTC",
        "machine": {"cpus": 2, "python": "3.11.9", "torch": "2.13.0", "transformers": "5.23.0",
                    "cuda": None, "loadavg": [1.5, 1.0, 0.5]},
        "seconds": 61.2,
        "loadavg_after": [2.0, 1.5, 1.0],
        "json": "bench/results/x.json",
        "suites": suites,
    }  # fmt: skip


def test_fmt_keeps_three_significant_figures_and_marks_missing_values():
    assert report.fmt(0.123456) == "0.123"
    assert report.fmt(12345.678) == "12,346"
    assert report.fmt(1.5) == "1.50"
    assert report.fmt(0) == "0"
    assert report.fmt(None) == "-"
    assert report.fmt([411.0, 409.8]) == "411 / 410"
    assert report.fmt(True) == "yes"


def test_a_row_becomes_one_table_line_with_the_baseline_and_the_goal():
    r = report.row("save s", 0.5, 2.0, "gather + save_file", 0.25, "<= 0.25x", True)
    lines = report.table_rows(results(checkpoints={"rows": [r]}))
    assert lines == [
        "| checkpoints | save s | 0.500 | 2.00 | gather + save_file | 0.250 | <= 0.25x | **met** |"
    ]
    assert lines[0].count("|") == report.HEADER.count("|")


def test_a_failed_suite_is_a_row_not_a_crash_and_pipes_cannot_break_the_table():
    lines = report.table_rows(results(operator={"error": "RuntimeError: a | b"}))
    assert len(lines) == 1 and lines[0].startswith("| operator | failed: RuntimeError: a / b")
    assert lines[0].count("|") == report.HEADER.count("|")


def test_markdown_has_command_machine_load_and_table(tmp_path):
    r = report.row("tokens/s", 100.0, 80.0, "TRL", 1.25, ">= 1.1x", True)
    res = results(throughput={"rows": [r]})
    text = report.markdown(res)
    assert "`python -m bench --quick`" in text
    assert (
        "2 CPUs" in text
        and "torch 2.13.0" in text
        and "before: 1.50 / 1.00 / 0.500; after: 2.00 / 1.50 / 1.00" in text
    )
    assert report.HEADER in text and "| throughput | tokens/s | 100 | 80.0 | TRL |" in text
    md = tmp_path / "RESULTS.md"
    report.append(md, res)
    report.append(md, res)
    body = md.read_text()
    assert body.startswith("# Benchmark results") and body.count(report.HEADER) == 2


def test_json_round_trips(tmp_path):
    res = results(loading={"rows": [report.row("rss", 1.0)], "cases": [{"rank0": [1.0, 2.0]}]})
    report.write_json(tmp_path / "out" / "r.json", res)
    back = json.loads((tmp_path / "out" / "r.json").read_text())
    assert back["suites"]["loading"]["rows"][0] == {
        "measurement": "rss", "ftjob": 1.0, "baseline": None, "baseline_name": "-",
        "ratio": None, "goal": "-", "met": None,
    }  # fmt: skip
    assert set(back) >= {"command", "machine", "suites", "seconds"}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_generated_jobs_are_valid_finetunejobs(method, tmp_path):
    name, spec = parse_resource(common.job("b", tmp_path, steps=3, method=method))
    assert name == "b" and spec.training.max_steps == 3 and spec.method.type == method
    assert spec.resources.world_size == 2 and spec.checkpoint.every > 3  # no mid-run saves


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_gpu_suites_job_is_a_valid_bf16_gpu_finetunejob(method, tmp_path):
    from bench import gpu

    one_gpu = gpu.Setup("1b", seq=2048, micro_batch=4, steps=12, processes=1, gpu=True,
                        repeat_data=40, skip=3)  # fmt: skip
    _, spec = parse_resource(gpu.job(method, tmp_path, tmp_path / "chat.jsonl", one_gpu))
    assert spec.compute_precision() == "bf16" and spec.resources.gpus_per_node == 1
    assert spec.dataset.max_seq_length == 2048 and spec.training.activation_checkpointing == "all"
    args = gpu.trl_args(method, tmp_path, tmp_path / "chat.jsonl", one_gpu)
    assert "--bf16" in args
    # TRL recomputes as ftjob does, skips the same warm-up steps, uses ftjob's attention.
    assert "--activation-checkpointing" in args
    assert args[args.index("--skip") + 1] == "3" and args[args.index("--attention") + 1] == "ftjob"


def test_the_chunkedloss_suite_runs_the_baseline_commits_trainer_on_a_valid_dpo_job(tmp_path):
    from bench import chunkedloss

    _, spec = parse_resource(chunkedloss.job("c", tmp_path, chunkedloss.QUICK))
    assert spec.training.objective == "dpo" and spec.training.activation_checkpointing == "all"
    assert spec.resources.world_size == 2 and spec.training.max_steps == 1
    tree = chunkedloss.baseline_tree(tmp_path)
    # The commit before DPO's chunked log-probabilities: its dpo.py takes whole logits.
    assert "sequence_logps" not in (tree / "ftjob/trainer/objectives/dpo.py").read_text()
    assert "sequence_logps" in (common.ROOT / "ftjob/trainer/objectives/dpo.py").read_text()


def test_trls_steady_rate_leaves_out_the_warm_up_steps():
    from bench.trl_worker import Clock

    clock = Clock()
    clock.ends = [1.0, 3.0, 4.0, 4.5]  # step k ends here
    clock.tokens = [100, 200, 300, 400]  # tokens trained so far, after step k
    assert clock.rates(skip=2) == [100 / 1.0, 100 / 0.5]
    assert clock.steady_tokens_per_second(skip=2) == (100 / 1.0 + 100 / 0.5) / 2
    assert clock.steady_tokens_per_second(skip=0) == 100  # step 1: no start; 50, 100, 200


def test_steady_tokens_per_second_skips_the_warm_up_step():
    log = [{"event": "step", "tokensPerSecond": t} for t in (10.0, 100.0, 200.0)]
    run = common.Run(1.0, {"tokensPerSecond": 5.0}, log + [{"event": "eval"}], "")
    assert run.steady_tokens_per_second(1) == 150.0
    assert run.steady_tokens_per_second(2) == 200.0
    assert common.Run(1.0, {"tokensPerSecond": 5.0}, [], "").steady_tokens_per_second(1) == 5.0


def test_a_steady_rate_is_the_median_step_a_burst_on_the_machine_leaves_out():
    log = [{"event": "step", "tokensPerSecond": t} for t in (10.0, 100.0, 104.0, 20.0, 102.0)]
    run = common.Run(1.0, {}, log, "")
    assert run.step_rates(1) == [100.0, 104.0, 20.0, 102.0]
    assert run.steady_tokens_per_second(1) == 101.0  # the mean, 81.5, would carry the burst


def test_the_throughput_suite_leaves_out_the_same_warm_up_steps_on_both_sides(tmp_path):
    from bench import throughput
    from bench.trl_worker import parser

    a = parser().parse_args(throughput.trl_args(tmp_path, 14, 256, 2, "lora"))
    assert a.skip == throughput.SKIP == 2 and (a.steps, a.seq, a.micro_batch) == (14, 256, 2)


def test_last_json_reads_the_workers_tagged_line():
    out = 'noise\nCKPT {"sharded": 1}\nmore\nCKPT {"sharded": 2}\n'
    assert common.last_json(out, "CKPT") == {"sharded": 2}
    with pytest.raises(RuntimeError):
        common.last_json("nothing", "CKPT")


def test_request_keys_name_the_resource_the_verb_and_the_subresource():
    pytest.importorskip("kmock")
    from bench.operator import request_key

    assert request_key("POST", "/api/v1/namespaces/default/pods", False) == "POST pods"
    path = "/apis/ftjob.dev/v1alpha1/namespaces/default/finetunejobs/x/status"
    assert request_key("PATCH", path, False) == "PATCH finetunejobs/status"
    assert request_key("GET", "/apis/ftjob.dev/v1alpha1/finetunejobs", True) == "WATCH finetunejobs"
    assert request_key("GET", "/apis", False) == "GET discovery"
    assert request_key("GET", "/version", False) == "GET other"


def test_the_dpo_suites_two_sides_get_the_same_settings(tmp_path):
    """The ftjob job is a valid DPO LoRA FineTuneJob, and the TRL worker's own parser reads
    the same model, data, lengths, batch, steps, optimizer, beta and LoRA from its arguments."""
    from bench import dpo
    from bench.trl_dpo_worker import parser

    s = dpo.FULL
    _, spec = parse_resource(dpo.job("d", tmp_path, tmp_path / "pairs.jsonl", s))
    assert spec.training.objective == "dpo" and spec.dataset.format == "preference"
    assert spec.resources.world_size == s.processes == 2 and spec.checkpoint.every > s.steps
    lora = spec.method.lora_settings()
    settings = spec.training.dpo_settings()
    a = parser().parse_args(dpo.trl_args(tmp_path, tmp_path / "ordered.jsonl", s))
    assert (a.steps, a.seq, a.micro_batch) == (
        spec.training.max_steps,
        spec.dataset.max_seq_length,
        spec.training.micro_batch_size,
    )
    assert (a.lr, a.beta, a.seed) == (
        spec.training.learning_rate,
        settings.beta,
        spec.training.seed,
    )
    assert settings.loss_type == "sigmoid" and spec.training.weight_decay == 0.0
    assert (a.lora_r, a.lora_alpha) == (lora.r, lora.alpha) and lora.dropout == 0.0
    assert a.targets.split(",") == lora.target_modules
    assert a.in_order and a.skip == s.skip


@pytest.mark.parametrize("micro_batch", [1, 3])
def test_trl_in_order_gets_the_micro_batches_ftjob_samples(micro_batch):
    """The file order the suite writes for TRL, sharded as accelerate shards an unshuffled
    set, gives each rank at each step the pairs ftjob's sampler gives it."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    from bench import dpo
    from ftjob.trainer.data.batches import Sampler

    s = dpo.Setup("tiny", micro_batch=micro_batch, steps=5)
    order = dpo.ftjob_order(s, n=64)
    assert len(order) == s.steps * s.processes * micro_batch
    sampler = Sampler(64, s.seed, s.processes, micro_batch, 1)
    for rank in range(s.processes):
        batches = BatchSampler(SequentialSampler(order), micro_batch, drop_last=False)
        theirs = [[order[i] for i in b] for b in BatchSamplerShard(batches, s.processes, rank)]
        assert theirs == [sampler.indices(step, 0, rank) for step in range(s.steps)]


def test_the_dpo_suites_pairs_fit_the_sequence_length_untruncated(tmp_path):
    import json

    from transformers import AutoTokenizer

    from bench import dpo

    tok = AutoTokenizer.from_pretrained(common.TINY_MODEL)
    path = dpo.synthetic(tmp_path / "p.jsonl", tok, seq=128, count=20)
    pairs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(pairs) == 20 and all(p["chosen"] != p["rejected"] for p in pairs)
    for p in pairs:
        longer = max(len(tok(p["prompt"] + p[k])["input_ids"]) for k in ("chosen", "rejected"))
        assert 64 < longer + 1 <= 128  # + EOS: filled, and nothing for either side to cut


def test_dpo_steady_rates_leave_out_the_warm_up_steps():
    from bench import dpo

    # tokensSeen grows 100 a step; steps 3 and 4 take 1 s and 0.5 s.
    log = [{"event": "step", "step": k, "tokensSeen": 100 * k, "tokensPerSecond": t}
           for k, t in [(1, 10.0), (2, 50.0), (3, 100.0), (4, 200.0)]]  # fmt: skip
    assert dpo.steady(log + [{"event": "eval"}], skip=2, pairs_per_step=2) == (4 / 1.5, 200 / 1.5)
    assert dpo.steady(log, skip=4, pairs_per_step=2) == (None, None)


def test_tagged_records_are_read_where_ranks_share_a_line():
    out = 'x\nTRL-RANK {"rank": 1, "peakRssMiB": 2}TRL-RANK {"rank": 0, "peakRssMiB": 3}\nTRL {}\n'
    assert common.tagged(out, "TRL-RANK") == [{"rank": 1, "peakRssMiB": 2},
                                              {"rank": 0, "peakRssMiB": 3}]  # fmt: skip
    # The result line glued to a rank's (seen from the GRPO worker): still found.
    glued = 'TRL-RANK {"rank": 1}TRL {"stepsPerSecond": 0.15}\n'
    assert common.last_json(glued, "TRL") == {"stepsPerSecond": 0.15}


def _grow(held: list, jobs: int) -> None:
    held.extend(bytearray(10_240) for _ in range(jobs))  # 10 KiB a job


def test_the_fleet_trace_names_the_line_that_holds_each_jobs_memory(tmp_path):
    import tracemalloc

    from bench.fleet import held_by

    held: list = []
    tracemalloc.start(4)
    try:
        tracemalloc.take_snapshot().dump(str(tmp_path / "1.snap"))
        _grow(held, 50)
        tracemalloc.take_snapshot().dump(str(tmp_path / "2.snap"))
    finally:
        tracemalloc.stop()
    lines = held_by([tmp_path / "1.snap", tmp_path / "2.snap"], 50)
    top = lines[1].split()
    assert float(top[0]) == pytest.approx(10.0, abs=0.2) and top[1] == "KiB/job"
    assert top[3].startswith("test_bench.py:") and "test_bench.py" in lines[1].split("<-")[1]


def test_the_fleet_says_who_spent_the_cpu_in_a_window_the_most_first():
    import os
    import time

    from bench.fleet import cpu_seconds, cpu_spent

    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:  # this process busy for 0.3 s of CPU
        pass
    spent = cpu_seconds(os.getpid()) - before
    assert 0.25 <= spent <= 2.0, spent
    said = cpu_spent({"etcd": 5.0, "operator": 1.0}, {"etcd": 6.0, "operator": 31.0, "new": 2.0})
    assert said == "operator 30, new 2, etcd 1"


def test_the_kernels_suite_switches_each_layer_between_its_two_classes():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bench import kernels

    tiny = AutoModelForCausalLM.from_pretrained(common.TINY_MODEL)
    net = get_peft_model(tiny, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    switch = kernels.Switch(net)
    # adapted layers, norms, the final norm, attentions
    assert len(switch.classes) == 2 * 2 + 2 * 2 + 1 + 2

    def names() -> set[str]:
        return {type(m).__name__ for m in switch.classes}

    switch.use(kernels.VARIANTS[0])
    assert names() == {"Linear", "LlamaRMSNorm", "LlamaAttention"}
    switch.use(kernels.VARIANTS[1])
    assert names() == {"FusedLoraLinear", "LlamaRMSNorm", "LlamaAttention"}
    switch.use(kernels.VARIANTS[2])
    assert names() == {"FusedLoraLinear", "FusedLlamaRMSNorm", "LlamaAttention"}
    switch.use(kernels.VARIANTS[3])
    assert names() == {"FusedLoraLinear", "FusedLlamaRMSNorm", "RotaryLlamaAttention"}
    ids, kwargs = kernels.batch(tokens=64)
    assert ids.shape == (1, 64) and int(kwargs["cu_seq_lens_q"][-1]) == 64


def test_the_sides_take_turns_going_first_so_a_drifting_machine_favours_neither(monkeypatch):
    order = []

    def ours(doc, work, env=None):
        order.append(("ftjob", doc))
        return doc

    def theirs(worker, args, processes, work, env=None):
        order.append(("trl", worker))
        return 1.0, 'TRL {"tokensPerSecond": 1.0}\n'

    monkeypatch.setattr(common, "ftjob_run", ours)
    monkeypatch.setattr(common, "torchrun", theirs)
    got, records = common.alternate(4, "job", lambda name: name, "worker", [], Path("."))
    assert [side for side, _ in order] == ["ftjob", "trl", "trl", "ftjob"] * 2
    assert got == ["job", "job-1", "job-2", "job-3"] and len(records) == 4
    assert records[0] == {"tokensPerSecond": 1.0, "wall": 1.0}
