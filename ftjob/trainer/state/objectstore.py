"""The S3 client of s3:// sources and exports, as the job's environment configures it.

The client is obstore (object_store's Rust S3 client): it reads the AWS SDKs' environment
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or AWS_WEB_IDENTITY_TOKEN_FILE
with AWS_ROLE_ARN; AWS_REGION; AWS_ENDPOINT_URL for an S3-compatible store; the pods get them
from spec.storage.s3) and retries a transient failure (no answer, 429, 5xx) with growing waits.
boto3 was the first choice, but botocore requires python-dateutil < 3 and kubernetes 37 >= 3:
the two cannot share one environment, and ``ftjob run`` and the operator's tests need both.
"""

from __future__ import annotations

import os
from datetime import timedelta

# How long obstore keeps retrying a transient failure of one request (no answer, 429, 5xx)
# before it gives up (StoreUnreachable); FTJOB_S3_RETRY_SECONDS overrides it.
RETRY_SECONDS = 120.0


def store(bucket: str, checksums: bool = False):
    """An obstore S3Store for ``bucket`` configured from the AWS environment; plain http is
    allowed only when the endpoint says http:// (a store on a private network or loopback).
    ``checksums``: every upload carries its SHA-256 (x-amz-checksum-sha256), which the store
    checks before it keeps a part."""
    from obstore.store import S3Store

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
    seconds = float(os.environ.get("FTJOB_S3_RETRY_SECONDS", RETRY_SECONDS))
    retry = {
        "max_retries": 50,
        "retry_timeout": timedelta(seconds=seconds),
        "backoff": {"init_backoff": timedelta(seconds=0.2), "max_backoff": timedelta(seconds=15)},
    }
    client = {"allow_http": endpoint.startswith("http://"), "connect_timeout": "5s"}
    extra = {"checksum_algorithm": "sha256"} if checksums else {}
    # Path-style requests (bucket in the path) are what S3-compatible stores on one endpoint
    # serve; AWS itself serves both.
    return S3Store(bucket, client_options=client, retry_config=retry,
                   virtual_hosted_style_request=not endpoint, **extra)  # fmt: skip
