"""API machinery the emulator shares with a real API server: JSON merge and JSON patches,
label and field selectors, Status errors and Table output."""

from __future__ import annotations

import copy
import datetime
from typing import Any

import aiohttp.web


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def age(stamp: str) -> str:
    then = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    seconds = int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


def status_response(code: int, reason: str, message: str, causes=None) -> aiohttp.web.Response:
    details = {"causes": causes} if causes else {}
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure"}
    body |= {"code": code, "reason": reason, "message": message, "details": details}
    return aiohttp.web.json_response(body, status=code)


class Refused(Exception):
    def __init__(self, code: int, reason: str, message: str, causes=None):
        super().__init__(message)
        self.response = status_response(code, reason, message, causes)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(doc: Any, ops: list[dict]) -> Any:
    """RFC 6902; a failed ``test`` (or a bad path) refuses the whole patch with 422."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        node = doc
        try:
            for p in parents:
                node = node[int(p)] if isinstance(node, list) else node[p]
            key: Any = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
            kind = op["op"]
            if kind == "test" and node[key] != op["value"]:
                raise Refused(422, "Invalid", f"the test of {op['path']} failed")
            if kind == "remove":
                del node[key]
            elif kind in ("add", "replace"):
                if isinstance(node, list) and kind == "add":
                    node.insert(key, op["value"])
                else:
                    node[key] = op["value"]
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise Refused(422, "Invalid", f"cannot {op['op']} {op['path']}: {e}") from e
    return doc


def selector_matches(selector: str | None, labels: dict) -> bool:
    """Equality and set-based label selectors: a=b, a==b, a!=b, a, !a, a in (x,y), a notin (x)."""
    if not selector:
        return True
    terms, depth, cur = [], 0, ""
    for ch in selector:  # split on commas outside parentheses
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur.strip())
            cur = ""
        else:
            cur += ch
    terms.append(cur.strip())
    for term in filter(None, terms):
        if " notin " in term or " in " in term:
            neg = " notin " in term
            key, values = term.split(" notin " if neg else " in ", 1)
            allowed = {v.strip() for v in values.strip().strip("()").split(",")}
            if (labels.get(key.strip()) in allowed) == neg:
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_selector_name(selector: str | None) -> str | None:
    """The name in ``metadata.name=x`` (the one field selector clients here use)."""
    for term in (selector or "").split(","):
        key, _, value = term.partition("=")
        if key.strip() == "metadata.name":
            return value.lstrip("=").strip()
    return None


def table(items: list[dict], printer: list[dict] | None) -> dict:
    """A meta.k8s.io/v1 Table, what `kubectl get` asks for: printer columns (a CRD's, or Age)."""
    columns = [{"name": "Name", "type": "string", "format": "name"}]
    if printer is None:
        printer = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    columns += [
        {"name": c["name"], "type": c["type"], "format": "", "priority": c.get("priority", 0)}
        for c in printer
    ]
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        for col in printer:
            value: Any = obj
            for part in col["jsonPath"].strip(".").split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if col["type"] == "date" and value:
                value = age(value)
            cells.append(value if value is not None else "<none>")
        meta = {
            k: obj["metadata"][k]
            for k in ("name", "namespace", "creationTimestamp")
            if k in obj["metadata"]
        }
        rows.append(
            {
                "cells": cells,
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": meta,
                },
            }
        )
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {},
        "columnDefinitions": columns,
        "rows": rows,
    }
