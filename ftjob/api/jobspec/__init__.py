"""The FineTuneJob spec: the one source of truth for the API.

The CRD schema (``ftjob crd``), ``ftjob validate``, the operator and the trainer all read
these classes. Each field's docstring becomes its ``kubectl explain`` text. Parse a spec with
:func:`parse_spec`; it raises :class:`~ftjob.api.schema.SpecError` naming every bad field.

The spec lives in modules by concern: ``model``, ``data``, ``method``, ``training`` (with the
objectives' settings), ``resources`` (parallelism, network), ``scheduling``, ``checkpoint``,
``output``, ``storage``, ``tracking``, ``run_policy`` (budget, plan, preflight) and ``env``
(secrets, image pull secrets); ``fields`` holds what several of them share, and ``job`` the
FineTuneJobSpec that gathers them, with the rules across them and the parse functions. This
package names the job-level API: import a concern's classes from its module.
"""

from ftjob.api.jobspec.job import (
    API_VERSION,
    DEFAULT_IMAGE,
    DOCUMENT_KEYS,
    GROUP,
    KIND,
    NAME_HINT,
    NAME_MAX,
    NAME_PATTERN,
    PLURAL,
    VERSION,
    FineTuneJobSpec,
    ineffective,
    parse_resource,
    parse_spec,
    validate_update,
)
from ftjob.api.schema import SpecError

__all__ = [
    "API_VERSION",
    "DEFAULT_IMAGE",
    "DOCUMENT_KEYS",
    "GROUP",
    "KIND",
    "NAME_HINT",
    "NAME_MAX",
    "NAME_PATTERN",
    "PLURAL",
    "VERSION",
    "FineTuneJobSpec",
    "SpecError",
    "ineffective",
    "parse_resource",
    "parse_spec",
    "validate_update",
]
