"""The trainer on a CUDA GPU: what no CPU run shows (NCCL, bf16 on CUDA, CUDA memory, pinned
checkpoint staging, NF4 on the GPU).

    python -m pytest tests/gpu -x -q      # where CUDA is; bench/gpu_kit/run.sh tests runs this

Collected by every test run and skipped, with that reason, where CUDA is absent. The jobs are
tests/e2e's (the tiny model, `ftjob run`, the same readers of progress.json and the export), on
one GPU: world size 1 (FSDP2 over a mesh of one, bf16 compute, NCCL with gloo beside it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))  # the e2e helpers (tests/ is not a package)

from test_qlora import job as qlora_job  # noqa: E402
from test_qlora import make_base  # noqa: E402
from test_trainer_run import RUN_TIMEOUT, eval_loss_of, final, job, losses, run  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
ONE_GPU = {"nodes": 1, "gpusPerNode": 1}


def report(name: str, **numbers) -> None:
    """One line the kit's log keeps (pytest -rA shows what passing tests print)."""
    print(f"GPU {name}: {json.dumps(numbers)}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-runs")


@pytest.fixture(scope="module")
def full(runs):
    """A full fine-tune of the tiny model on one GPU, with background checkpoints (pinned
    staging buffers and a side stream exist only with CUDA)."""
    doc = job("gpu-full", resources=ONE_GPU, checkpoint={"every": 10, "asyncSave": True})
    code, out = run(doc, runs / "full")
    assert code == 0, out
    return runs / "full"


def test_full_bf16_run_on_one_gpu_lowers_the_loss(full):
    curve = losses(full)
    assert sorted(curve) == list(range(1, 31))
    first, last = curve[1], sum(curve[s] for s in (28, 29, 30)) / 3
    report("full loss", first=first, last=last)
    assert last < first - 1.0, curve


def test_full_run_reports_gpu_peak_memory_and_mfu(full):
    snap = final(full)
    peak = snap.get("trainPeakGpuMiB")
    report("full peaks", trainPeakGpuMiB=peak, trainPeakRssMiB=snap.get("trainPeakRssMiB"),
           device=snap.get("device"), mfu=snap.get("mfu"),
           tokensPerSecond=snap.get("tokensPerSecond"))  # fmt: skip
    assert isinstance(peak, list) and len(peak) == 1, snap
    # A 0.3M-parameter model: its states, activations and logits take a few MiB at most.
    assert 0 < peak[0] < 512, peak
    # The CUDA device name maps to an entry of ftjob.api.hardware (else MFU is not reported); the
    # value itself is tiny for a 0.3M model and rounds to 4 places, so only its presence counts.
    assert snap["mfu"] is not None, snap.get("device")


def test_full_run_commits_background_checkpoints(full):
    kept = sorted(p.name for p in (full / "checkpoints").iterdir())
    assert kept == ["step-00000010", "step-00000020"]
    for name in kept:
        assert (full / "checkpoints" / name / "COMMITTED").is_file()


def test_full_export_reloads_with_the_trained_eval_loss(full):
    """The export (fp32 masters) evaluated on CPU in fp32 against the trainer's bf16 figure:
    bf16 compute moved a trained tiny model's loss by 0.5% in a CPU check; the untrained
    model's loss is ~2x the trained one, so 2% still tells the trained weights apart."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(full / "model")
    trained, reloaded = final(full)["evalLoss"], eval_loss_of(model, full)
    report("full eval", trained=trained, reloaded=reloaded)
    assert reloaded == pytest.approx(trained, rel=0.02)


def test_qlora_nf4_base_trains_on_one_gpu(runs):
    """torchao NF4 quantized and dequantized on CUDA (a shard group of one: held whole)."""
    make_base(runs / "base")
    doc = qlora_job("gpu-qlora", runs / "base", "qlora")
    doc["spec"]["resources"] = dict(ONE_GPU)
    code, out = run(doc, runs / "qlora")
    assert code == 0, out
    curve, snap = losses(runs / "qlora"), final(runs / "qlora")
    report("qlora", first=curve[1], last=curve[max(curve)],
           trainPeakGpuMiB=snap.get("trainPeakGpuMiB"))  # fmt: skip
    assert sorted(curve) == list(range(1, 13))
    assert sum(curve[s] for s in (10, 11, 12)) / 3 < curve[1] - 1.0, curve
    assert (runs / "qlora" / "model" / "merged" / "config.json").is_file()


def test_two_ranks_share_one_gpu_over_nccl_or_nccl_says_why_not(runs):
    """Two processes on one GPU: the trainer's sharding, loss and optimizer under NCCL.

    `ftjob run` gives each rank a GPU of its own (CUDA_VISIBLE_DEVICES per node, one process
    per GPU), so this runs the trainer's pieces in a torchrun worker whose ranks both use
    cuda:0. Recent NCCL refuses two ranks of a communicator on one device ("Duplicate GPU
    detected"): then the test is skipped with NCCL's own message.
    """
    result = runs / "two-ranks"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(HERE / "two_ranks_one_gpu.py"), "--result", str(result)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    log = proc.stdout + proc.stderr
    found = {p.name: json.loads(p.read_text()) for p in sorted(result.glob("rank*.json"))}
    refused = [o["refused"] for o in found.values() if "refused" in o]
    if refused:
        pytest.skip(f"NCCL refuses two ranks on one GPU: {refused[0]}")
    assert proc.returncode == 0 and "rank0.json" in found, log
    outcome = found["rank0.json"]
    report("two ranks on one GPU", **outcome)
    curve = outcome["losses"]
    assert outcome["ranksAgree"] and curve[-1] < curve[0] - 1.0, outcome


def test_a_shared_prompt_gives_two_rows_log_probabilities_on_the_gpu():
    """A DPO pair's prompt run once (trainer/data/pairs.py rows, shared) in bf16 on CUDA: the
    branched batch runs SDPA per document with a mask where the two-row batch runs the varlen
    flash kernel; the sequences' log-probabilities agree to bf16's precision."""
    sys.path.insert(0, str(HERE.parent / "unit"))
    from test_shared_prefix import PAD, PAIRS, TINY
    from transformers import AutoModelForCausalLM

    from ftjob.trainer.data import batches as data
    from ftjob.trainer.data import pairs
    from ftjob.trainer.model import attention
    from ftjob.trainer.objectives.loss import model_inputs, sequence_logps

    net = AutoModelForCausalLM.from_pretrained(
        TINY, dtype=torch.bfloat16, attn_implementation=attention.implementation("sdpa")
    ).cuda()
    got = {}
    for shared in (True, False):
        batch = data.collate(pairs.rows(PAIRS, shared=shared), PAD).to("cuda")
        with torch.no_grad():
            got[shared] = sequence_logps(net, model_inputs(net, batch), batch)
    report("shared-prompt", shared=got[True].tolist(), rows=got[False].tolist())
    torch.testing.assert_close(got[True].float(), got[False].float(), rtol=2e-2, atol=5e-2)


def test_the_head_picks_its_learned_rows_without_waiting_for_the_gpu():
    """objectives/loss.py hands the head the learned rows only, found by torch.nonzero_static
    with a host count: no device-to-host sync (torch's sync debug mode raises on one; the
    control, torch.nonzero, does), and the loss and gradients of the rows it keeps equal the
    all-rows ones (tests/host_reads.py counts nonzero_static as no read on this ground)."""
    from ftjob.trainer.data.tokenize import IGNORE
    from ftjob.trainer.objectives import loss

    torch.manual_seed(0)
    hidden = torch.randn(512, 64, device="cuda", requires_grad=True)
    weight = torch.randn(1000, 64, device="cuda", requires_grad=True)
    targets = torch.randint(0, 1000, (512,), device="cuda")
    targets[100:] = IGNORE
    results = []
    for learned in (None, 100):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = loss.linear_cross_entropy(hidden, weight, targets, learned=learned)
            out.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((out.detach(), hidden.grad.clone(), weight.grad.clone()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.nonzero(targets != IGNORE)  # the control: the mode sees a sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
