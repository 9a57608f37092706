"""output: the exported model, and where it is pushed (the Hub, an s3:// prefix)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ftjob.api import contract
from ftjob.api.jobspec.fields import RELATIVE_PATH, RELATIVE_PATH_HINT
from ftjob.api.schema import Rule, api_field

# output.push: destinations, each a Hub model repository, always with its namespace (a user or
# an organization), or an s3:// prefix (a bucket name as for sources, and a prefix: never a
# bucket's root).
PUSH_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\s]*[^\s/])$"
)
PUSH_HINT = (
    "be hf://org/name, the Hub model repository to upload to, e.g. hf://my-org/my-model, or "
    "s3://bucket/prefix, e.g. s3://models/llama3-8b-guanaco"
)
# What the job's folder already holds (ftjob/api/contract.py): an export there would
# overwrite it. ([.] rather than an escape: the pattern also goes into a CEL string.)
RESERVED_OUTPUT = (
    "^("
    + "|".join(n.replace(".", "[.]") for n in contract.FOLDER_DIRS + contract.FOLDER_FILES)
    + ")(/|$)"
)


@dataclass(kw_only=True)
class OutputSpec:
    """output: the exported model, written once training has finished."""

    path: str | None = api_field(
        "path of the exported model inside the job's folder (default: model).",
        None,
        pattern=RELATIVE_PATH,
        pattern_hint=RELATIVE_PATH_HINT,
        max_length=256,
    )
    merge_adapter: bool = api_field(
        "mergeAdapter also writes the base model with the adapter merged in (lora/qlora).",
        False,
    )
    push: list[str] | None = api_field(
        "push uploads the export, with a model card, once training has finished, to each "
        "destination listed, in order: a Hugging Face Hub model repository (hf://org/name; "
        "created if missing; needs secrets.huggingFaceToken, a token that may write there), or "
        "an s3:// prefix (storage.s3's store and key pair; multipart, SHA-256 checksums, a "
        "manifest written last). A failed upload (PushFailed, naming the destination) is "
        "retried without training again, and without uploading again where it was done.",
        None,
        min_items=1,
        max_items=4,
        pattern=PUSH_PATTERN,
        pattern_hint=PUSH_HINT,
        max_length=200,
        example=["hf://my-org/llama3-8b-guanaco", "s3://models/llama3-8b-guanaco"],
    )
    promote_when: str | None = api_field(
        "promoteWhen: the push (to every destination) waits for this condition on the final "
        "evaluation's metrics, "
        "e.g. 'evalLoss < 1.8' or 'evalRewardAccuracy >= 0.7 and evalLoss < 0.6' (evalLoss, "
        "and eval + each metric of training.objective; <, <=, >, >=; joined by and). Unmet: "
        "the job succeeds unpromoted and status.progress.promotion says why, with the numbers.",
        None,
        max_length=256,
        example="evalLoss < 1.8",
    )
    private: bool = api_field(
        "private: the repository push creates is private (default); false makes it public. "
        "A repository that exists keeps its visibility.",
        True,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.push) || self.push.all(p, self.push.exists_one(q, q == p))",
            "push lists each destination once",
            ".push",
        ),
        Rule(
            f"!has(self.path) || !self.path.matches('{RESERVED_OUTPUT}')",
            f"path may not be or lie inside {', '.join(contract.FOLDER_DIRS)}, nor be "
            f"{', '.join(contract.FOLDER_FILES)}: the job's folder keeps those; use e.g. model",
            ".path",
        ),
    )
