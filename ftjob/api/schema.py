"""Typed API fields: one declaration gives both the Python parser and the OpenAPI schema.

A resource type is a ``@dataclass(kw_only=True)`` whose fields are made with :func:`api_field`.
From that one declaration:

* :func:`parse` turns a plain dict (camelCase keys, as written in YAML) into the dataclass,
  collecting every problem as a :class:`FieldError` with the field path, the bad value and
  what is allowed;
* :func:`openapi` renders the structural OpenAPI v3 schema that goes into the CRD, with the
  same descriptions, bounds, enums and defaults, plus the CEL rules of each class.

Cross-field rules are :class:`Rule` objects listed in a class's ``__rules__``, each a CEL
expression: the CRD carries it to the API server, and :func:`parse` evaluates the same text on
the parsed object, so every door refuses a spec with the same words.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING
from typing import Any, Literal

from ftjob.api import celexpr

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
    unknown: bool = False  # an unknown key: a typo, so the object holding it is suspect
    fix: str | None = None  # what to change, where the message alone does not say it

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f"; fix: {self.fix}" if self.fix else "")


class SpecError(ValueError):
    """Every problem found in one document, each naming its field."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


@dataclasses.dataclass(frozen=True)
class Rule:
    """A cross-field rule, written once in CEL: the API server evaluates it from the CRD, every
    other door (``ftjob validate``, the operator, ``ftjob run``, the trainer) on the parsed
    spec through :mod:`ftjob.api.celexpr` (:func:`check_rules`).

    ``cel`` sees the object (``self``) at the class where the rule is listed; ``field`` is the
    path, relative to that object, that the error points at. ``beyond_cel``: a check CEL cannot
    say (the reason beside the rule), which ftjob's doors run on the parsed object too.
    """

    cel: str
    message: str
    field: str = ""
    beyond_cel: Callable[[Any], bool] | None = None


def api_field(
    doc: str,
    default: Any = MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    pattern: str | None = None,
    pattern_hint: str | None = None,
    min_length: int | None = None,
    max_length: int | None = None,
    min_items: int | None = None,
    max_items: int | None = None,
    max_properties: int | None = None,
    key_pattern: str | None = None,
    key_hint: str | None = None,
    key_max_length: int | None = None,
    immutable: bool = False,
    fmt: str | None = None,
    example: Any = None,
    fixes: dict[Any, str] | None = None,
) -> Any:
    """Declare one API field: its documentation, default and constraints.

    String constraints (``pattern``, ``min_length``, ``max_length``) apply to the field's
    strings: the field itself, each item of a list, each value of a map. ``key_*`` constrain
    the keys of a map. ``fixes`` maps values the field once took (a retired name, a boolean
    that became a word) to the message that says what to write instead.
    """
    meta = {
        "doc": doc,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "exclusive_maximum": exclusive_maximum,
        "pattern": pattern,
        "pattern_hint": pattern_hint,
        "min_length": min_length,
        "max_length": max_length,
        "min_items": min_items,
        "max_items": max_items,
        "max_properties": max_properties,
        "key_pattern": key_pattern,
        "key_hint": key_hint,
        "key_max_length": key_max_length,
        "immutable": immutable,
        "format": fmt,
        "example": example,
        "fixes": fixes,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache  # a field's name, asked on every parse of every spec (issue 55's reconciles)
def camel(name: str) -> str:
    head, *rest = name.rstrip("_").split("_")
    return head + "".join(part.title() for part in rest)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
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
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ("-" if value < 0 else "") + ".inf"
    return repr(value).lower() if isinstance(value, bool) else repr(value)


def _fix(meta: dict, value: Any) -> str | None:
    """The message for a value the field no longer takes, if it has one. The type is compared
    too: 1 == True in Python, but a YAML 1 is not a YAML true."""
    for old, message in (meta.get("fixes") or {}).items():
        if type(old) is type(value) and old == value:
            return message
    return None


def _range_text(meta: dict, what: str) -> str:
    lo, hi = meta["minimum"], meta["maximum"]
    if lo is not None and hi is not None:
        if meta.get("exclusive_maximum"):
            return f"{what} of at least {lo:g} and below {hi:g}"
        return f"{what} between {lo:g} and {hi:g}"
    if lo is not None:
        return f"{what} {'greater than' if meta['exclusive_minimum'] else 'of at least'} {lo:g}"
    if hi is not None:
        return f"{what} of at most {hi:g}"
    return what


# ----------------------------------------------------------------------------- API types
#
# Each kind of API type is one class that knows both how to parse a value (collecting
# FieldErrors) and how OpenAPI describes it, so the two can never drift apart.

Errors = list[FieldError]


class _Kind:
    def parse(self, meta: dict, value: Any, path: str, errors: Errors) -> Any:
        raise NotImplementedError

    def openapi(self, meta: dict) -> dict:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _Object(_Kind):
    cls: type

    def parse(self, meta, value, path, errors):
        return _parse_object(self.cls, value, path, errors)

    def openapi(self, meta):
        return openapi(self.cls)


@dataclasses.dataclass(frozen=True)
class _Enum(_Kind):
    allowed: tuple

    def parse(self, meta, value, path, errors):
        if value not in self.allowed or isinstance(value, bool):
            fix = _fix(meta, value)
            if fix:
                errors.append(FieldError(path, f"{_show(value)} {fix}"))
                return value
            options = ", ".join(str(a) for a in self.allowed)
            errors.append(FieldError(path, f"must be one of {options}; got {_show(value)}"))
        return value

    def openapi(self, meta):
        return {"type": "string", "enum": list(self.allowed)}


class _Bool(_Kind):
    def parse(self, meta, value, path, errors):
        if not isinstance(value, bool):
            errors.append(FieldError(path, f"must be true or false, got {_show(value)}"))
        return value

    def openapi(self, meta):
        return {"type": "boolean"}


def _within(meta: dict, value: float) -> bool:
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is not None and (value <= lo if meta.get("exclusive_minimum") else value < lo):
        return False
    return hi is None or (value < hi if meta.get("exclusive_maximum") else value <= hi)


@dataclasses.dataclass(frozen=True)
class _Number(_Kind):
    integer: bool

    def parse(self, meta, value, path, errors):
        kinds = int if self.integer else (int, float)
        is_number = isinstance(value, kinds) and not isinstance(value, bool)
        # NaN compares false with every bound, so finiteness is checked on its own.
        if is_number and math.isfinite(value) and _within(meta, value):
            return value if self.integer else float(value)
        what = "an integer" if self.integer else "a finite number"
        errors.append(FieldError(path, f"must be {_range_text(meta, what)}, got {_show(value)}"))
        return value

    def openapi(self, meta):
        schema: dict[str, Any] = {"type": "integer", "format": "int64"}
        if not self.integer:
            schema = {"type": "number"}
        if meta.get("minimum") is not None:
            schema["minimum"] = meta["minimum"]
            if meta.get("exclusive_minimum"):
                schema["exclusiveMinimum"] = True
        if meta.get("maximum") is not None:
            schema["maximum"] = meta["maximum"]
            if meta.get("exclusive_maximum"):
                schema["exclusiveMaximum"] = True
        return schema


@dataclasses.dataclass(frozen=True)
class _String(_Kind):
    int_or_string: bool = False

    def parse(self, meta, value, path, errors):
        if self.int_or_string and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            fix = _fix(meta, value)
            # The words the pattern stands for say more than "a string" does.
            what = meta.get("pattern_hint") or "be a string"
            message = f"must {what}, got {_show(value)}"
            errors.append(FieldError(path, f"{message}: {fix}" if fix else message))
            return value
        _check_string(meta, value, path, errors)
        return value

    def openapi(self, meta):
        schema: dict[str, Any] = {"type": "string"}
        if self.int_or_string:
            schema = {"x-kubernetes-int-or-string": True}
        elif meta.get("format"):
            schema["format"] = meta["format"]
        for key, keyword in (("min_length", "minLength"), ("max_length", "maxLength")):
            if meta.get(key) is not None:
                schema[keyword] = meta[key]
        if meta.get("pattern"):
            schema["pattern"] = meta["pattern"]
        return schema


def _check_string(meta: dict, value: str, path: str, errors: Errors, what: str = "") -> None:
    """One message per string: the first limit it breaks."""
    shortest, limit, pattern = meta.get("min_length"), meta.get("max_length"), meta.get("pattern")
    if shortest is not None and len(value) < shortest:
        need = "may not be empty" if shortest == 1 else f"must be at least {shortest} characters"
        errors.append(FieldError(path, what + need))
    elif limit is not None and len(value) > limit:
        errors.append(
            FieldError(path, f"{what}must be at most {limit} characters, got {len(value)}")
        )
    elif pattern and not re.search(pattern, value):
        hint = meta.get("pattern_hint") or f"match {pattern}"
        errors.append(FieldError(path, f"{what}must {hint}, got {_show(value)}"))


def _item_meta(meta: dict) -> dict:
    """The constraints a list's items or a map's values inherit from the field."""
    keys = ("pattern", "pattern_hint", "min_length", "max_length", "format")
    return {k: meta.get(k) for k in keys}


@dataclasses.dataclass(frozen=True)
class _List(_Kind):
    item: _Kind

    def parse(self, meta, value, path, errors):
        if not isinstance(value, list):
            errors.append(FieldError(path, f"must be a list, got {_show(value)}"))
            return value
        shortest, limit = meta.get("min_items"), meta.get("max_items")
        if shortest is not None and len(value) < shortest:
            need = f"must have at least {shortest} items, got {len(value)}"
            errors.append(FieldError(path, "may not be empty" if shortest == 1 else need))
        if limit is not None and len(value) > limit:
            errors.append(FieldError(path, f"must have at most {limit} items, got {len(value)}"))
        item_meta = _item_meta(meta)
        return [self.item.parse(item_meta, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]

    def openapi(self, meta):
        schema = {"type": "array", "items": self.item.openapi(_item_meta(meta))}
        if meta.get("min_items") is not None:
            schema["minItems"] = meta["min_items"]
        if meta.get("max_items") is not None:
            schema["maxItems"] = meta["max_items"]
        return schema


class _Map(_Kind):
    """string -> string (labels, selectors, environment)."""

    def parse(self, meta, value, path, errors):
        if not isinstance(value, dict):
            errors.append(FieldError(path, f"must be an object, got {_show(value)}"))
            return value
        value = {k: v for k, v in value.items() if v is not None}  # pruned, as in an object
        limit = meta.get("max_properties")
        if limit is not None and len(value) > limit:
            errors.append(FieldError(path, f"must have at most {limit} entries, got {len(value)}"))
        key_meta = {
            "pattern": meta.get("key_pattern"),
            "pattern_hint": meta.get("key_hint"),
            "max_length": meta.get("key_max_length"),
        }
        for k, v in value.items():
            _check_string(key_meta, str(k), f"{path}.{k}", errors, what="key ")
            if not isinstance(v, str):
                errors.append(FieldError(f"{path}.{k}", f"must be a string, got {_show(v)}"))
            else:
                _check_string(_item_meta(meta), v, f"{path}.{k}", errors)
        return dict(value)

    def openapi(self, meta):
        values = _String().openapi(_item_meta(meta))
        schema: dict[str, Any] = {"type": "object", "additionalProperties": values}
        if meta.get("max_properties") is not None:
            schema["maxProperties"] = meta["max_properties"]
        # Core CEL checks map keys; OpenAPI's propertyNames is not allowed in a CRD.
        checks = []
        if meta.get("key_pattern"):
            checks.append(f"k.matches({cel_string(meta['key_pattern'])})")
        if meta.get("key_max_length"):
            checks.append(f"size(k) <= {meta['key_max_length']}")
        if checks:
            hint = meta.get("key_hint") or "match " + meta.get("key_pattern", "")
            schema["x-kubernetes-validations"] = [
                {"rule": f"self.all(k, {' && '.join(checks)})", "message": f"every key must {hint}"}
            ]
        return schema


def cel_string(text: str) -> str:
    """``text`` as a CEL string literal (a regex's backslashes survive)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


class _FreeForm(_Kind):
    def parse(self, meta, value, path, errors):
        if not isinstance(value, dict):
            errors.append(FieldError(path, f"must be an object, got {_show(value)}"))
            return value
        return dict(value)

    def openapi(self, meta):
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


@functools.cache
def _kind(tp: Any) -> _Kind:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _Object(tp)
    if origin is Literal:
        return _Enum(typing.get_args(tp))
    if tp is bool:
        return _Bool()
    if tp in (int, float):
        return _Number(integer=tp is int)
    if tp in (str, IntOrString):
        return _String(int_or_string=tp is IntOrString)
    if origin is list:
        return _List(_kind(typing.get_args(tp)[0]))
    if origin is dict and typing.get_args(tp) == (str, str):
        return _Map()
    if tp is FreeForm:
        return _FreeForm()
    raise TypeError(f"unsupported field type {tp!r}")


# ----------------------------------------------------------------------------- parsing


def parse(cls: type, data: Any, path: str = "spec") -> Any:
    """Parse ``data`` into ``cls``; raise :class:`SpecError` listing every problem.

    Field errors and cross-field rules are reported together: a rule is left out only when
    a field it reads is itself wrong, or sits beside a misspelt key (the rule's message would
    be noise: ``maxStep: 10`` should not also say that neither maxSteps nor epochs is set).
    """
    errors: list[FieldError] = []
    result = _parse_object(cls, data, path, errors)
    if dataclasses.is_dataclass(result):
        bad = [e.path.rsplit(".", 1)[0] if e.unknown else e.path for e in errors]
        errors.extend(check_rules(result, path, bad=bad))
    if errors:
        raise SpecError(errors)
    return result


def unknown_field(key: str, known: list[str]) -> str:
    """The message for a key no field has: the closest known spelling, else every one."""
    close = [k for k in known if k.lower() == key.lower()]
    close = close or difflib.get_close_matches(key, known, n=1, cutoff=0.7)
    if close:
        return f'unknown field; did you mean "{close[0]}"?'
    return f"unknown field; allowed: {', '.join(known)}"


def _parse_object(cls: type, data: Any, path: str, errors: Errors) -> Any:
    """The object even when some fields are wrong (they keep their raw value), so that the
    rules that do not read them can still be checked."""
    if not isinstance(data, dict):
        errors.append(FieldError(path, f"must be an object, got {_show(data)}"))
        return data
    hints = _hints(cls)
    known = {camel(f.name): f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            message = unknown_field(str(key), list(known))
            errors.append(FieldError(f"{path}.{key}", message, unknown=True))
    values = {}
    for key, f in known.items():
        sub = f"{path}.{key}"
        tp, _ = _unwrap_optional(hints[f.name])
        # No field is nullable: the API server prunes a null before defaulting, so a null is
        # an unset field here too (its default holds; a required one is missing).
        if data.get(key) is None:
            if f.default is MISSING and f.default_factory is MISSING:
                errors.append(FieldError(sub, "is required"))
                values[f.name] = None
            continue
        values[f.name] = _kind(tp).parse(f.metadata, data[key], sub, errors)
    return cls(**values)


_SELF_FIELD = re.compile(r"\bself((?:\.[A-Za-z_]\w*)+)(\()?")


@functools.cache
def _reads(rule: Rule) -> tuple[str, ...]:
    """The field paths (relative, ".a.b") a rule's CEL expression reads."""
    reads = set()
    for m in _SELF_FIELD.finditer(rule.cel):
        # self.env.exists(...) reads .env; the last name before "(" is a method.
        reads.add(m.group(1).rsplit(".", 1)[0] if m.group(2) else m.group(1))
    return tuple(reads) or ("",)


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def check_rules(obj: Any, path: str, bad: list[str] = ()) -> list[FieldError]:
    """Evaluate the CEL of every ``__rules__`` in ``obj`` and its nested objects, as the API
    server would on the object ``obj`` is parsed from (its defaults filled in), leaving out
    rules that read a field listed in ``bad``."""
    return _check_rules(obj, to_dict(obj), path, bad)


def _check_rules(obj: Any, data: dict, path: str, bad: list[str]) -> list[FieldError]:
    errors, scope = [], celexpr.Scope(data)
    for rule in getattr(type(obj), "__rules__", ()):
        if any(_overlaps(path + read, b) for read in _reads(rule) for b in bad):
            continue
        failure = scope.failure(rule.cel)
        if failure is None and rule.beyond_cel is not None and not rule.beyond_cel(obj):
            failure = ""
        if failure is not None:
            errors.append(FieldError(path + rule.field, failure or rule.message))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), camel(f.name)
        if dataclasses.is_dataclass(value):
            errors.extend(_check_rules(value, data[key], f"{path}.{key}", bad))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    errors.extend(_check_rules(item, data[key][i], f"{path}.{key}[{i}]", bad))
    return errors


# The transition rule of every field declared immutable: the CRD carries it at the field, and
# check_update evaluates it on the parsed old and new values.
IMMUTABLE = Rule(
    "self == oldSelf",
    "is immutable once the job exists (its checkpoints belong to this value); "
    "create a new FineTuneJob instead",
)


def check_update(old: Any, new: Any, path: str = "spec") -> list[FieldError]:
    """Problems with changing ``old`` into ``new``: its immutable fields' rule, evaluated as the
    API server does where the field is set on both sides."""
    errors = []
    for f in dataclasses.fields(new):
        sub = f"{path}.{camel(f.name)}"
        before, after = getattr(old, f.name), getattr(new, f.name)
        if f.metadata.get("immutable") and before is not None and after is not None:
            if celexpr.Scope(to_dict(after), to_dict(before)).failure(IMMUTABLE.cel) is not None:
                errors.append(FieldError(sub, IMMUTABLE.message))
        elif dataclasses.is_dataclass(after) and dataclasses.is_dataclass(before):
            errors.extend(check_update(before, after, sub))
    return errors


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
        schema = _kind(tp).openapi(f.metadata)
        if f.metadata.get("doc"):
            # The field's own words describe it, in place of its class's docstring.
            schema = {"description": None} | schema
            schema["description"] = _clean(f.metadata["doc"])
        if f.metadata.get("immutable"):
            schema.setdefault("x-kubernetes-validations", []).append(_cel_rule(IMMUTABLE))
        if f.default is not MISSING and f.default is not None:
            schema["default"] = f.default
        elif f.default_factory is not MISSING:
            produced = to_dict(f.default_factory())
            # An object defaults to {} so the API server fills in its fields' defaults too --
            # unless its class has CEL rules: the API server checks a default against them as
            # written, before defaulting inside it, and refuses the CRD when a rule names a
            # field the default lacks ("no such key"), so such a default is spelled out.
            spelled = not dataclasses.is_dataclass(tp) or getattr(tp, "__rules__", ())
            schema["default"] = produced if spelled else {}
        elif f.default is MISSING:
            required.append(camel(f.name))
        if "default" in schema and schema.get("description"):
            schema["description"] += _default_text(schema["description"], schema["default"])
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


def _default_text(description: str, value: Any) -> str:
    """`kubectl explain` shows a field's description, not its default: say a scalar default
    as Kubernetes' own types do ("Defaults to 30."), unless the words say it already. An
    object's or a list's default is its fields' (or empty), said by them."""
    if isinstance(value, dict | list) or value == "" or re.search(r"\bdefault", description, re.I):
        return ""
    return f" Defaults to {_show(value)}."


def _cel_rule(rule: Rule) -> dict:
    out = {"rule": rule.cel, "message": rule.message}
    if rule.field:
        out["fieldPath"] = rule.field
    return out


def _clean(text: str) -> str:
    return " ".join(text.split())
