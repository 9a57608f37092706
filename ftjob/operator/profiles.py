"""PURE: a job's FineTuneProfile as the operator applies it (api/profile.py merges).

The profiles and the namespace's labels come from the handlers' kopf indexes (watches, no
read per job); this decides which profile the job takes, the merged job the rest of the
reconcile sees, what the status records, and what refuses the job. Limits are held before
every gang: a job over them is refused before its first (``refused``), and a job over a limit
lowered since (or whose namespace its named profile no longer serves) fails when its next
gang would be made (``over``, handlers._decide), never while a gang runs. The next gang takes
the edited defaults (lifecycle treats that as any edit of what pods are made of), except the
pinned immutable sections (api/profile.py PINNED), kept as first applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftjob.api.profile import (
    NoProfile,
    NotServed,
    Profile,
    Unreadable,
    apply,
    choose,
    merge,
    parse_profile,
)
from ftjob.api.schema import SpecError


@dataclass(frozen=True)
class Taken:
    """The job with its profile applied, the status record, and why it is refused (if so)."""

    doc: dict[str, Any]
    record: dict[str, Any] | None = None  # status.profile for the gang made from ``doc``
    refused: list[str] = field(default_factory=list)
    reason: str = "OverLimit"  # the failure reason of ``refused`` or ``over``
    over: list[str] = field(default_factory=list)  # what refuses the next gang (a gang ran)
    price: float | None = None  # of a GPU-hour of the job's GPU type (the profile's prices)
    currency: str = "USD"


def take(
    doc: dict[str, Any],
    labels: dict[str, str],
    profile_docs: list[dict[str, Any]],
    old_status: dict[str, Any] | None,
    default_image: str | None = None,
) -> Taken:
    """``doc`` as the operator runs it, given the namespace's ``labels`` and every profile."""
    namespace = doc["metadata"].get("namespace") or "default"
    before = (old_status or {}).get("profile") or {}
    named = (doc.get("spec") or {}).get("profile")
    over, reason = [], "OverLimit"
    try:
        chosen = choose(named, namespace, labels, *_parsed(profile_docs))
    except NoProfile as e:  # InvalidProfile, NotServed too: refused by its class's name
        if not before:
            return Taken(doc, None, [str(e)], type(e).__name__)
        # A profile that no longer serves the namespace gives no next gang (a namespace
        # relabelled); one gone leaves the job with what it pinned.
        chosen, reason = None, type(e).__name__
        over = [str(e)] if isinstance(e, NotServed) else []
    if chosen is None:
        pinned = before.get("pinned") or {}
        kept = doc | {"spec": merge(pinned, dict(doc.get("spec") or {}))}
        return Taken(kept, before or None, reason=reason, over=over)
    pinned = before.get("pinned") if before.get("name") == chosen.name else None
    applied = apply(doc, chosen, default_image, pinned or ({} if before else None))
    found = [str(v) for v in applied.violations]
    refused, over = ([], found) if before else (found, [])
    return Taken(
        applied.doc,
        applied.record,
        refused,
        over=over,
        price=applied.price,
        currency=applied.currency,
    )


def _parsed(docs: list[dict[str, Any]]) -> tuple[list[Profile], list[Unreadable]]:
    """The profiles that parse, and those that do not. The API server checked each against
    the CRD, so one that does not is from another version of ftjob: it is not guessed at,
    and a job it would apply to is refused saying why (choose), never run without it."""
    good, bad = [], []
    for doc in docs:
        try:
            good.append(parse_profile(doc))
        except SpecError as e:
            bad.append(Unreadable.of(doc, e))
    return good, bad
