"""Push the export, with a model card, to each destination ``output.push`` lists: the Hugging
Face Hub (``hf://org/name``), an s3:// prefix (``s3://bucket/prefix``, :mod:`ftjob.trainer.
state.s3upload`), or both; when ``output.promoteWhen`` holds of the final evaluation, for all of
them at once.

After a successful export, rank 0 creates the repository (private unless ``output.private:
false``; an existing one keeps its visibility) and uploads the export (:func:`layout`) and a
``README.md`` model card in one commit, with huggingface_hub's own API (``HfApi.create_repo``,
``HfApi.create_commit``). The token is ``HF_TOKEN`` (``spec.secrets.huggingFaceToken``).

A failed upload fails the job as ``PushFailed`` (retryable), its message naming the
destination (:func:`destination`) and its fix that destination's: the export and the job
folder's record stay, so the next attempt -- a new gang, an in-place restart or ``ftjob run``
again -- finds the job trained (:func:`ftjob.job.folder.finished`) and only pushes. Each
destination's push that completed is recorded in ``<job folder>/pushed.json`` (:func:`ftjob.
job.folder.record_push`) and in progress (``pushedTo``, a list); a failed one leaves the others'
records, so the next attempt uploads only where it is not done; a job trained and pushed
everywhere does nothing more.

    HF_TOKEN=hf_... ftjob run job.yaml      # with output.push: [hf://my-org/my-model]
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ftjob import __version__
from ftjob.api import objectives, promotion
from ftjob.api.contract import PUSH_FAILED, TrainerError
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.schema import to_dict
from ftjob.api.source import Hub, parse
from ftjob.job import folder as jobfolder
from ftjob.trainer.state import s3upload
from ftjob.trainer.state.export import base_name

# How long the other ranks wait for rank 0's upload: an upload of a large model takes far
# longer than network.collectiveTimeoutSeconds allows any training collective.
UPLOAD_WAIT = datetime.timedelta(hours=24)
# While uploading, rank 0 reports every so often, so that the operator's stall clock
# (runPolicy.stallTimeoutSeconds) sees a live rank, not a hung one.
ALIVE_EVERY_SECONDS = 30.0
CARD = "README.md"
FIX = (
    "check that HF_TOKEN (spec.secrets.huggingFaceToken) may write to spec.output.push and "
    "that the Hub can be reached, then run the job again: it pushes without training again"
)
S3_FIX = (
    "check that the key pair (spec.storage.s3; AWS_ACCESS_KEY_ID on this machine) may write "
    "(s3:PutObject) under spec.output.push and that the store answers, then run the job again: "
    "it uploads without training again"
)


def repo_id(push: str) -> str:
    """What a reader loads the export by: the Hub's org/name, else the destination itself."""
    found = parse(push)
    return found.repo if isinstance(found, Hub) else push


def destination(push: str) -> str:
    """PURE: the destination as a failure names it: "the Hub repository hf://org/name", "the
    S3 prefix s3://bucket/prefix"."""
    kind = "the Hub repository" if isinstance(parse(push), Hub) else "the S3 prefix"
    return f"{kind} {push}"


def push(spec: FineTuneJobSpec, job_dir: Path, out: Path, d, report) -> None:
    """Upload the export to each destination of ``output.push`` where it is not yet done
    (collective: rank 0 uploads, every rank raises the same PushFailed if one failed)."""
    if not spec.output.push:
        return
    # The other ranks wait for the upload in a gloo group of their own (CPU objects), with a
    # timeout as long as an upload may take. Made before the upload: making it is a collective
    # too, which would otherwise wait out the gang's collective timeout.
    group = dist.new_group(backend="gloo", timeout=UPLOAD_WAIT) if d.world_size > 1 else None
    failed = _push_all(spec, job_dir, out, report) if d.is_main else None
    if group is not None:
        agreed = [failed]
        dist.broadcast_object_list(agreed, src=0, group=group)
        failed = agreed[0]
        dist.destroy_process_group(group)
    if failed is not None:
        message, where = failed
        fix = FIX if isinstance(parse(where), Hub) else S3_FIX
        raise TrainerError(message, reason=PUSH_FAILED, where="spec.output.push", fix=fix)


def _push_all(spec: FineTuneJobSpec, job_dir: Path, out: Path, report) -> tuple[str, str] | None:
    """Each destination not yet pushed, in order, once promotion allows; the first failure's
    words and destination (the ones pushed before it stay recorded), or None."""
    recorded = jobfolder.read(job_dir) or {}
    pending = jobfolder.pending_pushes(spec, job_dir, recorded)
    _report_recorded(spec, job_dir, report, said=not pending)
    if not pending:
        return None
    promoted = _promotion(spec, job_dir, report)
    if promoted is not None and promoted.startswith("not"):
        # Decided once: the records answer a rerun, which pushes nothing either.
        for where in pending:
            jobfolder.record_push(job_dir, spec, recorded, where, promotion=promoted)
        report.log(f"not pushed to {', '.join(pending)}: {promoted}")
        return None
    report.phase("pushing")
    for where in pending:
        try:
            _push_one(spec, job_dir, out, report, where, recorded, promoted)
        except Exception as e:  # noqa: BLE001 - every failure is named, agreed and raised
            words = f"{type(e).__name__}: {e}"
            return f"the push to {destination(where)} failed: uploading {out}: {words}", where
        _report_recorded(spec, job_dir, report, said=False)
    return None


def _report_recorded(spec: FineTuneJobSpec, job_dir: Path, report, said: bool) -> None:
    """Progress says where the export is (pushedTo, in output.push's order) and the promotion
    recorded; ``said``: the log says so too (a rerun with nothing left to push)."""
    done = jobfolder.pushed(job_dir)
    records = [done[w] for w in spec.output.push or [] if w in done]
    urls = [r["commitUrl"] for r in records if r.get("commitUrl")]
    promoted = next((r["promotion"] for r in records if r.get("promotion")), None)
    report.update(pushedTo=urls or None, promotion=promoted)
    if said:
        report.log(f"already pushed to {', '.join(urls)}" if urls else f"not pushed: {promoted}")


def _push_one(spec, job_dir, out, report, where: str, recorded, promoted) -> None:
    """The export and its card to one destination, then its record."""
    import huggingface_hub  # only a job that pushes pays for the import (the card needs it)

    huggingface_hub.utils.disable_progress_bars()  # pod logs are not terminals: ours say it

    dest = parse(where)
    if isinstance(dest, Hub) and huggingface_hub.get_token() is None:
        raise RuntimeError("no Hub token: HF_TOKEN is not set (spec.secrets.huggingFaceToken)")
    report.log(f"pushing {out} to {where} ...")
    began = time.monotonic()
    card = model_card(spec, recorded, report.snapshot, where)
    with _alive(report, began):
        if isinstance(dest, Hub):
            commit = upload(spec, dest.repo, out, card, _message(spec, recorded))
            found = {"commitUrl": commit.commit_url, "revision": commit.oid}
        else:  # an S3 prefix: the spec's pattern lets no other destination in
            found = s3upload.upload(dest, layout(spec, out), card, report.log)
    jobfolder.record_push(job_dir, spec, recorded, where, **found, promotion=promoted)
    report.log(
        f"pushed the export to {where} in {time.monotonic() - began:.0f} s: {found['commitUrl']}"
    )


def _promotion(spec: FineTuneJobSpec, job_dir: Path, report) -> str | None:
    """output.promoteWhen decided with the final evaluation's numbers, as status says it
    ("promoted: evalLoss 1.62 < 1.8"); None when the job sets no condition."""
    if not spec.output.promote_when:
        return None
    held, words = promotion.decide(spec.output.promote_when, final_evaluation(job_dir))
    said = f"{'promoted' if held else 'not promoted'}: {words}"
    report.update(promotion=said)
    report.log(f"output.promoteWhen {spec.output.promote_when!r}: {said}")
    return said


def final_evaluation(job_dir: Path) -> dict[str, Any]:
    """The job's last evaluation as progress.jsonl recorded it (a restarted trainer that only
    pushes has evaluated nothing itself); empty when it has none."""
    try:
        lines = jobfolder.JobFolder(job_dir).history.read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if row.get("event") == "eval":
            return row
    return {}


def upload(spec: FineTuneJobSpec, repo: str, out: Path, card: str, message: str):
    """Create the Hub repository ``repo`` (org/name; if missing) and commit the export
    (:func:`layout`) and the card in one commit; the CommitInfo (commit_url, oid)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()
    api.create_repo(repo, repo_type="model", private=spec.output.private, exist_ok=True)
    ops = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
        for name, path in layout(spec, out).items()
    ]
    ops.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))
    return api.create_commit(repo, ops, commit_message=message, repo_type="model")


def layout(spec: FineTuneJobSpec, out: Path) -> dict[str, Path]:
    """Path in the repository -> file of the export. The export as it is (a full model, or an
    adapter), except that an adapter job with ``mergeAdapter`` puts the merged model at the
    root and the adapter in ``adapter/``: ``AutoModelForCausalLM.from_pretrained(repo)`` then
    loads the merged model (transformers reads a root adapter_config.json as "load the base,
    then this adapter", even when asked for a subfolder). The export's own README.md (peft
    writes one) gives way to the card."""
    files = {p.relative_to(out).as_posix(): p for p in sorted(out.rglob("*")) if p.is_file()}
    if spec.method.type != "full" and spec.output.merge_adapter:
        merged = {k.removeprefix("merged/"): p for k, p in files.items() if k.startswith("merged/")}
        adapter = {f"adapter/{k}": p for k, p in files.items() if not k.startswith("merged/")}
        files = merged | adapter
    return {k: p for k, p in files.items() if k not in (CARD, f"adapter/{CARD}")}


def _message(spec: FineTuneJobSpec, recorded: dict[str, Any]) -> str:
    name = (recorded.get("metadata") or {}).get("name", "job")
    steps = recorded.get("trainedSteps")
    return f"ftjob {__version__}: {name}, {spec.method.type} fine-tune, {steps} steps"


class _alive:
    """Report ``pushSeconds`` every ALIVE_EVERY_SECONDS while the upload runs."""

    def __init__(self, report, began: float):
        self.report, self.began, self.stop = report, began, threading.Event()
        self.thread = threading.Thread(target=self._run, name="ftjob-push-alive", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(ALIVE_EVERY_SECONDS):
            self.report.update(pushSeconds=round(time.monotonic() - self.began))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


# ------------------------------------------------------------------------------ the card


def model_card(
    spec: FineTuneJobSpec, recorded: dict[str, Any], snapshot: dict[str, Any], where: str = ""
) -> str:
    """The README.md the push uploads to ``where`` (default: output.push's first destination):
    huggingface_hub's card metadata (base model, data set when both are on the Hub, library,
    tags) and what the run was: base model, data source, method, hyper-parameters, final
    losses, ftjob version."""
    from huggingface_hub import ModelCard, ModelCardData

    model_src, data_src = spec.model.source, spec.dataset.source
    adapter = spec.method.type != "full"
    merged = adapter and spec.output.merge_adapter
    data = ModelCardData(
        base_model=base.repo if isinstance(base := parse(model_src), Hub) else None,
        datasets=[ds.repo] if isinstance(ds := parse(data_src), Hub) else None,
        library_name="peft" if adapter and not merged else "transformers",
        pipeline_tag="text-generation",
        tags=["ftjob", spec.method.type, *(["lora"] if adapter else []), *_objective_tags(spec)],
    )
    target = where or (spec.output.push or [""])[0]
    repo, steps = repo_id(target), recorded.get("trainedSteps")
    lines = [
        f"# {parse(target).name}",
        "",
        f"Fine-tuned with [ftjob](https://github.com/ftjob/ftjob) {__version__}.",
        "",
        f"- **Base model:** `{model_src}`"
        + (f" (revision `{spec.model.revision}`)" if spec.model.revision else ""),
        f"- **Data:** `{data_src}` (format {spec.dataset.format})",
        f"- **Method:** {_method(spec)}",
        f"- **Steps:** {steps}",
        f"- **Final train loss:** {_num(snapshot.get('loss'))}",
        f"- **Final eval loss:** {_num(snapshot.get('evalLoss'))}",
        *_objective_lines(spec, snapshot),
        "",
        "## Hyper-parameters",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {k} | {_cell(v)} |" for k, v in _hyper(spec).items()),
        "",
        "## Use",
        "",
        "```python",
        *_usage(spec, repo),
        "```",
        "",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)).content


def _objective_tags(spec: FineTuneJobSpec) -> list[str]:
    return [spec.training.objective] if spec.training.objective != "sft" else []


def _objective_lines(spec: FineTuneJobSpec, snapshot: dict[str, Any]) -> list[str]:
    """The objective's own outcome (api/objectives.py; DPO: how often the trained model
    prefers the chosen response, and by how much): on the held-out data, or without an
    evaluation on the last logged step's."""
    card = [m for m in objectives.OBJECTIVES[spec.training.objective].metrics if m.card]
    held_out = any(snapshot.get(m.eval_key) is not None for m in card)
    split = "eval" if held_out else "train"
    return [
        f"- **Final {split} {m.card}:** {_num(snapshot.get(m.eval_key if held_out else m.key))}"
        for m in card
    ]


def _method(spec: FineTuneJobSpec) -> str:
    dpo, grpo = spec.training.dpo_settings(), spec.training.grpo_settings()
    what = _weights(spec)
    if dpo:
        return f"{what}, trained by DPO on preference pairs (beta {dpo.beta}, {dpo.loss_type} loss)"
    if grpo:
        rewards = ", ".join(r.name or r.type for r in grpo.rewards)
        return (
            f"{what}, trained by GRPO on its own completions ({grpo.num_generations} a prompt, "
            f"{grpo.loss_type} loss, beta {grpo.beta}; rewards: {rewards})"
        )
    return what


def _weights(spec: FineTuneJobSpec) -> str:
    m = spec.method
    if m.type == "full":
        return "full fine-tune"
    lora = m.lora_settings()
    what = (
        f"{m.type.upper() if m.type == 'qlora' else 'LoRA'} adapter (r {lora.r}, alpha "
        f"{lora.alpha}, dropout {lora.dropout}, target modules {_cell(lora.target_modules)})"
    )
    if spec.output.merge_adapter:
        return f"{what}, merged into the base model (at the root; the adapter in `adapter/`)"
    return what


def _hyper(spec: FineTuneJobSpec) -> dict[str, Any]:
    fields = to_dict(spec)
    out = {f"training.{k}": v for k, v in (fields.get("training") or {}).items()}
    data = fields.get("dataset") or {}
    out |= {f"dataset.{k}": data[k] for k in ("maxSeqLength", "packing") if k in data}
    out["global batch (sequences per step)"] = spec.global_batch_size
    return {k: v for k, v in out.items() if v is not None}


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value).replace("|", "\\|")


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "n/a"


def _usage(spec: FineTuneJobSpec, repo: str) -> list[str]:
    if spec.method.type == "full":
        return [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{repo}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
        ]
    if not spec.output.merge_adapter:
        return [
            "from peft import AutoPeftModelForCausalLM",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo}")',
        ]
    base = base_name(spec.model.source)
    return [
        "from transformers import AutoModelForCausalLM",
        f'model = AutoModelForCausalLM.from_pretrained("{repo}")  # the merged model',
        "# or the adapter on the base model:",
        "from peft import PeftModel",
        f'base = AutoModelForCausalLM.from_pretrained("{base}")',
        f'model = PeftModel.from_pretrained(base, "{repo}", subfolder="adapter")',
    ]
