"""PURE: the API server's own rules for the objects ftjob creates (Pods, Services, ConfigMaps).

Kubernetes' OpenAPI schemas only say which fields exist and their types; what a name, a label
or a toleration may hold is Go code in k8s.io/apimachinery (``validation.IsDNS1123Label``,
``IsQualifiedName``, ``IsValidLabelValue``, ``IsConfigMapKey``) and k8s.io/kubernetes
(``ValidatePodSpec``, ``ValidateTolerations``, ``ValidateService``). This module restates the
rules of those functions that the fields ftjob renders can break, with their documented
limits, so that ``ftjob validate`` refuses a job whose children the API server would refuse.

The patterns are RE2-compatible: ``spec.py`` also puts them into the CRD.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# apimachinery/pkg/util/validation: the regexes and their length limits.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # IsDNS1123Label, at most 63
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # IsDNS1035Label (Service names), at most 63
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # <= 253
# IsQualifiedName: an optional DNS subdomain prefix and "/", then a name of at most 63.
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
QUALIFIED_NAME_MAX = 253 + 1 + 63
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"  # IsValidLabelValue, <= 63
# IsConfigMapKey (also Secret keys): these characters, at most 253, and not "." or "..".
CONFIG_MAP_KEY = (
    r"^([-_a-zA-Z0-9][-._a-zA-Z0-9]*|\.[-_a-zA-Z0-9][-._a-zA-Z0-9]*|\.\.[-._a-zA-Z0-9]+)$"
)
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"  # IsEnvVarName
# An image reference has no whitespace anywhere (the kubelet cannot pull "my image:1").
IMAGE = r"^[^\s]+$"
PORT_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # IsValidPortName: <= 15, has a letter

CONFIG_MAP_BYTES = 1024 * 1024  # the data of one ConfigMap (core/validation: MaxConfigMapSize)


@dataclass(frozen=True)
class ChildError:
    """One field of one rendered child that the API server would refuse."""

    kind: str
    name: str
    path: str  # in the child, e.g. spec.tolerations[0].operator
    message: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.path}: {self.message}"


def is_dns_label(value: str) -> bool:
    return len(value) <= 63 and re.match(DNS_LABEL, value) is not None


def is_dns_subdomain(value: str) -> bool:
    return len(value) <= 253 and re.match(DNS_SUBDOMAIN, value) is not None


def is_qualified_name(value: str) -> bool:
    if len(value) > QUALIFIED_NAME_MAX or not re.match(QUALIFIED_NAME, value):
        return False
    prefix, _, _ = value.rpartition("/")
    return len(prefix) <= 253


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and re.match(LABEL_VALUE, value) is not None


# ----------------------------------------------------------------------------- one object


def metadata_errors(meta: dict, name_rule: str = "subdomain") -> Iterator[tuple[str, str]]:
    """ObjectMeta: the name (by the kind's rule), namespace, label keys and values."""
    name, namespace = meta.get("name", ""), meta.get("namespace", "default")
    if not isinstance(name, str):
        yield "metadata.name", f"must be a string, got {name!r}"
    elif name_rule == "service":
        if len(name) > 63 or not re.match(DNS_1035_LABEL, name):
            yield (
                "metadata.name",
                (
                    f"{name!r} is not a DNS-1035 label (at most 63 lowercase letters, digits and "
                    "'-', starting with a letter)"
                ),
            )
    elif not is_dns_subdomain(name):
        yield (
            "metadata.name",
            f"{name!r} is not a DNS subdomain (lowercase letters, digits, '-', '.')",
        )
    if not isinstance(namespace, str) or not is_dns_label(namespace):
        yield "metadata.namespace", f"{namespace!r} is not a DNS label"
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        yield "metadata.labels", "must be a map of label keys to values"
    else:
        yield from label_errors(labels, "metadata.labels")
    for key in meta.get("annotations") or {}:
        if not is_qualified_name(str(key)):
            yield f"metadata.annotations[{key}]", "is not a qualified name"


def label_errors(labels: dict, path: str) -> Iterator[tuple[str, str]]:
    for key, value in labels.items():
        if not is_qualified_name(str(key)):
            yield (
                f"{path}[{key}]",
                (
                    "key must be a qualified name (an optional DNS prefix and '/', then at most 63 "
                    "letters, digits, '-', '_', '.', starting and ending with a letter or digit)"
                ),
            )
        if not isinstance(value, str) or not is_label_value(value):
            yield (
                f"{path}[{key}]",
                (
                    f"value {value!r} must be a label value (at most 63 letters, digits, '-', '_', "
                    "'.', starting and ending with a letter or digit)"
                ),
            )


def toleration_errors(tol: dict, path: str) -> Iterator[tuple[str, str]]:
    """core/validation ValidateTolerations."""
    key, operator, value = tol.get("key", ""), tol.get("operator", "Equal"), tol.get("value", "")
    if key and not is_qualified_name(key):
        yield f"{path}.key", f"{key!r} is not a qualified name (a label key)"
    if not key and operator != "Exists":
        yield f"{path}.operator", "must be Exists when key is empty (it then matches every taint)"
    if tol.get("tolerationSeconds") is not None and tol.get("effect") != "NoExecute":
        yield f"{path}.effect", "must be NoExecute when tolerationSeconds is set"
    if operator == "Exists" and value:
        yield f"{path}.value", "must be empty when operator is Exists"
    if operator == "Equal" and not is_label_value(value):
        yield f"{path}.value", f"{value!r} is not a label value"


def container_errors(c: dict, path: str) -> Iterator[tuple[str, str]]:
    image = c.get("image", "")
    if not image:
        yield f"{path}.image", "Required value"
    elif not re.match(IMAGE, image):
        yield f"{path}.image", f"{image!r} may not contain whitespace"
    for i, env in enumerate(c.get("env") or []):
        where = f"{path}.env[{i}]"
        if not re.match(ENV_NAME, env.get("name", "")):
            yield f"{where}.name", f"{env.get('name')!r} is not a valid environment variable name"
        ref = (env.get("valueFrom") or {}).get("secretKeyRef")
        if ref is not None:
            if not is_dns_subdomain(ref.get("name", "")):
                yield f"{where}.valueFrom.secretKeyRef.name", "is not a DNS subdomain"
            key = ref.get("key", "")
            if len(key) > 253 or not re.match(CONFIG_MAP_KEY, key):
                yield (
                    f"{where}.valueFrom.secretKeyRef.key",
                    (
                        f"{key!r} is not a valid Secret key (letters, digits, '-', '_', '.'; not "
                        "empty, '.' or '..')"
                    ),
                )
    yield from _port_errors(c.get("ports") or [], f"{path}.ports", "containerPort")


def _port_errors(ports: list, path: str, number: str) -> Iterator[tuple[str, str]]:
    names, numbers = set(), set()
    for i, port in enumerate(ports):
        name, value = port.get("name", ""), port.get(number)
        if name and (len(name) > 15 or not re.match(PORT_NAME, name)):
            yield f"{path}[{i}].name", f"{name!r} is not a valid port name"
        if name in names:
            yield f"{path}[{i}].name", f"Duplicate value: {name!r}"
        if not isinstance(value, int) or not 1 <= value <= 65535:
            yield f"{path}[{i}].{number}", f"{value!r} must be between 1 and 65535"
        if (value, port.get("protocol", "TCP")) in numbers:
            yield f"{path}[{i}].{number}", f"Duplicate value: {value} (another port uses it)"
        names.add(name)
        numbers.add((value, port.get("protocol", "TCP")))


NODE_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")


def node_selector_term_errors(term: dict, path: str) -> Iterator[tuple[str, str]]:
    """core/validation ValidateNodeSelectorTerm: label requirements (matchExpressions) and
    field requirements (matchFields: metadata.name only, In or NotIn, exactly one value)."""
    for i, req in enumerate(term.get("matchExpressions") or []):
        at, op, values = f"{path}.matchExpressions[{i}]", req.get("operator"), req.get("values")
        if not is_qualified_name(req.get("key", "")):
            yield f"{at}.key", f"{req.get('key')!r} is not a label key"
        if op not in NODE_SELECTOR_OPERATORS:
            yield f"{at}.operator", f"{op!r} is not one of {', '.join(NODE_SELECTOR_OPERATORS)}"
        elif op in ("In", "NotIn") and not values:
            yield f"{at}.values", "must be specified when operator is In or NotIn"
        elif op in ("Exists", "DoesNotExist") and values:
            yield f"{at}.values", "may not be specified when operator is Exists or DoesNotExist"
        elif op in ("Gt", "Lt") and (len(values or []) != 1 or not str(values[0]).isdigit()):
            yield f"{at}.values", "must be one integer when operator is Gt or Lt"
    for i, req in enumerate(term.get("matchFields") or []):
        at = f"{path}.matchFields[{i}]"
        if req.get("key") != "metadata.name":
            yield f"{at}.key", "the only supported field is metadata.name"
        if req.get("operator") not in ("In", "NotIn"):
            yield f"{at}.operator", "must be In or NotIn for metadata.name"
        if len(req.get("values") or []) != 1:
            yield f"{at}.values", "must be only one value when operator is In or NotIn"


def pod_spec_errors(spec: dict) -> Iterator[tuple[str, str]]:
    for field in ("hostname", "subdomain"):
        if field in spec and not is_dns_label(spec[field]):
            yield f"spec.{field}", f"{spec[field]!r} is not a DNS label"
    for i, c in enumerate(spec.get("containers") or []):
        yield from container_errors(c, f"spec.containers[{i}]")
    for key, value in (spec.get("nodeSelector") or {}).items():
        yield from label_errors({key: value}, "spec.nodeSelector")
    for i, tol in enumerate(spec.get("tolerations") or []):
        yield from toleration_errors(tol, f"spec.tolerations[{i}]")
    node_affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    path = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    for i, term in enumerate(required.get("nodeSelectorTerms") or []):
        yield from node_selector_term_errors(term, f"{path}.nodeSelectorTerms[{i}]")
    for field in ("priorityClassName", "schedulerName"):
        if field in spec and not is_dns_subdomain(spec[field]):
            yield f"spec.{field}", f"{spec[field]!r} is not a DNS subdomain"
    for i, vol in enumerate(spec.get("volumes") or []):
        claim = vol.get("persistentVolumeClaim")
        if claim is not None and not is_dns_subdomain(claim.get("claimName", "")):
            yield f"spec.volumes[{i}].persistentVolumeClaim.claimName", "is not a DNS subdomain"


def object_errors(obj: dict) -> Iterator[tuple[str, str]]:
    """(path, message) for every rule ``obj`` (a Pod, Service or ConfigMap) breaks."""
    kind = obj.get("kind")
    yield from metadata_errors(obj.get("metadata") or {}, "service" if kind == "Service" else "")
    if kind == "Pod":
        yield from pod_spec_errors(obj.get("spec") or {})
    elif kind == "Service":
        spec = obj.get("spec") or {}
        yield from _port_errors(spec.get("ports") or [], "spec.ports", "port")
        yield from label_errors(spec.get("selector") or {}, "spec.selector")
    elif kind == "ConfigMap":
        data = obj.get("data") or {}
        for key in data:
            if not re.match(CONFIG_MAP_KEY, key):
                yield f"data[{key}]", "is not a valid ConfigMap key"
        size = sum(len(k) + len(v.encode()) for k, v in data.items())
        if size > CONFIG_MAP_BYTES:
            yield "data", f"Too long: {size} bytes, a ConfigMap holds at most {CONFIG_MAP_BYTES}"


def errors(objs: list[dict[str, Any]]) -> list[ChildError]:
    """Every rule the API server would hold against these objects."""
    found = []
    for obj in objs:
        name = (obj.get("metadata") or {}).get("name", "")
        for path, message in object_errors(obj):
            found.append(ChildError(obj.get("kind", ""), name, path, message))
    return found
