"""Typed API fields: one declaration gives both the Python parser and the OpenAPI schema.

A resource type is a ``@dataclass(kw_only=True)`` whose fields are made with :func:`api_field`.
From that one declaration:

* :func:`parse` turns a plain dict (camelCase keys, as written in YAML) into the dataclass,
  collecting every problem as a :class:`FieldError` with the field path, the bad value and
  what is allowed;
* :func:`openapi` renders the structural OpenAPI v3 schema that goes into the CRD, with the
  same descriptions, bounds, enums and defaults, plus the CEL rules of each class.

Cross-field rules are :class:`Rule` objects listed in a class's ``__rules__``: a CEL
expression for the API server and a Python predicate for ``ftjob validate`` and the operator,
side by side so that a test can hold them equal.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING
from typing import Any, Literal

# A Kubernetes quantity ("16Gi", "500m", "2") as the API server accepts it.
QUANTITY_PATTERN = r"^[+]?[0-9.]+([eE][-+]?[0-9]+|[numkKMGTP]i?)?$"


_SUFFIX = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "m": 1e-3}
_SUFFIX |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def quantity(value: str | int) -> float:
    """The number a Kubernetes quantity stands for ("1100Gi", "64G", "5e9", "500m")."""
    match = re.fullmatch(r"([0-9.]+)([eE][-+]?[0-9]+)?([a-zA-Z]*)", str(value))
    if not match or match.group(3) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number = float(match.group(1) + (match.group(2) or ""))
    return number * _SUFFIX[match.group(3)]


class IntOrString(str):
    """Marker type: the API accepts an integer or a string (``x-kubernetes-int-or-string``)."""


class FreeForm(dict):
    """Marker type: an object passed through unchecked (e.g. a Kubernetes affinity)."""


@dataclasses.dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(ValueError):
    """Every problem found in one document, each naming its field."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


@dataclasses.dataclass(frozen=True)
class Rule:
    """A cross-field rule: CEL for the API server, a Python predicate for everyone else.

    ``cel`` and ``check`` see the same object (``self``) at the class where the rule is
    listed; ``field`` is the path, relative to that object, that the error points at.
    """

    cel: str
    check: Callable[[Any], bool]
    message: str
    field: str = ""
    transition: bool = False  # uses oldSelf: only evaluated on updates


def api_field(
    doc: str,
    default: Any = MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    pattern: str | None = None,
    pattern_hint: str | None = None,
    max_length: int | None = None,
    max_items: int | None = None,
    max_properties: int | None = None,
    immutable: bool = False,
    fmt: str | None = None,
    example: Any = None,
) -> Any:
    """Declare one API field: its documentation, default and constraints."""
    meta = {
        "doc": doc,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "pattern": pattern,
        "pattern_hint": pattern_hint,
        "max_length": max_length,
        "max_items": max_items,
        "max_properties": max_properties,
        "immutable": immutable,
        "format": fmt,
        "example": example,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def camel(name: str) -> str:
    head, *rest = name.rstrip("_").split("_")
    return head + "".join(part.title() for part in rest)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return repr(value).lower() if isinstance(value, bool) else repr(value)


def _range_text(meta: dict, what: str) -> str:
    lo, hi = meta["minimum"], meta["maximum"]
    if lo is not None and hi is not None:
        return f"{what} between {lo:g} and {hi:g}"
    if lo is not None:
        return f"{what} {'greater than' if meta['exclusive_minimum'] else 'of at least'} {lo:g}"
    if hi is not None:
        return f"{what} of at most {hi:g}"
    return what


# ----------------------------------------------------------------------------- parsing


def parse(cls: type, data: Any, path: str = "spec") -> Any:
    """Parse ``data`` into ``cls``; raise :class:`SpecError` listing every problem."""
    errors: list[FieldError] = []
    result = _parse_object(cls, data, path, errors)
    if not errors:
        errors.extend(check_rules(result, path))
    if errors:
        raise SpecError(errors)
    return result


def _parse_object(cls: type, data: Any, path: str, errors: list[FieldError]) -> Any:
    if not isinstance(data, dict):
        errors.append(FieldError(path, f"must be an object, got {_show(data)}"))
        return None
    hints = _hints(cls)
    known = {camel(f.name): f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            close = [k for k in known if k.lower() == str(key).lower()]
            hint = f'; did you mean "{close[0]}"?' if close else f"; allowed: {', '.join(known)}"
            errors.append(FieldError(f"{path}.{key}", f"unknown field{hint}"))
    values = {}
    for key, f in known.items():
        sub = f"{path}.{key}"
        tp, optional = _unwrap_optional(hints[f.name])
        if key not in data or (data[key] is None and optional):
            if f.default is MISSING and f.default_factory is MISSING:
                errors.append(FieldError(sub, "is required"))
            continue
        values[f.name] = _parse_value(tp, f.metadata, data[key], sub, errors)
    if any(e.path.startswith(path) for e in errors):
        return None
    return cls(**values)


def _parse_value(tp: Any, meta: dict, value: Any, path: str, errors: list[FieldError]) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _parse_object(tp, value, path, errors)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool):
            options = ", ".join(str(a) for a in allowed)
            errors.append(FieldError(path, f"must be one of {options}; got {_show(value)}"))
        return value
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(FieldError(path, f"must be true or false, got {_show(value)}"))
        return value
    if tp in (int, float):
        ok = isinstance(value, int) if tp is int else isinstance(value, (int, float))
        lo, hi = meta.get("minimum"), meta.get("maximum")
        if ok and not isinstance(value, bool):
            below = lo is not None and (
                value <= lo if meta.get("exclusive_minimum") else value < lo
            )
            if not below and not (hi is not None and value > hi):
                return float(value) if tp is float else value
        what = "an integer" if tp is int else "a number"
        errors.append(FieldError(path, f"must be {_range_text(meta, what)}, got {_show(value)}"))
        return value
    if tp in (str, IntOrString):
        if tp is IntOrString and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            errors.append(FieldError(path, f"must be a string, got {_show(value)}"))
            return value
        _check_string(meta, value, path, errors)
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            errors.append(FieldError(path, f"must be a list, got {_show(value)}"))
            return value
        limit = meta.get("max_items")
        if limit is not None and len(value) > limit:
            errors.append(FieldError(path, f"must have at most {limit} items, got {len(value)}"))
        item_meta = {"pattern": meta.get("pattern"), "pattern_hint": meta.get("pattern_hint")}
        item_meta["max_length"] = meta.get("max_length")
        return [
            _parse_value(item_tp, item_meta, v, f"{path}[{i}]", errors) for i, v in enumerate(value)
        ]
    if origin is dict or tp is FreeForm:
        if not isinstance(value, dict):
            errors.append(FieldError(path, f"must be an object, got {_show(value)}"))
            return value
        limit = meta.get("max_properties")
        if limit is not None and len(value) > limit:
            errors.append(FieldError(path, f"must have at most {limit} entries, got {len(value)}"))
        if origin is dict:
            for k, v in value.items():
                if not isinstance(v, str):
                    errors.append(FieldError(f"{path}.{k}", f"must be a string, got {_show(v)}"))
                else:
                    _check_string({"max_length": meta.get("max_length")}, v, f"{path}.{k}", errors)
            key_pattern = meta.get("pattern")
            for k in value:
                if key_pattern and not re.search(key_pattern, str(k)):
                    hint = meta.get("pattern_hint") or f"match {key_pattern}"
                    errors.append(FieldError(f"{path}.{k}", f"key must {hint}"))
        return dict(value)
    raise TypeError(f"unsupported field type {tp!r} at {path}")


def _check_string(meta: dict, value: str, path: str, errors: list[FieldError]) -> None:
    limit = meta.get("max_length")
    if limit is not None and len(value) > limit:
        errors.append(FieldError(path, f"must be at most {limit} characters, got {len(value)}"))
    pattern = meta.get("pattern")
    if pattern and not re.search(pattern, value):
        hint = meta.get("pattern_hint") or f"match {pattern}"
        errors.append(FieldError(path, f"must {hint}, got {_show(value)}"))


def check_rules(obj: Any, path: str, old: Any = None) -> list[FieldError]:
    """Evaluate the Python side of every ``__rules__`` in ``obj`` and its nested objects."""
    errors = []
    for rule in getattr(type(obj), "__rules__", ()):
        if rule.transition and old is None:
            continue
        ok = rule.check(obj, old) if rule.transition else rule.check(obj)
        if not ok:
            errors.append(FieldError(path + rule.field, rule.message))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            old_value = getattr(old, f.name, None) if old is not None else None
            errors.extend(check_rules(value, f"{path}.{camel(f.name)}", old_value))
    return errors


def check_update(old: Any, new: Any, path: str = "spec") -> list[FieldError]:
    """Problems with changing ``old`` into ``new``: immutable fields and transition rules."""
    errors = []
    for f in dataclasses.fields(new):
        sub = f"{path}.{camel(f.name)}"
        before, after = getattr(old, f.name), getattr(new, f.name)
        if f.metadata.get("immutable") and before is not None and after is not None:
            if before != after:
                errors.append(FieldError(sub, IMMUTABLE_MESSAGE))
        elif dataclasses.is_dataclass(after) and dataclasses.is_dataclass(before):
            errors.extend(check_update(before, after, sub))
    return errors


IMMUTABLE_MESSAGE = (
    "is immutable once the job exists (its checkpoints belong to this value); "
    "create a new FineTuneJob instead"
)


def to_dict(obj: Any) -> Any:
    """The dataclass back as a camelCase dict, leaving out unset optional fields."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                out[camel(f.name)] = to_dict(value)
        return out
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- OpenAPI


def openapi(cls: type, doc: str | None = None) -> dict:
    """The structural OpenAPI v3 schema of ``cls`` as a CRD wants it."""
    hints = _hints(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap_optional(hints[f.name])
        schema = _openapi_value(tp, f.metadata)
        if f.metadata.get("immutable"):
            schema.setdefault("x-kubernetes-validations", []).append(
                {"rule": "self == oldSelf", "message": IMMUTABLE_MESSAGE}
            )
        if f.default is not MISSING and f.default is not None:
            schema["default"] = f.default
        elif f.default_factory is not MISSING:
            produced = to_dict(f.default_factory())
            # An object defaults to {} so the API server fills in its fields' defaults too.
            schema["default"] = {} if dataclasses.is_dataclass(tp) else produced
        elif f.default is MISSING:
            required.append(camel(f.name))
        props[camel(f.name)] = schema
    out: dict[str, Any] = {"type": "object"}
    if doc or cls.__doc__:
        out["description"] = _clean(doc or cls.__doc__)
    out["properties"] = props
    if required:
        out["required"] = required
    rules = [r for r in getattr(cls, "__rules__", ())]
    if rules:
        out["x-kubernetes-validations"] = [_cel_rule(r) for r in rules]
    return out


def _cel_rule(rule: Rule) -> dict:
    out = {"rule": rule.cel, "message": rule.message}
    if rule.field:
        out["fieldPath"] = rule.field
    return out


def _clean(text: str) -> str:
    return " ".join(text.split())


def _openapi_value(tp: Any, meta: dict) -> dict:
    origin = typing.get_origin(tp)
    doc = _clean(meta.get("doc", "")) if meta.get("doc") else None
    if dataclasses.is_dataclass(tp):
        schema = openapi(tp)
        if doc:
            schema["description"] = doc
        return schema
    schema: dict[str, Any] = {}
    if doc:
        schema["description"] = doc
    if origin is Literal:
        schema.update(type="string", enum=list(typing.get_args(tp)))
    elif tp is bool:
        schema["type"] = "boolean"
    elif tp in (int, float):
        schema["type"] = "integer" if tp is int else "number"
        if tp is int:
            schema["format"] = "int64"
        if meta.get("minimum") is not None:
            schema["minimum"] = meta["minimum"]
            if meta.get("exclusive_minimum"):
                schema["exclusiveMinimum"] = True
        if meta.get("maximum") is not None:
            schema["maximum"] = meta["maximum"]
    elif tp is str:
        schema["type"] = "string"
        if meta.get("format"):
            schema["format"] = meta["format"]
        _string_limits(schema, meta)
    elif tp is IntOrString:
        schema["x-kubernetes-int-or-string"] = True
        _string_limits(schema, meta)
    elif origin is list:
        (item_tp,) = typing.get_args(tp)
        item_meta = {k: meta.get(k) for k in ("pattern", "max_length")}
        schema.update(type="array", items=_openapi_value(item_tp, item_meta))
        if meta.get("max_items") is not None:
            schema["maxItems"] = meta["max_items"]
    elif origin is dict:
        values: dict[str, Any] = {"type": "string"}
        if meta.get("max_length"):
            values["maxLength"] = meta["max_length"]
        schema.update(type="object", additionalProperties=values)
        if meta.get("max_properties") is not None:
            schema["maxProperties"] = meta["max_properties"]
        if meta.get("pattern"):
            # Core CEL can check map keys; OpenAPI's propertyNames is not allowed in a CRD.
            schema["x-kubernetes-validations"] = [
                {
                    "rule": f"self.all(k, k.matches('{meta['pattern']}'))",
                    "message": "every key must " + (meta.get("pattern_hint") or "match"),
                }
            ]
    elif tp is FreeForm:
        schema.update(type="object")
        schema["x-kubernetes-preserve-unknown-fields"] = True
    else:
        raise TypeError(f"unsupported field type {tp!r}")
    return schema


def _string_limits(schema: dict, meta: dict) -> None:
    if meta.get("max_length") is not None:
        schema["maxLength"] = meta["max_length"]
    if meta.get("pattern"):
        schema["pattern"] = meta["pattern"]
