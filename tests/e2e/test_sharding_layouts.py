"""Every sharding layout trains to the same losses: a layout changes where weights live and
which collectives run, and the arithmetic only in its order (fp32 noise).

    python -m pytest tests/e2e/test_sharding_layouts.py -q

`ftjob run`, 1 node x 2 real processes, the tiny model: a full fine-tune under none (DDP),
grad-op and full, the last with its micro-batches of 2 split in 2 accumulated ones of 1
(sharded gradients reduce-scattered every micro-batch: the same losses; hybrid's accumulation
is test_accumulation.py's); a checkpoint of DDP resumed under full, and one of full resumed
under DDP with accumulated micro-batches (its all-reduce in the last one only), each to the
losses of the run it came from; DPO with LoRA, the frozen base left whole (auto, which picks none
here and says so in its first lines) against it sharded (full, grad-op): the policy is the
adapted network of any LoRA run, and its reference forward (the adapters off) gathers nothing
with the base whole and shares the policy's gather under grad-op.
"""

from __future__ import annotations

import pytest
from test_dpo_run import beside_the_examples, tiny_dpo
from test_trainer_run import job, losses, run

STEPS = 4
ONE_NODE = {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2}
# The same sums in another order: fp32 rounding, growing a little with every step trained.
FP32_NOISE = dict(rel=2e-5, abs=2e-6)

# The slow tier (tests/deadline.py): each layout's run is the default layout's again.
pytestmark = pytest.mark.slow


def sft(name: str, method: str, sharding: str, **training) -> dict:
    return job(
        name,
        method={"type": method},
        training={"maxSteps": STEPS, "activationCheckpointing": "none", **training},
        dataset={"evalFraction": None},
        checkpoint={"every": 2, "keep": 2},
        resources=ONE_NODE,
        parallelism={"sharding": sharding},
    )


def dpo(name: str, sharding: str) -> dict:
    doc = tiny_dpo()
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["training"].update(maxSteps=STEPS, evalEvery=0)
    spec["dataset"]["evalFraction"] = None
    spec["resources"] = ONE_NODE
    spec["parallelism"] = {"sharding": sharding}
    return doc


def curves(tmp_path, docs: dict[str, dict]) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """Each layout's losses by step, and its output."""
    found, outputs = {}, {}
    for label, doc in docs.items():
        workdir = tmp_path / label
        code, out = run(doc, workdir)
        assert code == 0, out[-3000:]
        found[label], outputs[label] = losses(workdir), out
    return found, outputs


def assert_equal_curves(found: dict[str, dict[int, float]], reference: str) -> None:
    assert sorted(found[reference]) == list(range(1, STEPS + 1))
    for label, curve in found.items():
        assert curve.keys() == found[reference].keys(), label
        for step, loss in found[reference].items():
            assert curve[step] == pytest.approx(loss, **FP32_NOISE), (label, step)


def test_a_full_fine_tune_trains_alike_under_every_layout_and_resumes_across_them(tmp_path):
    docs = {s: sft(f"layout-full-{s}", "full", s) for s in ("none", "grad-op")}
    # The same global batch of 4 (2 ranks x 2 sequences), as 2 accumulated micro-batches of 1.
    accumulated = dict(microBatchSize=1, gradientAccumulation=2)
    docs["full"] = sft("layout-full-full", "full", "full", **accumulated)
    found, out = curves(tmp_path, docs)
    assert_equal_curves(found, "none")
    assert found["none"][STEPS] < found["none"][1]  # it trains at all
    assert "replicated (DDP) over 2 ranks" in out["none"]
    assert "full sharding over 2 ranks" in out["full"]
    # Each layout from the other's checkpoint at step 2 (relative: on the job's volume).
    resumed = {
        "full-from-none": sft("layout-full-from-none", "full", "full"),
        "none-from-full": sft("layout-none-from-full", "full", "none", **accumulated),
    }
    for label, doc in resumed.items():
        doc["spec"]["checkpoint"]["resumeFrom"] = f"{label.split('-')[-1]}/checkpoints/step-{2:08d}"
    again, out = curves(tmp_path, resumed)
    for label, curve in again.items():
        assert "resuming from checkpoint" in out[label], out[label][-2000:]
        assert sorted(curve) == [3, 4], label
        for step, loss in curve.items():
            assert loss == pytest.approx(found[label.split("-")[-1]][step], **FP32_NOISE), label


def test_dpo_reference_trains_alike_whether_the_base_is_whole_or_sharded(tmp_path):
    (tmp_path / "jobs").mkdir()
    folder = beside_the_examples(tmp_path / "jobs")
    # auto's run is the base-whole one: it resolves to none, and says why.
    docs = {s: dpo(f"layout-dpo-{s}", s) for s in ("auto", "grad-op", "full")}
    found, out = curves(folder, docs)
    assert_equal_curves(found, "full")
    assert "sharding auto -> none: " in out["auto"]
    assert "frozen base whole" in out["auto"]
    assert "replicated (DDP) over 2 ranks" in out["auto"]
