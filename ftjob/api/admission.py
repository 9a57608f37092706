"""What the Kubernetes API server does with a custom resource, offline.

Given a CRD version's ``openAPIV3Schema`` this applies its defaults, checks the structural
schema (types, enums, bounds, patterns, unknown fields as ``kubectl --validate=strict``
reports them) and evaluates the ``x-kubernetes-validations`` CEL rules, including transition
rules against an old object. Messages follow the API server's wording. It knows nothing of
ftjob: ``ftjob validate`` uses it with our CRD, and the test API emulator uses it for any CRD.

Only core CEL is available (no Kubernetes extensions such as ``quantity()``), which is all
our rules use.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import jsonschema

from ftjob.api import celexpr, kubevalidation

_KEYWORDS_DROPPED = ("description", "default", "format", "example")


def prune_nulls(schema: dict, obj: Any) -> Any:
    """Drop every null the schema does not allow, at any depth, as the API server does before
    defaulting (apiextensions' PruneNonNullableNullsWithoutDefaults and Default): an object's
    field or a map's value that is null and not ``nullable`` is taken as unset, so its default
    then holds. A null list item is no field: it stays (a default for items replaces it), and
    the schema check refuses it. Fields the schema does not know are left to the unknown-field
    check."""
    if isinstance(obj, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        out = {}
        for key, value in obj.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if value is None and sub is not None and not sub.get("nullable"):
                continue
            out[key] = prune_nulls(sub, value) if sub is not None else value
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        return [
            copy.deepcopy(items["default"])
            if item is None and "default" in items and not items.get("nullable")
            else prune_nulls(items, item)
            for item in obj
        ]
    return obj


def apply_defaults(schema: dict, obj: Any) -> Any:
    """Fill in missing fields from ``default``s, top-down, as the API server does."""
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(sub, obj[key])
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key in obj:
            obj[key] = apply_defaults(schema["additionalProperties"], obj[key])
    elif isinstance(obj, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in obj]
    return obj


def _json_schema(schema: dict, root: bool = False) -> dict:
    """The structural schema as JSON Schema draft 4, strict about unknown fields."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in _KEYWORDS_DROPPED:
            continue
        if key == "properties":
            out[key] = {k: _json_schema(v) for k, v in value.items()}
            if root and "metadata" in value:
                # The root metadata schema may only constrain name; labels etc. stay open.
                out[key]["metadata"]["additionalProperties"] = True
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _json_schema(value)
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and not preserve and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _quote(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, (dict, list)) else f'"{type_name(value)}"'


def type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


# The other bounds in the API server's words: validator -> message of (path, value, bound).
_BOUNDS = {
    "pattern": lambda p, v, r: f"Invalid value: {_quote(v)}: {p} in body should match '{r}'",
    "minLength": lambda p, v, r: (
        f"Invalid value: {_quote(v)}: {p} in body should be at least {r} chars long"
    ),
    "minItems": lambda p, v, r: (
        f"Invalid value: {len(v)}: {p} in body should have at least {r} items"
    ),
    "maxLength": lambda p, v, r: f"Too long: may not be more than {r} bytes",
    "maxItems": lambda p, v, r: f"Too many: {len(v)}: must have at most {r} items",
    "maxProperties": lambda p, v, r: f"Too many: {len(v)}: must have at most {r} items",
}


def _schema_message(err: jsonschema.ValidationError) -> tuple[str, str]:
    """(field path, message) in the API server's words for one schema error."""
    path = _path(err.absolute_path)
    kind, rule, value = err.validator, err.validator_value, err.instance
    if kind == "additionalProperties":
        # Every extra key named, as the strict decoder does (one error line holds them all).
        extra = sorted(set(value) - set(err.schema.get("properties", {})))
        named = [f"{path}.{key}" if path else key for key in extra]
        return named[0], ", ".join(f'unknown field "{where}"' for where in named)
    if kind == "required":
        missing = err.message.split("'")[1]
        where = f"{path}.{missing}" if path else missing
        return where, "Required value"
    if kind == "enum":
        options = ", ".join(json.dumps(o) for o in rule)
        return path, f"Unsupported value: {_quote(value)}: supported values: {options}"
    if kind == "type" and rule == "integer" and isinstance(value, float):
        # A fraction where the schema says integer (format int64) is refused in Go's words.
        return path, f'Invalid value: "float64": {path} in body must be of type int64: "float64"'
    if kind in ("type", "anyOf"):
        want = rule if kind == "type" else "integer or string"
        return path, (
            f'Invalid value: "{type_name(value)}": {path} in body must be of type {want}: '
            f'"{type_name(value)}"'
        )
    if kind in ("minimum", "maximum"):
        exclusive = err.schema.get("exclusiveMinimum" if kind == "minimum" else "exclusiveMaximum")
        side = "greater than" if kind == "minimum" else "less than"
        cmp = side if exclusive else f"{side} or equal to"
        return path, f"Invalid value: {_quote(value)}: {path} in body should be {cmp} {rule}"
    if kind in _BOUNDS:
        return path, _BOUNDS[kind](path, value, rule)
    return path, err.message


def _cel_errors(schema: dict, obj: Any, old: Any, path: str) -> list[tuple[str, str]]:
    errors = []
    scope = celexpr.Scope(obj, old)
    for rule in schema.get("x-kubernetes-validations", []):
        expr = rule["rule"]
        if celexpr.uses_old(expr) and old is None:
            continue  # transition rules only run on updates where the old value exists
        failure = scope.failure(expr)
        if failure is not None:
            where = (path + rule.get("fieldPath", "")).lstrip(".") or "(object)"
            # The API server names no value in a rule's refusal ("Invalid value: <message>").
            errors.append((where, f"Invalid value: {failure or rule.get('message', expr)}"))
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key in obj:
                old_value = old.get(key) if isinstance(old, dict) else None
                errors += _cel_errors(sub, obj[key], old_value, f"{path}.{key}" if path else key)
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in obj.items():
            old_value = old.get(key) if isinstance(old, dict) else None
            errors += _cel_errors(schema["additionalProperties"], value, old_value, f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        # Items of a list are compared with the old list by position only for atomic lists.
        for i, item in enumerate(obj):
            errors += _cel_errors(schema["items"], item, None, f"{path}[{i}]")
    return errors


def _non_finite(obj: Any, path: str):
    if isinstance(obj, float) and not math.isfinite(obj):
        yield path, ("NaN" if math.isnan(obj) else "+Inf" if obj > 0 else "-Inf")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _non_finite(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _non_finite(value, f"{path}[{i}]")


def admit(schema: dict, obj: dict, old: dict | None = None) -> tuple[dict, list[str]]:
    """Default and validate ``obj`` (an update of ``old`` if given).

    Returns the defaulted object and the API server's error lines, ``field: message``;
    an empty list means the object would be accepted.
    """
    unsendable = list(_non_finite(obj, ""))
    if unsendable:
        # JSON has no NaN or Infinity: kubectl stops at encoding ("json: unsupported value").
        return obj, [
            f"{p}: Invalid value: {v}: json: unsupported value: {v}" for p, v in unsendable
        ]
    unknown = sorted(set(_unknown_fields(schema, obj, "")))
    if unknown:
        # kubectl asks for strict field validation: the decoder refuses unknown fields (those
        # the structural schema would prune) before any schema check or rule runs.
        return obj, [f'{p}: unknown field "{p}"' for p in unknown]
    obj = apply_defaults(schema, prune_nulls(schema, obj))
    if old is not None:
        old = apply_defaults(schema, prune_nulls(schema, old))
    validator = jsonschema.Draft4Validator(_json_schema(schema, root=True))
    errors = list(validator.iter_errors(obj))
    found = [_schema_message(e) for e in errors]
    found += [
        (
            "<nil>",
            f'Invalid value: "": Checked value must be of type integer with format int64 in {p}',
        )
        for p, m in found
        if 'must be of type int64: "float64"' in m
    ]
    # ObjectMeta is the API server's own: a custom resource's name is a DNS subdomain.
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    found += list(_meta_errors(meta))
    if any(e.validator in BLOCKING for e in errors):
        # A wrong type, a missing field, an unsupported or too long/many value keeps the API
        # server from running the CEL rules (apiextensions' hasBlockingErr), and it says so;
        # a bound or a pattern does not, and the rules run beside it.
        found.append(("<nil>", f"Invalid value: null: {NOT_CHECKED}"))
    else:
        found += _cel_errors(schema, obj, old, "")
    return obj, [f"{path}: {message}" for path, message in sorted(set(found))]


BLOCKING = {"type", "anyOf", "required", "enum", "maxLength", "maxItems", "maxProperties"}
NOT_CHECKED = (
    "some validation rules were not checked because the object was invalid; correct the "
    "existing errors to complete validation"
)
LABEL_VALUE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
    "'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


def _meta_errors(meta: dict):
    """ObjectMeta's errors; a label value's in the API server's own words."""
    labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
    for path, message in kubevalidation.metadata_errors({"name": "x"} | meta):
        key = path.removeprefix("metadata.labels[").removesuffix("]")
        if not (path.startswith("metadata.labels[") and "label value" in message):
            yield path, f"Invalid value: {message}"
            continue
        value = labels.get(key)
        if isinstance(value, str) and len(value) > 63:
            yield (
                "metadata.labels",
                f"Invalid value: {json.dumps(value)}: must be no more than 63 characters",
            )
        if not isinstance(value, str) or not re.fullmatch(
            r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", value
        ):
            yield "metadata.labels", f"Invalid value: {json.dumps(value)}: {LABEL_VALUE}"


def _unknown_fields(schema: dict, obj: Any, path: str):
    """The fields structural pruning drops: keys no ``properties`` names (an object where the
    schema wants a list or a scalar loses all its keys), as the strict decoder reports them."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
        "x-kubernetes-embedded-resource"
    ):
        return
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            where = f"{path}.{key}" if path else str(key)
            if path == "" and key in ("apiVersion", "kind", "metadata"):
                continue  # the API server's own: never pruned by the CRD's schema
            if key in props:
                yield from _unknown_fields(props[key], value, where)
            elif isinstance(extra, dict):
                yield from _unknown_fields(extra, value, where)
            else:
                yield where
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            yield from _unknown_fields(schema["items"], item, f"{path}[{i}]")
