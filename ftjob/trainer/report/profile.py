"""A profile of a few training steps, on rank 0: where the step's time goes.

    ftjob run examples/tiny.yaml --profile-steps 3   # or FTJOB_PROFILE_STEPS=3 in spec.env

After ``WARMUP`` steps (allocation, compilation and autotuning are not the steady step),
``torch.profiler`` records the next N steps of the loop as they run, then writes, in the job
folder's ``logs/profile/`` (ftjob.job.folder.JobFolder.profile):

- ``summary.json``: the window's wall time; the device's busy fraction (the sum of its kernels'
  and copies' own times over that wall time; null on CPU, where ``cpuOpFraction``, the CPU
  ops' own time over it, stands instead and may pass 1: autograd's backward runs in a thread of
  its own); the 10 longest kernels (CPU: ops) by their own time; and the host syncs counted
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, device-to-host copies,
  ``aten::_local_scalar_dense`` and ``aten::item`` calls: one ``.item()`` on a GPU shows as
  one of each of the first, third and last two);
- ``trace.json``: the Chrome trace (open it in https://ui.perfetto.dev).

The summarising (:func:`summarise`) is pure; :class:`Window` is the I/O around it, and
:func:`steps` puts it around the training loop's steps.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ftjob.api import contract
from ftjob.job import atomic
from ftjob.job.folder import JobFolder

ENV = contract.PROFILE_STEPS_ENV
# Steps left out before the window: the first allocates the caching allocator's blocks and,
# compiled, traces and compiles the layers; the second may still autotune or recompile.
WARMUP = 2
TOP = 10
# The host waits on the device, by the names the profiler records them under.
SYNCS = {
    "cudaStreamSynchronize": "streamSynchronize",
    "cudaDeviceSynchronize": "deviceSynchronize",
    "aten::_local_scalar_dense": "localScalarDense",
    "aten::item": "item",
}
COPY_TO_HOST = "Memcpy DtoH"  # CUPTI's device-to-host copies: "Memcpy DtoH (Device -> Pinned)"


@dataclass(frozen=True)
class Op:
    """One name's totals over the window (torch.profiler's key_averages row)."""

    name: str
    on_device: bool  # a kernel or copy the device ran, else an op on the host
    self_us: float  # own time, children excluded: device time for a kernel, CPU time for an op
    count: int


def summarise(ops: list[Op], wall_us: float, steps: int, device: str) -> dict:
    """The profile's summary (the module's docstring says what each field means)."""
    kernels = [op for op in ops if op.on_device]
    host = [op for op in ops if not op.on_device]
    wall = max(wall_us, 1e-9)
    longest = sorted(kernels or host, key=lambda op: op.self_us, reverse=True)[:TOP]
    syncs = dict.fromkeys([*SYNCS.values(), "copiesToHost"], 0)
    for op in ops:
        if op.name in SYNCS:
            syncs[SYNCS[op.name]] += op.count
        elif op.on_device and op.name.startswith(COPY_TO_HOST):
            syncs["copiesToHost"] += op.count
    return {
        "steps": steps,
        "warmupSteps": WARMUP,
        "device": device,
        "wallSeconds": round(wall_us / 1e6, 4),
        "busyFraction": round(sum(op.self_us for op in kernels) / wall, 4) if kernels else None,
        "cpuOpFraction": round(sum(op.self_us for op in host) / wall, 4),
        "longest": [
            {
                "name": op.name,
                "selfMs": round(op.self_us / 1e3, 3),
                "calls": op.count,
                "share": round(op.self_us / wall, 4),
                "onDevice": op.on_device,
            }
            for op in longest
        ],
        "hostSyncs": syncs,
    }


def ops_of(prof: torch.profiler.profile) -> list[Op]:
    """The profiler's rows, one per name and device."""
    rows = []
    for row in prof.key_averages():
        device = row.device_type != torch.autograd.DeviceType.CPU
        own = row.self_device_time_total if device else row.self_cpu_time_total
        rows.append(Op(row.key, device, float(own), int(row.count)))
    return rows


def steps(steps: range, job_folder: Path, main: bool, device: torch.device, log):
    """``steps``, the window FTJOB_PROFILE_STEPS asks for around those it covers: the
    training loop iterates over this. The window ends after its last step, or where the loop
    ends (a failure included: the generator is closed as the loop unwinds)."""
    window = Window.from_env(job_folder, main, steps, device, log)
    try:
        for n in steps:
            window.at(n)
            yield n
    finally:
        window.close()


class Window:
    """Profiles steps ``first`` .. ``first + count - 1`` of the loop: ``at(n)`` before each
    step, ``close()`` after the loop (a run that ends inside the window summarises the steps
    it ran). Does nothing where ``folder`` is None (ranks but 0, profiling off)."""

    def __init__(self, folder: Path | None, first: int, count: int, device: torch.device, log):
        self.folder, self.first, self.stop = folder, first, first + count
        self.device, self.log = device, log
        self.prof: torch.profiler.profile | None = None
        self.began, self.upto = 0.0, first

    @classmethod
    def from_env(cls, job_folder: Path, main: bool, steps: range, device: torch.device, log):
        """The window FTJOB_PROFILE_STEPS asks for (none when unset or 0), on rank 0 only
        (``main``): one rank's profile says where a step's time goes, a profile per rank would
        only repeat it."""
        raw = os.environ.get(ENV) or "0"
        count = int(raw) if raw.isdigit() else 0
        if main and not raw.isdigit():  # a typo must not fail a training run
            log(f"profile: not taken: {ENV}={raw!r} is not a number of steps")
        first = steps.start + WARMUP
        on = bool(count) and main
        if on and first >= steps.stop:
            log(f"profile: not taken: {ENV}={count} starts after {WARMUP} warm-up steps, and "
                f"this run has {len(steps)}")  # fmt: skip
        return cls(JobFolder(job_folder).profile if on else None, first, count, device, log)

    def at(self, n: int) -> None:
        """Before step ``n``: start the window, or end it after its last step."""
        if self.folder is None:
            return
        if n == self.first:
            self._start()
        elif n == self.stop:
            self.close()
        if self.prof is not None:
            self.upto = n + 1

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            # The window starts with the device idle: earlier steps' kernels are not its own.
            torch.cuda.synchronize(self.device)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.__enter__()
        self.began = time.perf_counter()

    def close(self) -> None:
        """End the window and write its files; training goes on whatever the writing meets.
        The profiler's stop waits for the device (torch.autograd.profiler.profile.__exit__
        synchronizes it): the wall time holds every kernel of the window, and the count one
        cudaDeviceSynchronize that is the profiler's own."""
        prof, self.prof, folder, self.folder = self.prof, None, self.folder, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        wall_us = (time.perf_counter() - self.began) * 1e6
        summary = summarise(ops_of(prof), wall_us, self.upto - self.first, self.device.type)
        try:
            atomic.write_json(folder / "summary.json", summary)
            prof.export_chrome_trace(str(folder / "trace.json"))
        except OSError as e:
            self.log(f"profile: not written to {folder}: {e}")
            return
        busy = summary["busyFraction"]
        busy_text = "n/a on CPU" if busy is None else f"{busy:.0%}"
        self.log(f"profile: {summary['steps']} steps in {summary['wallSeconds']} s, device busy "
                 f"{busy_text}, host syncs {summary['hostSyncs']}; summary.json and trace.json "
                 f"in {folder}")  # fmt: skip
