"""Rank 0's Prometheus metrics (``GET /metrics``), through prometheus_client.

The gauges are read from the progress snapshot at scrape time (a custom collector), so the
snapshot stays the one source of truth and unknown values (JSON ``null``) are left out
instead of being exported as 0. Step time is a real histogram, observed as steps end.
docs/progress.md lists the names.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ftjob.api import objectives
from ftjob.api.contract import PHASES

CONTENT_TYPE = CONTENT_TYPE_LATEST

# name, snapshot field, help text
GAUGES = [
    ("ftjob_step", "step", "Optimizer steps completed."),
    ("ftjob_total_steps", "totalSteps", "Optimizer steps the job will run."),
    ("ftjob_epoch", "epoch", "Passes over the training data so far."),
    ("ftjob_loss", "loss", "Training loss (mean over the tokens of the last step)."),
    ("ftjob_eval_loss", "evalLoss", "Loss on the eval set at the last evaluation."),
    ("ftjob_learning_rate", "learningRate", "Learning rate of the last step."),
    ("ftjob_tokens_per_second", "tokensPerSecond", "Training tokens per second, all ranks."),
    ("ftjob_tokens_total", "tokensSeen", "Training tokens processed by this attempt."),
    ("ftjob_mfu_ratio", "mfu", "Model FLOPs utilisation (0-1); absent on CPU."),
    ("ftjob_eta_seconds", "etaSeconds", "Estimated seconds until training ends."),
    ("ftjob_last_checkpoint_step", "lastCheckpointStep", "Step of the newest checkpoint."),
    ("ftjob_gang_restarts_in_place", "restartsInPlace", "Worker restarts in place of this gang."),
]  # then the objectives' own (api/objectives.py), absent from other objectives' jobs
# From a few milliseconds (a tiny CPU model) to minutes (a 70B step on few GPUs).
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class _Snapshot(Collector):
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot()
        own = [(g.name, key, g.help) for g, key in objectives.gauges()]
        for name, key, text in GAUGES + own:
            if snap.get(key) is not None:
                yield GaugeMetricFamily(name, text, value=snap[key])
        slow = GaugeMetricFamily(
            "ftjob_straggler_step_seconds",
            "Own step time of each rank named a straggler (runPolicy.stragglerMargin).",
            labels=["rank", "node"],
        )
        for s in snap.get("stragglers") or []:
            slow.add_metric([str(s["rank"]), str(s["node"])], s["stepSeconds"])
        yield slow
        yield GaugeMetricFamily(
            "ftjob_stragglers",
            "Ranks named stragglers now.",
            value=len(snap.get("stragglers") or []),
        )
        phase = GaugeMetricFamily("ftjob_phase", "1 for the job's current phase.", labels=["phase"])
        for p in PHASES:
            phase.add_metric([p], int(snap.get("phase") == p))
        yield phase


class TrainerMetrics:
    """One registry per Progress (never the process-global one: tests build several)."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_Snapshot(snapshot))
        self.step_seconds = Histogram(
            "ftjob_step_seconds",
            "Wall time of one optimizer step on rank 0 (forward, backward, update).",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)
