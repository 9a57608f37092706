"""Group relative policy optimization (training.objective grpo): the objective that generates.

Each generation batch (every ``numIterations`` optimizer steps) takes the next prompts of the
run's order (:class:`Rollouts`, a pure function of the step like data.Sampler), and each
rank samples its share of the completions, ``numGenerations`` per prompt, from the policy as
it is (trainer/objectives/generate.py). Rewards score them on the rank that sampled them; the
scores are gathered so that every rank normalises each prompt's group alike; the loss is
trainer/objectives/grpo_loss.py's, TRL's, through the chunked head (loss.token_logps).

The sampler's generator is seeded from (seed, generation batch, rank): a resumed run samples
the completions the first run did from the same weights. A checkpoint taken inside a
generation batch (numIterations > 1: its completions came from weights it no longer holds)
keeps the batch itself, per rank (:meth:`Grpo.held`), and the resumed run trains on it.

A step's micro-batches (:class:`Rolled`) are prompt + completion rows, packed as any batch
(data.collate), with each completion's advantage, and its log-probabilities when sampled
(numIterations > 1) and under the reference (beta > 0: trainer/objectives/kl_reference.py, the
network with its adapters off or, for a full fine-tune, a frozen copy of the starting model).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from ftjob.api import objectives
from ftjob.api.contract import BAD_SPEC, TrainerError
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.jobspec.training import GrpoSpec
from ftjob.job.folder import JobFolder
from ftjob.trainer.data import batches as data
from ftjob.trainer.data.branches import branched
from ftjob.trainer.gang import termination
from ftjob.trainer.model.parallel import sharded_on
from ftjob.trainer.objectives import grpo_loss, kl_reference
from ftjob.trainer.objectives.generate import KvSampling, Sampling, stop_tokens
from ftjob.trainer.objectives.loss import model_inputs, span_view, token_logps

if TYPE_CHECKING:  # imported where used: rewards start processes, transformers is heavy
    from transformers import PreTrainedTokenizerBase

    from ftjob.trainer.rewards import Rewards

# The metric sums of a micro-batch, in this order (step_metrics reads them), then each reward
# function's sum, sum of squares and count of the completions it applied to.
SUMS = ("reward", "rewardSquares", "scored", "tokens", "completions", "clipped", "kl",
        "clippedLow", "clippedHigh", "truncated", "trained", "entropy")  # fmt: skip
SAMPLES_PER_LOG = 4  # completions written to the job folder's completions.jsonl per log step


class Rollouts:
    """Which prompt each completion of a (step, micro-batch, rank) completes.

    Generation batch g = step // numIterations takes prompts g·P .. (g+1)·P - 1 of the run's
    order (one permutation per epoch, data.Sampler's), P = completions per step /
    numGenerations; completion k of the batch completes prompt k // numGenerations, and rank r's
    micro-batch m holds completions (r·accumulation + m)·microBatch onwards."""

    def __init__(self, n: int, seed: int, world: int, micro: int, accumulation: int,
                 generations: int, iterations: int):  # fmt: skip
        self.world, self.micro, self.accumulation = world, micro, accumulation
        self.generations, self.iterations = generations, iterations
        self.prompts = world * micro * accumulation // generations
        self.n = n
        self._order = data.Sampler(n, seed, 1, self.prompts, 1)

    def steps_for(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * self.n / self.prompts)) * self.iterations

    def epoch(self, step: int) -> float:
        return math.ceil(step / self.iterations) * self.prompts / self.n

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        prompts = self._order.indices(step // self.iterations, 0, 0)
        start = (rank * self.accumulation + micro) * self.micro
        return [prompts[k // self.generations] for k in range(start, start + self.micro)]


@dataclass(frozen=True)
class Prompts:
    """A micro-batch's prompts, one row per completion to sample (Prefetch collates them)."""

    rows: list[dict]

    def pin(self) -> Prompts:
        return self


@dataclass(frozen=True)
class Rolled:
    """A micro-batch of sampled completions, ready for the loss."""

    # Prompt + completion sequences (a prompt's later completions may branch off its first:
    # sequences()); labels: the completions' tokens; spans: completion i is sequence i.
    batch: data.Batch
    completions: list[list[int]]  # each completion's ids (what a checkpoint keeps)
    lengths: list[int]  # each completion's tokens (host ints)
    advantages: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B] weighted sums (NaN where no reward applied)
    scores: torch.Tensor  # [B, F] each reward function's (NaN where it does not apply)
    old: torch.Tensor | None = None  # [B, C] log-probabilities when sampled (numIterations > 1)
    ref: torch.Tensor | None = None  # [B, C] under the reference (beta > 0)

    @property
    def tokens(self) -> int:
        return self.batch.tokens

    @property
    def attention_sq(self) -> int:
        return self.batch.attention_sq

    @property
    def shared(self) -> int:
        return self.batch.shared


@dataclass
class Grpo:
    """GRPO with TRL's settings and loss; ``rewards`` are built before training."""

    settings: GrpoSpec
    seed: int
    prompt_field: str
    log_every: int
    unit: str = "prompts"
    # A prompt's completions share its row, its tokens run once (model.attention sdpa: the
    # trainer's packed attention, which alone reads shared prefixes).
    shared: bool = False
    declared: ClassVar[objectives.Objective] = objectives.GRPO
    rewards: Rewards | None = None  # built by attach(), with the tokenizer
    samples: Path | None = None  # the job folder's completions.jsonl (rank 0)
    engine: Sampling | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    log: Callable[[str], None] = print
    reference: kl_reference.Reference | None = None  # beta > 0: set by before_training
    _held: tuple[int, list[Rolled]] | None = field(default=None, repr=False)
    # Of the newest generation batch, over every rank's completions, until a log step reports
    # it (then {}): its share in groups whose rewards do not spread and its lengths
    # (grpo_loss.lengths), as TRL logs them at generation ({} after a resume inside a batch,
    # until the next one is sampled).
    _generated: dict[str, float] = field(default_factory=dict, repr=False)
    _restored: dict | None = field(default=None, repr=False)  # held(), read from a checkpoint

    @classmethod
    def of(cls, spec: FineTuneJobSpec) -> Grpo:
        return cls(
            settings=spec.training.grpo_settings(),
            seed=spec.training.seed,
            prompt_field=spec.dataset.prompt_field,
            log_every=spec.training.log_every,
            shared=spec.model.attention == "sdpa",
        )

    @property
    def clip(self) -> grpo_loss.Clip:
        s = self.settings
        return grpo_loss.Clip(s.loss_type, s.epsilon, s.upper, s.beta, s.max_completion_length,
                              sequence=s.importance_sampling_level == "sequence")  # fmt: skip

    def sampler(self, n: int, spec: FineTuneJobSpec, world: int) -> Rollouts:
        t, s = spec.training, self.settings
        return Rollouts(n, t.seed, world, t.micro_batch_size, spec.accumulation,
                        s.num_generations, s.num_iterations)  # fmt: skip

    def collate(self, rows: list[dict], pad_id: int) -> Prompts:
        return Prompts(rows)

    def count(self, batch: Rolled) -> int:
        return grpo_loss.count(self.settings.loss_type, self._trained(batch),
                               self.settings.max_completion_length)  # fmt: skip

    def _trained(self, batch: Rolled) -> list[int]:
        """Each completion's tokens the loss takes: all of them, or none of one cut at the
        length limit under maskTruncatedCompletions (TRL zeroes its completion mask)."""
        if not self.settings.mask_truncated_completions:
            return batch.lengths
        cut = self._cut(batch.completions)
        return [0 if c else n for n, c in zip(batch.lengths, cut, strict=True)]

    def _cut(self, completions: list[list[int]]) -> list[bool]:
        """Which completions were cut at maxCompletionLength: no stop token at their end
        (a completion ends at its first)."""
        return [not c or c[-1] not in self.engine.eos for c in completions]

    def before_training(self, spec, net, ds: data.Data, d, log, folder: Path) -> None:
        """The rewards (a user's function is imported here: a bad one fails before any step),
        the sampling engine, the reference (beta > 0) and, on rank 0, where sampled
        completions go."""
        from ftjob.trainer.model import load as model
        from ftjob.trainer.rewards import Rewards

        self.rewards = Rewards(
            self.settings.rewards, Path(os.environ.get("FTJOB_SOURCE_ROOT", "."))
        )
        # A reward reading a field the records lack fails here, not at the first step.
        self.rewards.check(json.loads(ds.rows([0])[0]["record"]))
        self.tokenizer = model.load_tokenizer(spec)
        ends = stop_tokens(self.tokenizer, net)
        if not ends:
            raise TrainerError(
                "GRPO samples until an end-of-sequence token, and neither the tokenizer nor "
                "the model's generation config names one",
                reason=BAD_SPEC,
                fix="set eos_token in the model's tokenizer_config.json (or eos_token_id in "
                "its generation_config.json)",
                where="spec.model.source",
            )
        self.engine = KvSampling(
            max_new=self.settings.max_completion_length,
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
            eos=ends,
            pad=ds.pad_id,
            # Only shards gather in a forward; DDP's replicas sample without waiting on others.
            synced=sharded_on(net) is not None,
            top_k=self.settings.top_k,
            min_p=self.settings.min_p,
            repetition_penalty=self.settings.repetition_penalty,
        )
        self.log = log
        if self.settings.beta:
            self.reference = kl_reference.of(spec, net, d, self.tokenizer, log)
        if d.is_main:
            self.samples = JobFolder(folder).completions

    # ------------------------------------------------------------------ the rollout

    def rollout(self, net, micro: list[Prompts], step: int, d) -> list[Rolled]:
        """The step's micro-batches with their completions: sampled at the first step of a
        generation batch (or the first after a resume), reused for numIterations steps."""
        g = step // self.settings.num_iterations
        if self._held is not None and self._held[0] == g:
            return self._held[1]
        stored, self._restored = self._restored, None
        if stored is not None and stored["batch"] == g and len(stored["micro"]) == len(micro):
            parts = zip(micro, stored["micro"], strict=True)
            rolled = [self._unpacked(m.rows, part) for m, part in parts]
        else:
            if step % self.settings.num_iterations:
                self.log(
                    f"grpo: resumed inside generation batch {g} (numIterations "
                    f"{self.settings.num_iterations}) from a checkpoint that does not hold its "
                    "completions (another gang size): they are sampled again from the resumed "
                    "weights, not the ones they were first sampled from"
                )
            rolled = self._scored(net, micro, self._sample(net, micro, g, d), d, step)
        self._held = (g, rolled)
        return rolled

    def held(self) -> dict | None:
        """What a checkpoint keeps of this rank's generation batch, so that a resume inside
        it (numIterations > 1) trains on the same completions, advantages and old
        log-probabilities as the run that was not stopped: plain lists and tensors."""
        if self._held is None or self.settings.num_iterations == 1:
            return None
        micro = [
            {"completions": r.completions, "advantages": r.advantages, "rewards": r.rewards,
             "scores": r.scores, "old": r.old, "ref": r.ref}
            for r in self._held[1]
        ]  # fmt: skip
        return {"batch": self._held[0], "micro": micro}

    def restore(self, held: dict | None) -> None:
        """:meth:`held` as a checkpoint kept it; used by the first rollout after a resume."""
        self._restored = held

    def _unpacked(self, rows, part: dict) -> Rolled:
        rolled = self._assembled(rows, part["completions"], part["advantages"], part["rewards"],
                                 part["scores"])  # fmt: skip
        return replace(rolled, old=part["old"], ref=part["ref"])

    def _sample(self, net, micro: list[Prompts], g: int, d) -> list[list[list[int]]]:
        """Each micro-batch's completions, from a generator seeded by (seed, generation batch
        g, rank); g = -1: the evaluation's, the same at every evaluation."""
        generator = torch.Generator(device=d.device)
        generator.manual_seed(((self.seed * 1_000_003 + g) * 4099 + d.rank) % 2**63)
        return [
            self.engine.complete(net, [r["prompt_ids"] for r in m.rows], generator) for m in micro
        ]

    def _scored(self, net, micro, completions, d, step: int | None = None) -> list[Rolled]:
        """Micro-batches ready for the loss: scored, their advantages among every rank's
        completions. A training step's (``step``) also sets what the generation batch logs
        (:attr:`_generated`) and writes a few completions to the job folder; an
        evaluation's (None) does neither."""
        rows = [r for m in micro for r in m.rows]
        done = [c for part in completions for c in part]
        texts = self.tokenizer.batch_decode(done, skip_special_tokens=True)
        records = [json.loads(r["record"]) for r in rows]
        prompts = [rec.get(self.prompt_field) for rec in records]
        every, lengths = self._gathered(prompts, texts, records, done, d)
        generations, scale = self.settings.num_generations, self.settings.scale_rewards
        adv, summed = grpo_loss.advantages(every, self.rewards.weights, generations, scale)
        mine = slice(d.rank * len(rows), (d.rank + 1) * len(rows))
        if step is not None:
            self._generated = {
                "zeroStdRatio": grpo_loss.zero_spread(summed, generations, scale),
                **grpo_loss.lengths(lengths[:, 0], lengths[:, 1].bool()),
            }
            if self.samples is not None and (step + 1) % self.log_every == 0:
                self._write_samples(step + 1, prompts, texts, every[mine], summed[mine])
        adv, summed, scores = adv[mine], summed[mine], every[mine]
        out, at = [], 0
        for m, part in zip(micro, completions, strict=True):
            n = len(part)
            mine = slice(at, at + n)
            out.append(self._rolled(net, m.rows, part, adv[mine], summed[mine], scores[mine], d))
            at += n
        return out

    def _gathered(self, prompts, texts, records, done, d) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's scores [N, F] and completions' (tokens, cut at the limit) [N, 2], in
        rank order: groups span ranks, and every rank normalises each group alike. A reward
        that fails on one rank fails the step on all of them at once (a last column says
        which failed), instead of leaving the others waiting in the next collective until it
        times out."""
        error = None
        try:
            scores = self.rewards.score(prompts, texts, records, done).to(torch.float32)
        except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
            error, scores = e, torch.zeros((len(texts), len(self.rewards.names)))
        ends = zip(done, self._cut(done), strict=True)
        lengths = torch.tensor([[len(c), cut] for c, cut in ends], dtype=torch.float32)
        lengths = lengths.view(-1, 2)  # [N, 2] also where this rank has no completion
        failed = torch.full((len(texts), 1), float(error is not None))
        flagged = torch.cat([scores, lengths, failed], 1)
        gathered = [torch.empty_like(flagged, device=d.device) for _ in range(d.world_size)]
        dist.all_gather(gathered, flagged.to(d.device))
        every = torch.cat(gathered).cpu()
        failed = every[:, -1].view(d.world_size, -1)[:, 0].nonzero().flatten().tolist()
        if failed:
            _fail_together(error, failed[0], d)
        return every[:, :-3], every[:, -3:-1]

    def _rolled(self, net, rows, completions, adv, rewards, scores, d) -> Rolled:
        rolled = self._assembled(rows, completions, adv, rewards, scores)
        old = ref = None
        with torch.no_grad():
            if self.settings.num_iterations > 1:
                old = self.logps(net, rolled, d.device)
            if self.settings.beta:
                with self.reference.network(net) as reference:
                    ref = self.logps(reference, rolled, d.device)
        return replace(rolled, old=old, ref=ref)

    def _assembled(self, rows, completions, adv, rewards, scores) -> Rolled:
        prompts = [list(r["prompt_ids"]) for r in rows]
        return Rolled(
            batch=data.collate(sequences(prompts, completions, self.shared), self.engine.pad),
            completions=[list(c) for c in completions],
            lengths=[len(c) for c in completions],
            advantages=adv,
            rewards=rewards,
            scores=scores,
        )

    # ------------------------------------------------------------------ the loss

    def logps(self, net, b: Rolled, device, entropy: bool = False):
        """[B, C] each completion token's log-probability under ``net`` as it is, at the
        sampling temperature (0 past a completion's end); with ``entropy``, also [B, C] each
        token's entropy of the distribution it was drawn from (no gradient)."""
        on = b.batch.to(device)
        spread = torch.zeros(on.labels.shape, device=device) if entropy else None
        every = token_logps(net, model_inputs(net, on), on.labels, self.settings.temperature,
                            entropy=spread, learned=on.labelled)  # fmt: skip
        logps = span_view(every, on.spans)
        if not entropy:
            return logps
        return logps, span_view(spread, on.spans)

    def loss(self, net, batch: Rolled, device) -> tuple[torch.Tensor, torch.Tensor]:
        logps, entropy = self.logps(net, batch, device, entropy=True)
        mask = completion_mask(self._trained(batch), device, width=logps.shape[1])
        old = None if batch.old is None else batch.old.to(device)
        ref = None if batch.ref is None else batch.ref.to(device)
        terms = grpo_loss.token_terms(logps, old, ref, batch.advantages.to(device), mask,
                                      self.clip)  # fmt: skip
        r = batch.rewards  # host numbers (the rewards, the lengths): one copy to the device
        scored = ~torch.isnan(r)
        host = {
            "reward": float(r[scored].sum()), "rewardSquares": float((r[scored] ** 2).sum()),
            "scored": float(scored.sum()), "tokens": sum(batch.lengths),
            "completions": len(batch.lengths), "truncated": sum(self._cut(batch.completions)),
            "trained": sum(self._trained(batch)),
        }  # fmt: skip
        sums = torch.tensor([host.get(k, 0.0) for k in SUMS], dtype=torch.float32).to(device)
        on_device = {"clipped": terms.clipped, "kl": terms.kl, "clippedLow": terms.low,
                     "clippedHigh": terms.high, "entropy": (entropy * mask).sum()}  # fmt: skip
        for k, value in on_device.items():  # written on the device: nothing waits for them
            sums[SUMS.index(k)] = value
        return terms.loss, torch.cat([sums, _function_sums(batch.scores).to(device)])

    def step_metrics(self, sums: list[float]) -> dict[str, float]:
        """The step's clipped shares (all, at the lower and at the upper bound), KL, and the
        mean entropy of the next-token distributions over the tokens the loss took; and its
        completions' figures (:meth:`sampled`) once a generation batch: on the first log step
        after it was sampled (TRL logs them at generation), not again on the steps that reuse
        it (numIterations > 1), which would log one batch's figures as several points."""
        got = dict(zip(SUMS, sums, strict=False))
        completions, trained = got["completions"], got["trained"]
        # Shares of the tokens the loss took, or of the completions where each has one ratio.
        per = completions if self.settings.importance_sampling_level == "sequence" else trained
        out = {
            "clipRatio": got["clipped"] / max(per, 1.0),
            "clipRatioLow": got["clippedLow"] / max(per, 1.0),
            "clipRatioHigh": got["clippedHigh"] / max(per, 1.0),
            "entropy": got["entropy"] / max(trained, 1.0),
        }
        if self.settings.beta:
            out["kl"] = got["kl"] / max(trained, 1.0)
        if self._generated:  # sampled since the last log step: its batch's figures, once
            out.update(self.sampled(sums), **self._generated)
            self._generated = {}
        return out

    def sampled(self, sums: list[float]) -> dict:
        """The completions' figures from a step's sums: their mean reward and its spread
        (TRL's reward and reward_std: over every completion of the step), mean length, the
        share cut at the length limit, and each reward's mean and spread."""
        got = dict(zip(SUMS, sums, strict=False))
        n, completions = got["scored"], got["completions"]
        return {
            "reward": got["reward"] / max(n, 1.0),
            "rewardStd": _std(got["reward"], got["rewardSquares"], n) or 0.0,
            "completionLength": got["tokens"] / max(completions, 1.0),
            "truncatedRatio": got["truncated"] / max(completions, 1.0),
            "rewards": _by_function(self.rewards.names, sums[len(SUMS) :]),
        }

    def evaluate(self, net, ds: data.Data, d, micro_batch: int) -> tuple[float, dict]:
        """The held-out prompts' mean reward, its spread, each reward's and the completions'
        mean length (TRL's eval_reward & co.), and the GRPO loss of those completions: each
        prompt's group of numGenerations completions sampled from the policy as it is, in
        micro-batches of ``micro_batch``, with the evaluation's own seed (the same draws at
        every evaluation: what changes is the weights). Every rank takes as many whole
        groups, ``eval prompts // ranks`` (at least one; a remainder is left out), so that
        groups and the ranks' sampling stay in step."""
        n, generations = len(ds.eval), self.settings.num_generations
        each = max(1, n // d.world_size)
        prompts = [(d.rank * each + i) % n for i in range(each)]
        rows = [r for r in ds.rows(prompts, "eval") for _ in range(generations)]
        micro = [Prompts(rows[i : i + micro_batch]) for i in range(0, len(rows), micro_batch)]
        rolled = self._scored(net, micro, self._sample(net, micro, -1, d), d)
        total, count = torch.zeros((), device=d.device), 0
        sums = None
        net.eval()
        with torch.no_grad():
            for r in rolled:
                value, part = self.loss(net, r, d.device)
                total, count = total + value, count + self.count(r)
                sums = part if sums is None else sums + part
        net.train()
        both = torch.cat([torch.stack([total, torch.tensor(float(count), device=d.device)]), sums])
        dist.all_reduce(both)
        got = both.tolist()
        return got[0] / max(got[1], 1.0), self.sampled(got[2:])

    def _write_samples(self, step, prompts, texts, scores, summed) -> None:
        names = self.rewards.names
        with self.samples.open("a") as f:
            for i in range(min(SAMPLES_PER_LOG, len(texts))):
                each = {n: _number(scores[i, j]) for j, n in enumerate(names)}
                line = {"step": step, "prompt": prompts[i], "completion": texts[i],
                        "reward": _number(summed[i]), "rewards": each}  # fmt: skip
                f.write(json.dumps(line, ensure_ascii=False) + "\n")


def _fail_together(error: BaseException | None, first: int, d) -> None:
    """Every rank raises one error, the first failed rank's (its message names the file, the
    line and the fix), in the same words and with the reason its record would have named (a
    user's reward: BadSpec; a bug of ours: Internal): whichever rank's record the summary
    shows, and whichever rank ends first, it says the same (that rank's own chained for its
    log)."""
    said = [None] * d.world_size
    mine = None
    if error is not None:
        mine = (str(error), getattr(error, "fix", None), termination.classify(error)[0])
    dist.all_gather_object(said, mine)  # only on failure: every rank knows it failed
    message, fix, reason = said[first]
    raise TrainerError(
        f"a reward failed on rank {first}: {message}",
        reason=reason,
        fix=fix,
        where="spec.training.grpo.rewards",
    ) from (error if d.rank == first else None)


def _function_sums(scores: torch.Tensor) -> torch.Tensor:
    """[3F]: each reward function's sum, sum of squares and count over the rows it applies to."""
    applies = ~torch.isnan(scores)
    values = torch.where(applies, scores, torch.zeros_like(scores))
    return torch.stack([values.sum(0), (values**2).sum(0), applies.sum(0).float()], 1).flatten()


def _std(total: float, squares: float, n: float) -> float | None:
    """The standard deviation (Bessel's correction, as TRL's nanstd) from sums."""
    if n < 2:
        return None
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1))


def _by_function(names: list[str], sums: list[float]) -> dict[str, dict]:
    """Each reward's mean and spread over the completions it applied to (TRL's
    rewards/<name>/mean and /std); None where it applied to none."""
    out = {}
    for j, name in enumerate(names):
        total, squares, n = sums[3 * j : 3 * j + 3]
        out[name] = {"mean": total / n if n else None, "std": _std(total, squares, n)}
    return out


def _number(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v


def completion_mask(lengths: list[int], device, width: int | None = None) -> torch.Tensor:
    """[B, width] True on each row's first lengths[i] positions (width: the longest row)."""
    width = (max(lengths) if lengths else 0) if width is None else width
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(device)


def sequences(prompts: list[list[int]], completions: list[list[int]], shared: bool) -> list[dict]:
    """Prompt + completion rows for data.collate; completion i is sequence i.

    ``shared``: a run of completions of the same prompt (a group, as sampled) is one row, the
    later completions branches that read the prompt's keys and values (data.branches);
    otherwise each completion is a row of its own."""
    rows: list[dict] = []
    start = 0
    for i in range(1, len(prompts) + 1):
        if i < len(prompts) and shared and prompts[i] == prompts[start]:
            continue  # the group goes on
        rows.append(branched(prompts[start], completions[start:i], list(range(start, i))))
        start = i
    return rows
