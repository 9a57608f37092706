"""The profile's summary (ftjob.trainer.report.profile): pure summarising of profiler rows, and
the rows a real torch.profiler gives on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from ftjob.trainer.report import profile
from ftjob.trainer.report.profile import Op, summarise


def test_a_gpu_window_sums_kernel_time_orders_the_longest_and_counts_host_syncs():
    ops = [
        Op("aten::mm", False, 900.0, 12),  # host time of the launches: not device time
        Op("sm90_gemm_bf16", True, 4000.0, 12),
        Op("flash_fwd_kernel", True, 2500.0, 4),
        Op("Memcpy DtoH (Device -> Pageable)", True, 2.0, 3),
        Op("Memcpy HtoD (Pinned -> Device)", True, 50.0, 2),
        Op("cudaStreamSynchronize", False, 300.0, 3),
        Op("cudaDeviceSynchronize", False, 10.0, 1),
        Op("aten::_local_scalar_dense", False, 30.0, 3),
        Op("aten::item", False, 5.0, 3),
    ]
    s = summarise(ops, wall_us=10_000.0, steps=3, device="cuda")
    assert s["busyFraction"] == pytest.approx((4000 + 2500 + 2 + 50) / 10_000)
    assert s["cpuOpFraction"] == pytest.approx((900 + 300 + 10 + 30 + 5) / 10_000)
    names = [k["name"] for k in s["longest"]]
    assert names == ["sm90_gemm_bf16", "flash_fwd_kernel", "Memcpy HtoD (Pinned -> Device)",
                     "Memcpy DtoH (Device -> Pageable)"]  # fmt: skip
    assert s["longest"][0] == {"name": "sm90_gemm_bf16", "selfMs": 4.0, "calls": 12,
                               "share": 0.4, "onDevice": True}  # fmt: skip
    assert s["hostSyncs"] == {"streamSynchronize": 3, "deviceSynchronize": 1,
                              "localScalarDense": 3, "item": 3, "copiesToHost": 3}  # fmt: skip
    assert s["steps"] == 3 and s["wallSeconds"] == 0.01 and s["warmupSteps"] == profile.WARMUP


def test_a_cpu_window_has_no_busy_fraction_and_ranks_ops_by_their_own_cpu_time():
    ops = [Op(f"aten::op{k}", False, float(k), 1) for k in range(15)]
    ops.append(Op("aten::_local_scalar_dense", False, 0.5, 2))
    s = summarise(ops, wall_us=200.0, steps=2, device="cpu")
    assert s["busyFraction"] is None
    assert s["cpuOpFraction"] == pytest.approx((sum(range(15)) + 0.5) / 200)
    assert [k["name"] for k in s["longest"]] == [f"aten::op{k}" for k in range(14, 4, -1)]
    assert s["hostSyncs"]["localScalarDense"] == 2 and s["hostSyncs"]["copiesToHost"] == 0


def test_a_real_cpu_profile_counts_each_item_as_a_host_read():
    """The names torch's profiler records are the ones the summary counts: three .item()
    calls, three reads of a scalar to the host."""
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (x @ x).sum().item()
    s = summarise(profile.ops_of(prof), wall_us=1e6, steps=1, device="cpu")
    assert s["hostSyncs"]["item"] == 3 and s["hostSyncs"]["localScalarDense"] == 3
    assert "aten::mm" in [k["name"] for k in s["longest"]]
    json.dumps(s)  # written as JSON as it is


def test_the_window_profiles_the_steps_after_the_warm_up_and_writes_its_files(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(profile.ENV, "2")
    said = []
    x = torch.randn(32, 32)
    for _ in profile.steps(range(0, 6), tmp_path, True, torch.device("cpu"), said.append):
        (x @ x).sum().item()
    folder = tmp_path / "logs" / "profile"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["hostSyncs"]["item"] == 2  # steps 2 and 3 only
    assert json.loads((folder / "trace.json").read_text())["traceEvents"]
    assert len(said) == 1 and said[0].startswith("profile: 2 steps in ")


def test_a_loop_that_fails_inside_the_window_still_writes_the_steps_it_ran(tmp_path, monkeypatch):
    monkeypatch.setenv(profile.ENV, "3")
    x = torch.randn(32, 32)

    def loop():
        for n in profile.steps(range(10, 20), tmp_path, True, torch.device("cpu"), print):
            (x @ x).sum().item()
            if n == 13:  # the window's second step (12, 13, 14 after 10 and 11)
                raise RuntimeError("a step failed")

    with pytest.raises(RuntimeError, match="a step failed"):
        loop()
    summary = json.loads((tmp_path / "logs" / "profile" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["hostSyncs"]["item"] == 2


def test_no_window_where_profiling_is_off_or_on_other_ranks(tmp_path, monkeypatch):
    monkeypatch.delenv(profile.ENV, raising=False)
    off = profile.Window.from_env(tmp_path, True, range(0, 6), torch.device("cpu"), print)
    monkeypatch.setenv(profile.ENV, "2")
    other = profile.Window.from_env(tmp_path, False, range(0, 6), torch.device("cpu"), print)
    for window in (off, other):
        for n in range(6):
            window.at(n)
        window.close()
    assert not (tmp_path / "logs").exists()


def test_a_count_that_is_not_a_number_of_steps_is_named_and_training_goes_on(tmp_path, monkeypatch):
    said = []
    for raw in ("-1", "three"):
        monkeypatch.setenv(profile.ENV, raw)
        for _ in profile.steps(range(0, 4), tmp_path, True, torch.device("cpu"), said.append):
            pass
    assert said == [
        f"profile: not taken: {profile.ENV}='-1' is not a number of steps",
        f"profile: not taken: {profile.ENV}='three' is not a number of steps",
    ]
    assert not (tmp_path / "logs").exists()
