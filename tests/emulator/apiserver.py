"""A stateful Kubernetes API server for tests, on kmock 0.8 (FINDINGS: "Kubernetes without a
cluster").

kmock's :class:`~kmock.KubernetesScaffold` gives the HTTP server, request parsing (resource,
namespace, name, subresource, action) and discovery; this class keeps the objects and does
what a real API server does that kmock's own emulator leaves out:

* server-set fields (uid, resourceVersion, generation, creationTimestamp, namespace, kind,
  apiVersion) and ``generateName``;
* ``/status`` isolation: the main resource ignores status changes, ``/status`` ignores the
  rest, and ``generation`` moves only when the spec does;
* merge patches, JSON patches (a failed ``test`` answers 422), PUT with optimistic
  concurrency (409 on a stale resourceVersion), 409 on duplicate names;
* ``labelSelector`` on list and watch, watches that resume from a resourceVersion;
* CRDs served once created, admitted with their schema + CEL rules (``ftjob.api.admission``);
* finalizers, and garbage collection of everything an object owns (ownerReferences.uid);
* ``Table`` output with the CRD's printer columns (what ``kubectl get`` asks for);
* fault injection (:meth:`fail`) and dropping every watch (:meth:`drop_watches`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import secrets
import uuid
from typing import Any

import aiohttp.web
import attrs
import kmock
from apimachinery import (
    Refused,
    field_selector_name,
    json_patch,
    merge_patch,
    now_iso,
    selector_matches,
    status_response,
    table,
)

from ftjob.api import admission, kubevalidation

CORE = {  # plural: (kind, namespaced, subresources)
    "pods": ("Pod", True, {"status"}),
    "services": ("Service", True, {"status"}),
    "configmaps": ("ConfigMap", True, set()),
    "secrets": ("Secret", True, set()),
    "events": ("Event", True, set()),
    "namespaces": ("Namespace", False, {"status"}),
}
CRD_RESOURCE = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
EVENTS_V1 = ("events.k8s.io", "v1", "events")
SELF_REVIEW = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"  # the operator's start-up


@attrs.define(kw_only=True)
class Fault:
    method: str
    plural: str
    status: int
    times: int = 1
    subresource: str | None = None


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    """The emulator. ``async with ApiServer() as api, kmock.Server(api) as srv:``."""

    store: dict = attrs.field(factory=dict, init=False)  # (group, version, plural, ns, name)
    crds: dict = attrs.field(factory=dict, init=False)  # (group, version, plural) -> version
    history: list = attrs.field(factory=list, init=False)  # (rv, (g, v, plural), event)
    watchers: set = attrs.field(factory=set, init=False)
    faults: list = attrs.field(factory=list, init=False)
    graceful_pods: bool = True  # pods get a deletionTimestamp; the kubelet removes them
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for plural, (kind, namespaced, subs) in CORE.items():
            self.register(("", "v1", plural), kind, namespaced, subs, singular=kind.lower())
        self.register(CRD_RESOURCE, "CustomResourceDefinition", False, {"status"})
        self.register(EVENTS_V1, "Event", True, set())

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8 cannot parse /api/v1/namespaces (it expects a namespace after it); kopf
        # lists and watches it when given --namespace.
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._namespaces(raw_request)
        if raw_request.path == SELF_REVIEW and raw_request.method == "POST":
            # No authorizer here (every request is allowed): say so, as AlwaysAllow would.
            review = await raw_request.json()
            return aiohttp.web.json_response(review | {"status": {"allowed": True}}, status=201)
        return await super().__call__(raw_request)

    async def _namespaces(self, raw_request) -> aiohttp.web.StreamResponse:
        """Every namespace an object lives in (and default) -- namespaces exist implicitly.

        A watch announces a namespace when the first object in it appears, as a real server
        announces a created namespace: kopf, given --namespace, starts serving a namespace
        only once it has seen it exist.
        """
        names = sorted({key[3] for key in self.store if key[3]} | {"default"})
        rv = str(self._last_rv())
        items = [_namespace(n, rv) for n in names]
        if raw_request.query.get("watch") not in ("true", "1"):
            listing = {"apiVersion": "v1", "kind": "NamespaceList", "items": items}
            return aiohttp.web.json_response(listing | {"metadata": {"resourceVersion": rv}})
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw_request)
        for item in items:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        announced = set(names)
        queue: asyncio.Queue = asyncio.Queue()
        self.watchers.add(queue)
        timeout = float(raw_request.query.get("timeoutSeconds") or 3600)
        try:
            while (item := await asyncio.wait_for(queue.get(), timeout)) is not None:
                namespace = item[2]["object"].get("metadata", {}).get("namespace")
                if namespace and namespace not in announced:
                    announced.add(namespace)
                    event = {"type": "ADDED", "object": _namespace(namespace, str(item[0]))}
                    await response.write(json.dumps(event).encode() + b"\n")
        except (asyncio.TimeoutError, ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.watchers.discard(queue)
        with contextlib.suppress(ConnectionResetError):  # the client may have gone first
            await response.write_eof()
        return response

    async def _serve_version(self, request):
        # kmock lists a subresource (finetunejobs/status) with its parent's short names; a real
        # server does not, and kubectl warns that "ftj" is ambiguous.
        listing = await super()._serve_version(request)
        listing["groupVersion"] = listing["groupVersion"].lstrip("/")  # core is "v1", not "/v1"
        for res in listing["resources"]:
            if "/" in res["name"]:
                res["shortNames"], res["categories"] = [], []
        return listing

    def register(self, gvp, kind, namespaced, subresources, **info) -> None:
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        key = kmock.resource(*gvp)
        self.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=verbs, subresources=subresources, **info
        )

    # ------------------------------------------------------------------ test controls

    def fail(self, method: str, plural: str, status: int, times=1, subresource=None) -> None:
        """The next ``times`` matching requests answer ``status`` instead."""
        self.faults.append(
            Fault(
                method=method.upper(),
                plural=plural,
                status=status,
                times=times,
                subresource=subresource,
            )
        )

    def drop_watches(self) -> None:
        for queue in list(self.watchers):
            queue.put_nowait(None)

    def objects(self, plural: str, namespace: str | None = None) -> list[dict]:
        return [
            copy.deepcopy(o)
            for (g, v, p, ns, _), o in sorted(self.store.items())
            if p == plural and (namespace is None or ns == namespace)
        ]

    def get(self, plural: str, namespace: str | None, name: str) -> dict | None:
        for (_, _, p, ns, n), obj in self.store.items():
            if p == plural and ns == namespace and n == name:
                return copy.deepcopy(obj)
        return None

    def write_status(self, plural: str, namespace: str, name: str, status: dict) -> None:
        """What a kubelet does: replace an object's status (a MODIFIED event)."""
        key = next(k for k in self.store if k[2] == plural and k[3] == namespace and k[4] == name)
        obj = copy.deepcopy(self.store[key])
        obj["status"] = status
        self._save(key, obj, "MODIFIED")

    def set_spec_field(self, plural, namespace, name, field: str, value) -> None:
        key = next(k for k in self.store if k[2] == plural and k[3] == namespace and k[4] == name)
        obj = copy.deepcopy(self.store[key])
        obj["spec"][field] = value
        self._save(key, obj, "MODIFIED")

    def merge_spec(self, plural, namespace, name, changes: dict) -> None:
        """A user's edit of the spec: admitted, generation + 1."""
        key = next(k for k in self.store if k[2] == plural and k[3] == namespace and k[4] == name)
        old = self.store[key]
        new = merge_patch(old, {"spec": changes})
        new = self._admit(key[:3], new, old)
        new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        self._save(key, new, "MODIFIED")

    def remove(self, plural: str, namespace: str, name: str) -> None:
        key = next(k for k in self.store if k[2] == plural and k[3] == namespace and k[4] == name)
        self._delete_now(key)

    # ------------------------------------------------------------------ storage

    def _save(self, key, obj, event: str) -> dict:
        obj.setdefault("metadata", {})["resourceVersion"] = rv = str(next(self._rv))
        self.store[key] = obj
        self._emit(key, event, obj, int(rv))
        return obj

    def _emit(self, key, event, obj, rv) -> None:
        item = (rv, key[:3], {"type": event, "object": copy.deepcopy(obj)})
        self.history.append(item)
        for queue in list(self.watchers):
            queue.put_nowait(item)

    def _delete_now(self, key) -> None:
        obj = self.store.pop(key)
        self._emit(key, "DELETED", obj, next(self._rv))
        uid = obj["metadata"]["uid"]
        # Garbage collection (background propagation): owned objects go too.
        for other_key, other in list(self.store.items()):
            refs = other["metadata"].get("ownerReferences") or []
            if other_key in self.store and any(r.get("uid") == uid for r in refs):
                self.begin_delete(other_key)

    def begin_delete(self, key) -> dict:
        obj = copy.deepcopy(self.store[key])
        meta = obj["metadata"]
        graceful = key[2] == "pods" and self.graceful_pods
        if meta.get("finalizers") or graceful:
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now_iso()
                self._save(key, obj, "MODIFIED")
            return self.store[key]
        self._delete_now(key)
        return obj

    # ------------------------------------------------------------------ serving

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or not res.plural or request.params.get("watch") not in (None, "true", "1"):
            return await super()._handle(request)
        gvp = (res.group, res.version, res.plural)
        if kmock.resource(*gvp) not in self.resources:
            return await super()._handle(request)
        method = request.method.value if hasattr(request.method, "value") else str(request.method)
        for fault in self.faults:
            if (fault.method, fault.plural, fault.subresource) == (
                method,
                res.plural,
                request.subresource,
            ) and fault.times > 0:
                fault.times -= 1
                return status_response(fault.status, "Injected", f"injected {fault.status}")
        try:
            if method == "GET" and request.params.get("watch") in ("true", "1"):
                return await self._watch(request, gvp)
            if method == "GET":
                return self._read(request, gvp)
            if method == "POST":
                return self._create(request, gvp)
            if method in ("PATCH", "PUT"):
                return self._update(request, gvp, method)
            if method == "DELETE":
                return self._delete(request, gvp)
        except Refused as e:
            return e.response
        return status_response(405, "MethodNotAllowed", f"{method} is not supported")

    def _key(self, gvp, namespace, name):
        return (*gvp, namespace, name)

    def _info(self, gvp):
        return self.resources[kmock.resource(*gvp)]

    def _read(self, request, gvp):
        if request.name:
            obj = self.store.get(self._key(gvp, request.namespace, request.name))
            if obj is None:
                raise Refused(404, "NotFound", f'{gvp[2]} "{request.name}" not found')
            return self._respond(request, gvp, [obj], single=True)
        selector = request.params.get("labelSelector")
        only = field_selector_name(request.params.get("fieldSelector"))
        items = [
            o
            for (g, v, p, ns, _), o in sorted(self.store.items())
            if (g, v, p) == gvp and request.namespace in (None, ns)
            if selector_matches(selector, o["metadata"].get("labels") or {})
            and only in (None, o["metadata"]["name"])
        ]
        return self._respond(request, gvp, items, single=False)

    def _respond(self, request, gvp, items, single):
        if "as=Table" in request.headers.get("Accept", ""):
            columns = self.crds[gvp].get("additionalPrinterColumns") if gvp in self.crds else None
            return aiohttp.web.json_response(table(items, columns))
        if single:
            return aiohttp.web.json_response(items[0])
        kind = self._info(gvp).kind
        body = {
            "apiVersion": "/".join(filter(None, gvp[:2])),
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(self._last_rv())},
            "items": items,
        }
        return aiohttp.web.json_response(body)

    def _last_rv(self) -> int:
        return self.history[-1][0] if self.history else 0

    async def _watch(self, request, gvp):
        selector = request.params.get("labelSelector")
        only = field_selector_name(request.params.get("fieldSelector")) or request.name
        since = int(request.params.get("resourceVersion") or 0)
        if request.params.get("sendInitialEvents") == "true":
            since = 0  # the current state first, whatever the resourceVersion
        timeout = float(request.params.get("timeoutSeconds") or 3600)

        def wanted(item) -> bool:
            rv, item_gvp, event = item
            meta = event["object"]["metadata"]
            return (
                item_gvp == gvp
                and rv > since
                and request.namespace in (None, meta.get("namespace"))
                and (only is None or meta["name"] == only)
                and selector_matches(selector, meta.get("labels") or {})
            )

        queue: asyncio.Queue = asyncio.Queue()
        self.watchers.add(queue)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        try:
            if since:
                backlog = [i for i in self.history if wanted(i)]
            else:  # no resourceVersion: the current state as ADDED events
                backlog = [
                    (int(o["metadata"]["resourceVersion"]), k[:3], {"type": "ADDED", "object": o})
                    for k, o in self.store.items()
                ]
                backlog = [i for i in backlog if wanted(i)]
            for _, _, event in backlog:
                await response.write(json.dumps(event).encode() + b"\n")
            if request.params.get("sendInitialEvents") == "true":
                # WatchList (kubectl >= 1.32): a bookmark closes the initial state.
                end = {"k8s.io/initial-events-end": "true"}
                meta = {"resourceVersion": str(self._last_rv()), "annotations": end}
                bookmark = {
                    "kind": self._info(gvp).kind,
                    "apiVersion": "/".join(filter(None, gvp[:2])),
                }
                event = {"type": "BOOKMARK", "object": bookmark | {"metadata": meta}}
                await response.write(json.dumps(event).encode() + b"\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), deadline - loop.time())
                except asyncio.TimeoutError:
                    break
                if item is None:  # dropped by the test
                    break
                if wanted(item):
                    await response.write(json.dumps(item[2]).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.watchers.discard(queue)
        await response.write_eof()
        return response

    def _create(self, request, gvp):
        if not isinstance(request.data, dict):
            raise Refused(400, "BadRequest", "the body must be an object")
        saved = self.create_object(gvp, request.namespace, request.data)
        return aiohttp.web.json_response(saved, status=201)

    def create_object(self, gvp, namespace, obj) -> dict:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise Refused(422, "Invalid", "metadata.name: Required value")
        info = self._info(gvp)
        namespace = (namespace or meta.get("namespace") or "default") if info.namespaced else None
        key = self._key(gvp, namespace, meta["name"])
        if key in self.store:
            raise Refused(409, "AlreadyExists", f'{gvp[2]} "{meta["name"]}" already exists')
        obj["apiVersion"] = "/".join(filter(None, gvp[:2]))
        obj["kind"] = info.kind
        if namespace:
            meta["namespace"] = namespace
        meta |= {"uid": str(uuid.uuid4()), "creationTimestamp": now_iso(), "generation": 1}
        if "status" in info.subresources:
            obj.pop("status", None)  # status is written through /status only
        if gvp[2] == "pods":
            obj["status"] = {"phase": "Pending"}
        obj = self._admit(gvp, obj, None)
        saved = self._save(key, obj, "ADDED")
        if gvp == CRD_RESOURCE:
            self._serve_crd(obj)
        return saved

    def _admit(self, gvp, obj, old):
        if not gvp[0] and gvp[1:] in (("v1", "pods"), ("v1", "services"), ("v1", "configmaps")):
            # The API server's own rules for the objects the operator creates.
            errors = [f"{path}: {msg}" for path, msg in kubevalidation.object_errors(obj)]
            if errors:
                message = f'{self._info(gvp).kind} "{obj["metadata"]["name"]}" is invalid: '
                raise Refused(422, "Invalid", message + ", ".join(errors))
        version = self.crds.get(gvp)
        if not version:
            return obj
        schema = version["schema"]["openAPIV3Schema"]
        body = {k: v for k, v in obj.items() if k != "metadata"}
        body["metadata"] = {"name": obj["metadata"]["name"]}
        old_body = None
        if old is not None:
            old_body = {k: v for k, v in old.items() if k != "metadata"}
            old_body["metadata"] = {"name": old["metadata"]["name"]}
        defaulted, errors = admission.admit(schema, body, old_body)
        if errors:
            kind = self._info(gvp).kind
            causes = [{"field": e.split(": ", 1)[0], "message": e} for e in errors]
            message = f'{kind}.{gvp[0]} "{obj["metadata"]["name"]}" is invalid: ' + ", ".join(
                errors
            )
            raise Refused(422, "Invalid", message, causes)
        defaulted["metadata"] = obj["metadata"]
        return defaulted

    def _serve_crd(self, crd: dict) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            gvp = (spec["group"], version["name"], spec["names"]["plural"])
            self.crds[gvp] = version
            self.register(
                gvp,
                spec["names"]["kind"],
                spec["scope"] == "Namespaced",
                set(version.get("subresources", {})),
                singular=spec["names"].get("singular"),
                shortnames=spec["names"].get("shortNames", []),
                categories=spec["names"].get("categories", []),
            )

    def _update(self, request, gvp, method):
        key = self._key(gvp, request.namespace, request.name)
        old = self.store.get(key)
        if old is None:
            raise Refused(404, "NotFound", f'{gvp[2]} "{request.name}" not found')
        ctype = request.headers.get("Content-Type", "")
        if method == "PUT":
            new = copy.deepcopy(request.data)
        elif "json-patch" in ctype:
            new = json_patch(old, request.data)
        elif "merge-patch" in ctype or "strategic-merge-patch" in ctype:
            new = merge_patch(old, request.data)  # strategic merge: lists replaced, as merge
        else:
            raise Refused(415, "UnsupportedMediaType", f"{ctype} is not supported")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if method == "PUT" and want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise Refused(
                409,
                "Conflict",
                "the object has been modified; please apply your "
                "changes to the latest version and try again",
            )
        info = self._info(gvp)
        if request.subresource == "status":
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status")
        else:
            merged = new
            # Server-owned metadata stays; status changes go through /status only.
            for field in ("uid", "creationTimestamp", "generation", "deletionTimestamp"):
                if field in old["metadata"]:
                    merged["metadata"][field] = old["metadata"][field]
            merged["apiVersion"], merged["kind"] = old["apiVersion"], old["kind"]
            if "status" in info.subresources:
                merged["status"] = old.get("status")
            else:
                merged.setdefault("status", old.get("status"))
            if merged.get("status") is None:
                merged.pop("status", None)
            merged = self._admit(gvp, merged, old)
            body = {k: v for k, v in merged.items() if k not in ("metadata", "status")}
            if body != {k: v for k, v in old.items() if k not in ("metadata", "status")}:
                merged["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if merged == old:
            return aiohttp.web.json_response(old)  # no-op writes do not wake watchers
        meta = merged["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and gvp[2] != "pods":
            self.store[key] = merged
            self._delete_now(key)
            return aiohttp.web.json_response(merged)
        return aiohttp.web.json_response(self._save(key, merged, "MODIFIED"))

    def _delete(self, request, gvp):
        if not request.name:
            raise Refused(405, "MethodNotAllowed", "collection deletion is not supported")
        key = self._key(gvp, request.namespace, request.name)
        if key not in self.store:
            raise Refused(404, "NotFound", f'{gvp[2]} "{request.name}" not found')
        obj = self.begin_delete(key)
        return aiohttp.web.json_response(obj)


def _namespace(name: str, resource_version: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "resourceVersion": resource_version},
    }
