"""What several of the spec's concerns share: label and DNS patterns and their hints, the
patterns of sources and relative paths, and a Secret's key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftjob.api import kubevalidation as kv
from ftjob.api.schema import api_field

DNS_LABEL = kv.DNS_LABEL
DNS_LABEL_HINT = "be a DNS label (lowercase letters, digits and '-')"
DNS_SUBDOMAIN_HINT = "be a DNS subdomain (lowercase letters, digits, '-' and '.')"
LABEL_KEY_HINT = (
    "be a label key: an optional DNS prefix and '/', then at most 63 letters, digits, '-', "
    "'_' or '.', starting and ending with a letter or digit"
)
LABEL_VALUE_HINT = (
    "be a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with "
    "a letter or digit"
)


def label_map(doc: str, max_properties: int) -> Any:
    """A map of label keys to label values (a nodeSelector, a namespace's matchLabels), checked
    as the API server checks labels."""
    return api_field(
        doc,
        factory=dict,
        max_properties=max_properties,
        key_pattern=kv.QUALIFIED_NAME,
        key_hint=LABEL_KEY_HINT,
        key_max_length=kv.QUALIFIED_NAME_MAX,
        pattern=kv.LABEL_VALUE,
        pattern_hint=LABEL_VALUE_HINT,
        max_length=63,
    )


# hf://org/name (or a legacy hf://name), s3://bucket/key-or-prefix (S3's bucket names: 3-63
# lowercase letters, digits, '.' and '-'), an absolute path, or a path relative to the job.
SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][\w.-]*(/[\w.-]+)?|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\S*)?|[^:\s]+)$"
)
SOURCE_HINT = "be hf://org/name, s3://bucket/prefix or a path (absolute on a volume, or relative)"
# Segments start with a letter, digit or '_', so '..' (and absolute paths) cannot escape the
# job's folder. RE2, which the API server uses, has no lookahead to say it more directly.
RELATIVE_PATH = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$"
RELATIVE_PATH_HINT = "be a relative path of plain names (no '..', no leading '/')"


@dataclass(kw_only=True)
class SecretKeyRef:
    """A key of a Secret in the job's namespace; its value only ever travels as a secretKeyRef."""

    name: str = api_field(
        "name of the Secret.",
        pattern=kv.DNS_SUBDOMAIN,
        pattern_hint=DNS_SUBDOMAIN_HINT,
        max_length=253,
    )
    key: str = api_field(
        "key inside the Secret.",
        "token",
        pattern=kv.CONFIG_MAP_KEY,
        pattern_hint="be a Secret key: letters, digits, '-', '_' and '.' (not '.' or '..')",
        max_length=253,
    )
