"""What a failed s3:// request means, named with the source, the cause and the fix.

The client (obstore) has already retried what may pass (no answer, 429, 5xx: the retry
settings in :mod:`ftjob.trainer.fetch.s3`), so a failure here is one of:

    bucket        the bucket does not exist (NoSuchBucket)         BadModel / BadData
    missing       no object at or under the prefix                 BadModel / BadData
    credentials   the key pair is unknown or wrong, or none is set BadModel / BadData
    denied        the identity may not read this bucket or key     BadModel / BadData
    unreachable   the endpoint did not answer within the retries    StoreUnreachable

The first four are permanent: the same spec and Secret fail the same way, so the job fails once
(the operator retries nothing). An endpoint that did not answer is transient: the operator
retries it with a new gang, and what was downloaded is kept (the download resumes).
"""

from __future__ import annotations

import re

from ftjob.api.contract import BAD_DATA, BAD_MODEL, STORE_UNREACHABLE, TrainerError
from ftjob.api.source import S3
from ftjob.trainer.report import secrecy

CREDENTIALS_HINT = (
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_WEB_IDENTITY_TOKEN_FILE with "
    "AWS_ROLE_ARN): spec.secrets.s3 on a cluster, this machine's environment for ftjob run"
)
# Words in the store's answer, S3's error codes first (obstore keeps them in its message).
SIGNS = (
    ("bucket", ("NoSuchBucket", "bucket does not exist")),
    (
        "credentials",
        (
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "InvalidToken",
            "ExpiredToken",
            "Unauthenticated",
            "no credentials",
            "MissingCredentials",
        ),
    ),  # fmt: skip
    ("denied", ("AccessDenied", "PermissionDenied", "Forbidden", "403")),
    ("missing", ("NoSuchKey", "NotFound", "no object at", "404")),
    (
        "unreachable",
        (
            "error sending request",
            "Connection refused",
            "connection closed",
            "timed out",
            "Timeout",
            "dns error",
            "502 Bad",
            "503 Service",
            "504 Gateway",
        ),
    ),  # fmt: skip
)


def kind(e: BaseException) -> str:
    """PURE: which of the module's causes ``e`` is ("other" when none): by S3's error code in
    the store's answer (obstore keeps it in its message: a 403 is InvalidAccessKeyId or
    AccessDenied, one PermissionDeniedError to obstore), else by the error's type. The
    request's URL is left out (its key may hold any word), and a status code counts only as
    a number of its own: a retry's "in 2.871140436s" once read as a 404."""
    text = re.sub(r"\w+://\S+", " ", f"{type(e).__name__}: {e}")
    for found, words in SIGNS:
        if any(re.search(_sign(w), text, re.IGNORECASE) for w in words):
            return found
    names = {c.__name__ for c in type(e).__mro__}
    if "PermissionDeniedError" in names:
        return "denied"
    if "UnauthenticatedError" in names:
        return "credentials"
    return "other"


def _sign(word: str) -> str:
    """The pattern of one of :data:`SIGNS`' words; one that starts with a status code does
    not match inside a longer number."""
    return rf"(?<![\d.]){re.escape(word)}(?!\d)" if word[0].isdigit() else re.escape(word)


def refused(field: str, source: S3, e: BaseException) -> TrainerError | None:
    """The TrainerError a failed download of ``source`` (``spec.<field>.source``) is, or None
    when it is none of the causes this module knows (it then raises as it came)."""
    found = kind(e)
    if found == "other":
        return None
    bucket = source.bucket
    short = secrecy.mask(" ".join(str(e).split()))[:300]  # masked before it is cut
    where, reason = f"spec.{field}.source", (BAD_MODEL if field == "model" else BAD_DATA)
    what, fix = {
        "bucket": (
            f"there is no bucket {bucket!r} at this endpoint",
            "check the bucket's name, and AWS_ENDPOINT_URL / spec.storage.s3.endpoint for an "
            "S3-compatible store (AWS_REGION for AWS)",
        ),
        "missing": (
            "no object at this key or under it as a prefix",
            f"check the key: list it with `aws s3 ls {source.under}` (a model is a "
            "prefix holding config.json and *.safetensors; a data set one file or a prefix)",
        ),
        "credentials": (
            "the store refused the credentials (an unknown or wrong key pair, or none)",
            f"set {CREDENTIALS_HINT} to a key pair the store knows",
        ),
        "denied": (
            "the store denied the request: these credentials may not read it",
            f"grant the identity s3:GetObject and s3:ListBucket on {bucket}, or set "
            f"{CREDENTIALS_HINT} to one that may",
        ),
        "unreachable": (
            "the store's endpoint did not answer, after retries",
            "check AWS_ENDPOINT_URL / spec.storage.s3.endpoint and the network, then run it "
            "again: what was downloaded is kept and the download resumes",
        ),
    }[found]
    if found == "unreachable":
        reason = STORE_UNREACHABLE
    return TrainerError(
        f"{field}.source {source}: {what} ({short})", reason=reason, where=where, fix=fix
    )
