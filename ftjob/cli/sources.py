"""``ftjob validate --check-sources``: each s3:// source asked of its store, at the door.

The same listing the trainer's download starts with, with this machine's AWS credentials and
the job's storage.s3 endpoint and region: a wrong bucket, a missing key, a refused key pair or
a denied listing is named with the trainer's own words and fix in a second, not after a
cluster has scheduled the gang. An endpoint that does not answer is given 10 s of retries here
(FTJOB_S3_RETRY_SECONDS overrides it), not the trainer's two minutes.
"""

from __future__ import annotations

import os

from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.source import S3, parse
from ftjob.job.launch import s3_env

CHECK_RETRY_SECONDS = "10"


def problems(spec: FineTuneJobSpec) -> list[str]:
    """Each s3:// source of ``spec`` the store refuses, as validate prints an error."""
    from ftjob.trainer.fetch import s3, storeerrors

    saved = dict(os.environ)
    os.environ.update(s3_env(spec))
    os.environ.setdefault("FTJOB_S3_RETRY_SECONDS", CHECK_RETRY_SECONDS)
    out = []
    try:
        for field in ("model", "dataset"):
            source = parse(getattr(spec, field).source)
            if not isinstance(source, S3):
                continue
            try:
                if not s3.listing(s3.store(source.bucket), source.key):
                    raise ValueError(f"no object at {source} or under it")
            except Exception as e:  # noqa: BLE001 - storeerrors names them; the rest raise
                named = storeerrors.refused(field, source, e)
                if named is None:
                    raise
                out.append(f"spec.{field}.source: {named} (fix: {named.fix})")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return out
