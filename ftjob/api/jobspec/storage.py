"""storage: the object store (S3 or S3-compatible) of s3:// sources and pushes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ftjob.api.jobspec.fields import SecretKeyRef
from ftjob.api.schema import Rule, api_field


@dataclass(kw_only=True)
class S3Spec:
    """s3: the object store of s3:// sources, as the AWS SDKs are told where it is and who asks."""

    endpoint: str | None = api_field(
        "endpoint of an S3-compatible store (Ceph, SeaweedFS, MinIO, R2, GCS's S3 interface), "
        "http(s)://host[:port]; unset: AWS (becomes AWS_ENDPOINT_URL).",
        None,
        pattern=r"^https?://[^\s/]+/?$",
        pattern_hint="be http(s)://host[:port], e.g. https://s3.example.com",
        max_length=253,
    )
    region: str | None = api_field(
        "region of the bucket (becomes AWS_REGION; S3-compatible stores take any).",
        None,
        pattern=r"^[a-z0-9-]+$",
        pattern_hint="be a region name like us-east-1",
        max_length=64,
    )
    access_key_id: SecretKeyRef | None = api_field(
        "accessKeyId: the Secret key holding the access key id (becomes AWS_ACCESS_KEY_ID). "
        "Unset: the pods' own AWS environment (a web identity token file, as EKS's IAM roles "
        "for service accounts give).",
        None,
    )
    secret_access_key: SecretKeyRef | None = api_field(
        "secretAccessKey: the Secret key holding the secret (becomes AWS_SECRET_ACCESS_KEY).",
        None,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.accessKeyId) == has(self.secretAccessKey)",
            "accessKeyId and secretAccessKey come together: set both (a key pair) or neither",
            ".accessKeyId",
        ),
    )


@dataclass(kw_only=True)
class StorageSpec:
    """storage: object stores the job reads sources from."""

    s3: S3Spec = api_field("s3: the store of s3:// sources.", factory=S3Spec)
