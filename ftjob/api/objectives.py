"""What each training objective reports, declared once: its metrics and where each one shows.

The trainer computes them (trainer/objectives/), and everything else only reads these
declarations: the log lines and progress.json (trainer/report/progress.py), Prometheus
(report/metrics.py), the experiment trackers (report/trackers.py), the model card
(state/push.py), ``ftjob run``'s bar (cli/screen.py), status.progress (operator/status.py, and
its schema in api/status.py) and the CRD's printer columns (api/crd.py). This module is pure
(no torch) because the API layer needs it.

An objective's evaluation reports the same metrics over the eval set, kept in progress under
``eval`` + the key (rewardAccuracy -> evalRewardAccuracy). A new objective is its declaration
here with one line in :data:`OBJECTIVES`, and its trainer module with one line in
trainer/objectives/objective.py's table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gauge:
    """A Prometheus gauge read from the progress snapshot."""

    name: str
    help: str


@dataclass(frozen=True, kw_only=True)
class Metric:
    """One number an objective reports each logged step and each evaluation; None where it
    does not show."""

    key: str  # in progress.json during training
    fmt: str  # how log lines and the screen print it
    tracker: str  # the trackers' name during training (TRL's where TRL has one)
    log: str | None = None  # its label in the log line of a step
    eval_log: str | None = None  # in the log line of an evaluation
    screen: str | None = None  # on ``ftjob run``'s bar
    card: str | None = None  # in the model card: "Final eval <card>"
    gauge: Gauge | None = None
    eval_gauge: Gauge | None = None
    status: str | None = None  # the description of status.progress.<key>, which it is in
    eval_status: str | None = None  # and of status.progress.<eval key>
    column: str | None = None  # a printer column of status.progress.<key> (kubectl get -o wide)
    # Its column shows in kubectl get's default view, after Loss: where it says more than the
    # loss does (GRPO's reward).
    headline: bool = False

    def __post_init__(self):
        if self.column and not self.status:
            raise ValueError(f"{self.key}: a printer column shows a status field")

    @property
    def eval_key(self) -> str:
        return "eval" + self.key[0].upper() + self.key[1:]

    @property
    def eval_tracker(self) -> str:
        return "eval/" + self.tracker.removeprefix("train/")


@dataclass(frozen=True)
class Objective:
    """A value of training.objective, and what it reports beside the loss."""

    name: str
    metrics: tuple[Metric, ...] = ()


SFT = Objective("sft")

# Named as TRL's DPO trainer reports them to trackers; in the order of trainer/objectives/
# preference.py's sums.
DPO = Objective(
    "dpo",
    (
        Metric(key="chosenReward", fmt=".4f", tracker="train/rewards/chosen"),
        Metric(key="rejectedReward", fmt=".4f", tracker="train/rewards/rejected"),
        Metric(
            key="rewardAccuracy",
            fmt=".2f",
            tracker="train/rewards/accuracies",
            log="acc",
            eval_log="reward accuracy",
            screen="reward acc",
            card="reward accuracy",
            gauge=Gauge("ftjob_reward_accuracy", "DPO: share of the last step's pairs right."),
            eval_gauge=Gauge("ftjob_eval_reward_accuracy", "DPO: reward accuracy on the eval set."),
            status="rewardAccuracy (DPO jobs): share of the latest logged step's pairs whose "
            "chosen response got the higher reward (0-1).",
            eval_status="evalRewardAccuracy (DPO jobs): reward accuracy on the eval pairs at "
            "the latest evaluation.",
            column="Reward-Acc",
        ),
        Metric(
            key="rewardMargin",
            fmt=".4f",
            tracker="train/rewards/margins",
            log="margin",
            eval_log="margin",
            card="reward margin",
            gauge=Gauge(
                "ftjob_reward_margin", "DPO: mean chosen minus rejected reward, last step."
            ),
            eval_gauge=Gauge("ftjob_eval_reward_margin", "DPO: reward margin on the eval set."),
            status="rewardMargin (DPO jobs): mean chosen minus rejected reward of the latest "
            "logged step.",
        ),
    ),
)

# Named as TRL's GRPO trainer reports them to trackers; in the order of trainer/objectives/
# grpo.py's sums (GRPO_SUMS there). A step's loss says little in GRPO (it is near zero by
# construction when beta is 0): the reward is what shows whether the model learns.
GRPO = Objective(
    "grpo",
    (
        Metric(
            key="reward",
            fmt=".4f",
            tracker="train/reward",
            log="reward",
            screen="reward",
            card="mean reward",
            gauge=Gauge(
                "ftjob_reward", "GRPO: mean weighted reward of the last step's completions."
            ),
            status="reward (GRPO jobs): mean weighted reward of the latest logged step's "
            "completions.",
            eval_log="reward",
            eval_gauge=Gauge(
                "ftjob_eval_reward", "GRPO: mean weighted reward on the held-out prompts."
            ),
            eval_status="evalReward (GRPO jobs with held-out prompts): mean weighted reward of "
            "the latest evaluation's completions, numGenerations a held-out prompt.",
            column="Reward",
            headline=True,
        ),
        Metric(
            key="rewardStd",
            fmt=".4f",
            tracker="train/reward_std",
            log="±",
            eval_log="±",
            gauge=Gauge("ftjob_reward_std", "GRPO: standard deviation of the last step's rewards."),
            status="rewardStd (GRPO jobs): standard deviation of the latest logged step's "
            "completions' rewards (TRL's reward_std; 0: nothing to learn from).",
            eval_status="evalRewardStd (GRPO jobs with held-out prompts): standard deviation "
            "of the latest evaluation's rewards.",
        ),
        Metric(
            key="completionLength",
            fmt=".1f",
            tracker="train/completions/mean_length",
            log="len",
            gauge=Gauge("ftjob_completion_length", "GRPO: mean completion tokens, last step."),
            status="completionLength (GRPO jobs): mean tokens of the latest logged step's "
            "completions.",
            eval_status="evalCompletionLength (GRPO jobs with held-out prompts): mean tokens "
            "of the latest evaluation's completions.",
        ),
        Metric(
            key="clipRatio",
            fmt=".3f",
            tracker="train/clip_ratio/region_mean",
            log="clip",
            status="clipRatio (GRPO jobs): share of completion tokens whose probability ratio "
            "was clipped in the latest logged step.",
        ),
        Metric(
            key="clipRatioLow",
            fmt=".3f",
            tracker="train/clip_ratio/low_mean",
            status="clipRatioLow (GRPO jobs): share of completion tokens clipped at 1 - "
            "epsilon (ratio below it, advantage negative) in the latest logged step.",
        ),
        Metric(
            key="clipRatioHigh",
            fmt=".3f",
            tracker="train/clip_ratio/high_mean",
            status="clipRatioHigh (GRPO jobs): share of completion tokens clipped at 1 + "
            "epsilonHigh (ratio above it, advantage positive) in the latest logged step.",
        ),
        Metric(
            key="zeroStdRatio",
            fmt=".3f",
            tracker="train/frac_reward_zero_std",
            status="zeroStdRatio (GRPO jobs): share of the latest trained generation batch's "
            "completions in groups whose rewards do not spread (they teach nothing).",
        ),
        Metric(
            key="truncatedRatio",
            fmt=".3f",
            tracker="train/completions/clipped_ratio",
            status="truncatedRatio (GRPO jobs): share of the latest logged step's completions "
            "cut at maxCompletionLength before a stop token.",
            eval_status="evalTruncatedRatio (GRPO jobs with held-out prompts): share of the "
            "latest evaluation's completions cut at maxCompletionLength.",
        ),
        Metric(
            key="completionMinLength",
            fmt=".0f",
            tracker="train/completions/min_length",
            status="completionMinLength (GRPO jobs): tokens of the shortest completion of the "
            "latest trained generation batch.",
        ),
        Metric(
            key="completionMaxLength",
            fmt=".0f",
            tracker="train/completions/max_length",
            status="completionMaxLength (GRPO jobs): tokens of the longest completion of the "
            "latest trained generation batch.",
        ),
        Metric(
            key="terminatedLength",
            fmt=".1f",
            tracker="train/completions/mean_terminated_length",
            status="terminatedLength (GRPO jobs): mean tokens of the latest trained generation "
            "batch's completions that ended with a stop token (0 when none did).",
        ),
        Metric(
            key="terminatedMinLength",
            fmt=".0f",
            tracker="train/completions/min_terminated_length",
            status="terminatedMinLength (GRPO jobs): tokens of the shortest of them.",
        ),
        Metric(
            key="terminatedMaxLength",
            fmt=".0f",
            tracker="train/completions/max_terminated_length",
            status="terminatedMaxLength (GRPO jobs): tokens of the longest of them.",
        ),
        Metric(
            key="entropy",
            fmt=".3f",
            tracker="train/entropy",
            gauge=Gauge(
                "ftjob_entropy", "GRPO: mean entropy (nats) of the trained tokens, last step."
            ),
            status="entropy (GRPO jobs): mean entropy, in nats, of the policy's next-token "
            "distribution at the completion tokens the latest logged step trained on (at the "
            "sampling temperature; falling towards 0: the policy stops exploring).",
        ),
        Metric(
            key="kl",
            fmt=".4f",
            tracker="train/kl",
            log="kl",
            gauge=Gauge("ftjob_kl", "GRPO: mean per-token KL to the starting model, last step."),
            status="kl (GRPO jobs with beta > 0): mean per-token KL of the latest logged "
            "step's completions to the starting model.",
        ),
    ),
)

# training.objective -> its declaration: the one table every reader goes through.
OBJECTIVES: dict[str, Objective] = {o.name: o for o in (SFT, DPO, GRPO)}


def metrics() -> list[Metric]:
    """Every objective's metrics, each once (a job reports only its own objective's; the
    others are absent from its snapshot, and readers leave absent values out)."""
    out: dict[str, Metric] = {}
    for objective in OBJECTIVES.values():
        for m in objective.metrics:
            if out.setdefault(m.key, m) != m:
                raise ValueError(f"{m.key}: two objectives declare it differently")
    return list(out.values())


def keys() -> list[str]:
    """Every metric's progress keys: those of training, then those of evaluations."""
    every = metrics()
    return [m.key for m in every] + [m.eval_key for m in every]


def gauges() -> list[tuple[Gauge, str]]:
    """Each Prometheus gauge and the progress key it reads: training's, then evaluations'."""
    every = metrics()
    return [(m.gauge, m.key) for m in every if m.gauge] + [
        (m.eval_gauge, m.eval_key) for m in every if m.eval_gauge
    ]


def trackers() -> tuple[dict[str, str], dict[str, str]]:
    """The trackers' names of the progress keys: a step's, an evaluation's."""
    every = metrics()
    return {m.key: m.tracker for m in every}, {m.eval_key: m.eval_tracker for m in every}


def status() -> dict[str, str]:
    """The progress keys status.progress reports, and their descriptions."""
    every = metrics()
    return {m.key: m.status for m in every if m.status} | {
        m.eval_key: m.eval_status for m in every if m.eval_status
    }


def labelled(values: dict, where: str) -> list[str]:
    """A line's pieces: each metric with a label for ``where`` (a :class:`Metric` field:
    "log", "eval_log" or "screen") that ``values`` holds under its training key."""
    out = []
    for m in metrics():
        label = getattr(m, where)
        if label and values.get(m.key) is not None:
            out.append(f"{label} {values[m.key]:{m.fmt}}")
    return out
