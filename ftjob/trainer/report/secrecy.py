"""Credentials masked in all a training process prints and records.

The operator hands credentials to the pods as secretKeyRefs (spec.env's valueFrom, spec.secrets,
the trackers' and the object store's keys), so the job, its ConfigMap and its pods hold names
only; the values live in the processes' environment. What a process prints becomes the pod log
and, from its last lines, the termination message (status and Events); the records it writes
reach the status too. An exception can quote a value (a URL with a password, a library's
configuration), and an object store's reply can carry a signature or an access key id.

:func:`install` (each process, first thing) masks both ways on stdout and stderr: the value of
every variable :data:`~ftjob.api.contract.SECRET_ENV` names becomes ``[NAME]``, and what
:data:`SIGNED` finds becomes ``[masked]``. :func:`mask` and :func:`masked` are the same for a
string and a record (termination records, an object store's reply before it is quoted).
"""

from __future__ import annotations

import io
import os
import re
import sys
from typing import Any

from ftjob.api.contract import SECRET_ENV

# Shorter values are not masked: "1" or "true" would be masked all over the log, and no key,
# token or password is that short.
SHORTEST = 6
# What an S3-style store or an HTTP library may quote of a request: presigned query parameters,
# an Authorization header, a URL's user:password, and AWS access key ids (AKIA.../ASIA...).
SIGNED = re.compile(
    r"(?i:(X-Amz-(?:Signature|Credential|Security-Token)=))[^&\s\"']+"
    r"|(?i:((?:Signature|AWSAccessKeyId|Credential)=))[^&\s,\"']+"
    r"|(?i:(Authorization:?\s*(?:AWS4-HMAC-SHA256|Bearer|Basic|AWS)?\s*))[^\s\"',;]+"
    r"|(?<=://)([^/\s:@]+:)[^/\s@]+(?=@)"
    r"|\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"
)


def secrets(environ: dict[str, str] | None = None) -> dict[str, str]:
    """value -> variable name, for each variable :data:`SECRET_ENV` names that is set."""
    env = os.environ if environ is None else environ
    names = [n for n in env.get(SECRET_ENV, "").split(",") if n]
    found = {env[n]: n for n in names if len(env.get(n, "")) >= SHORTEST}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))  # longest first


def mask(text: str, values: dict[str, str] | None = None) -> str:
    """``text`` without the values of secret variables and without signed parts."""
    for value, name in (secrets() if values is None else values).items():
        text = text.replace(value, f"[{name}]")
    return SIGNED.sub(lambda m: (m.group(1) or m.group(2) or m.group(3) or m.group(4) or "")
                      + "[masked]", text)  # fmt: skip


def masked(record: Any, values: dict[str, str] | None = None) -> Any:
    """``record`` (JSON-like) with every string in it masked."""
    values = secrets() if values is None else values
    if isinstance(record, str):
        return mask(record, values)
    if isinstance(record, dict):
        return {k: masked(v, values) for k, v in record.items()}
    if isinstance(record, list):
        return [masked(v, values) for v in record]
    return record


class _Masked(io.TextIOBase):
    """A text stream that masks what is written before passing it on."""

    def __init__(self, inner, values: dict[str, str]):
        self.inner, self.values = inner, values

    def write(self, text: str) -> int:
        self.inner.write(mask(text, self.values))
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def __getattr__(self, name: str):  # encoding, buffer, errors: the inner stream's
        return getattr(self.inner, name)


def install() -> None:
    """Mask what this process prints on stdout and stderr from now on (idempotent)."""
    values = secrets()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Masked):
            setattr(sys, name, _Masked(stream, values))
