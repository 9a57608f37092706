"""The only module that talks to the Kubernetes API (an import-linter contract keeps it so).

Every call is idempotent from the caller's side: creating what exists (409) and deleting
what is gone (404) count as done, so a handler that runs twice, or an operator restarted
half-way through, converges instead of failing. The client is synchronous; handlers call
it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import urllib3
from kubernetes import client, config

from ftjob.api.jobspec import GROUP, PLURAL, VERSION
from ftjob.operator import metrics

FIELD_MANAGER = "ftjob-operator"
ApiException = client.ApiException  # for callers: only this module imports kubernetes
_KINDS = {"Pod": "pod", "Service": "service", "ConfigMap": "config_map"}


class Gone(Exception):
    """The job a write was meant for no longer exists: deleted (404), or replaced by a new
    object of the same name (its UID differs: the JSON patch's ``test`` answers 422)."""


class Conflict(Exception):
    """The job moved on since the copy a status write was decided from (409: its
    resourceVersion differs from the one the write carried): another writer, perhaps a replica
    that has not yet seen that peering paused it, wrote in between. Nothing was written; the
    writer reads the job again before it decides anything."""


class Refused(Exception):
    """The API server refused to create a child for good reasons of its own: admission
    (PodSecurity, a quota, a webhook: 403 or 422) or RBAC (403). Retrying the same object
    gets the same answer until the namespace or the cluster changes."""


class Unreachable(Exception):
    """No API server answers where the kubeconfig (or the pod's service account) points."""


class Kube:
    def __init__(self, api: client.ApiClient | None = None, connections: int | None = None):
        if api is None:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            else:
                config.load_kube_config()
            configuration = client.Configuration.get_default_copy()
            if connections:  # one per thread that calls (the default is CPUs x 5)
                configuration.connection_pool_maxsize = connections
            api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        # SelfSubjectAccessReview: every authenticated user may ask (system:basic-user), so
        # it needs no rule of the chart's.
        self.auth = client.AuthorizationV1Api(api)

    def may(self, group: str, resource: str, verb: str, namespace: str) -> bool:
        """Whether the API server's authorizer lets this client ``verb`` ``resource``
        (``plural`` or ``plural/subresource``) in ``namespace`` ("": every namespace).
        Raises :class:`Unreachable` when no API server answers."""
        plural, _, sub = resource.partition("/")
        attrs = client.V1ResourceAttributes(
            group=group, resource=plural, subresource=sub or None, verb=verb,
            namespace=namespace or None,
        )  # fmt: skip
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs)
        )
        try:
            # One try, a short wait: a start-up that cannot reach the server says so now.
            answer = self.auth.create_self_subject_access_review(
                review, _request_timeout=10, _preload_content=False
            )
        except urllib3.exceptions.HTTPError as e:
            host = self.auth.api_client.configuration.host
            # urllib3's own words end its message ("... [Errno 111] Connection refused").
            reason = e.reason if isinstance(e, urllib3.exceptions.MaxRetryError) else e
            why = str(reason).rpartition("): ")[2]
            raise Unreachable(f"no API server answers at {host} ({why})") from e
        return bool(json.loads(answer.data).get("status", {}).get("allowed"))

    def serves_pod_groups(self) -> bool:
        """Whether the API server serves Kubernetes 1.37's PodGroup API (discovery: an API off
        by default, or too new for the cluster, is answered 404)."""
        try:
            found = self.custom.get_api_resources("scheduling.k8s.io", "v1beta1")
        except client.ApiException as e:
            if e.status == 404:
                return False
            raise
        return any(r.name == "podgroups" for r in found.resources or [])

    def _call(self, verb: str, kind: str):
        """The client's ``verb`` (create, read, delete) for a child ``kind``, called as
        ``call(namespace, body_or_name, **kw)``, whether the kind is core or a PodGroup."""
        if kind == "PodGroup":
            return {"create": self._pod_group_create, "read": self._pod_group_read,
                    "delete": self._pod_group_delete}[verb]  # fmt: skip
        if verb == "create":
            return getattr(self.core, f"create_namespaced_{_KINDS[kind]}")
        if verb == "read":
            read = getattr(self.core, f"read_namespaced_{_KINDS[kind]}")
            return lambda namespace, name, **kw: read(name, namespace, **kw)
        delete = getattr(self.core, f"delete_namespaced_{_KINDS[kind]}")
        return lambda namespace, name, **kw: delete(name, namespace, **kw)

    # PodGroups' calls name their group and plural as literals: tests/unit/test_chart.py reads
    # the RBAC each call needs from them.
    def _pod_group_create(self, namespace: str, body: dict, **kw):
        return self.custom.create_namespaced_custom_object(
            "scheduling.k8s.io", "v1beta1", namespace, "podgroups", body, **kw
        )

    def _pod_group_read(self, namespace: str, name: str, **kw):
        return self.custom.get_namespaced_custom_object(
            "scheduling.k8s.io", "v1beta1", namespace, "podgroups", name, **kw
        )

    def _pod_group_delete(self, namespace: str, name: str, **kw):
        return self.custom.delete_namespaced_custom_object(
            "scheduling.k8s.io", "v1beta1", namespace, "podgroups", name, **kw
        )

    @metrics.timed("create")
    def create(self, obj: dict[str, Any]) -> bool:
        """Create a namespaced child; False if it already existed."""
        create = self._call("create", obj["kind"])
        try:
            # Raw responses: nothing to gain from typed models that reject what a server omits.
            response = create(
                obj["metadata"]["namespace"],
                obj,
                field_manager=FIELD_MANAGER,
                _preload_content=False,
            )
            _release(response)
        except client.ApiException as e:
            if e.status == 409:
                return False
            if e.status in (403, 422):
                raise Refused(error_text(e)) from e
            raise
        return True

    @metrics.timed("read")
    def owners(self, kind: str, namespace: str, name: str) -> set[str] | None:
        """UIDs in the ownerReferences of an existing child; None if it is gone."""
        read = self._call("read", kind)
        try:
            response = read(namespace, name, _preload_content=False)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        meta = json.loads(response.data).get("metadata") or {}
        return {r.get("uid") for r in meta.get("ownerReferences") or []}

    @metrics.timed("delete")
    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        """Delete a child (graceful; object ``uid`` only, if given); False if it was already
        gone (or is another object now)."""
        delete = self._call("delete", kind)
        this = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
        try:
            _release(delete(namespace, name, body=this if uid else None, _preload_content=False))
        except client.ApiException as e:
            if e.status == 404 or (uid and e.status == 409):
                return False
            raise
        return True

    @metrics.timed("list_pods")
    def pods(self, namespace: str, job: str) -> list[dict]:
        """The pods labelled as ``job``'s, as the API server has them now (not a watch's
        copy), as plain dicts."""
        response = self.core.list_namespaced_pod(
            namespace, label_selector=f"ftjob.dev/job-name={job}", _preload_content=False
        )
        return json.loads(response.data).get("items") or []

    @metrics.timed("read_job")
    def job(self, namespace: str, name: str) -> dict | None:
        """The job as the API server has it now (not a watch's copy); None if it is gone."""
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def job_uid(self, namespace: str, name: str) -> str | None:
        job = self.job(namespace, name)
        return job["metadata"].get("uid") if job else None

    @metrics.timed("read_workload")
    def workload(self, namespace: str, name: str) -> dict | None:
        """Kueue's Workload ``name`` (kueue.x-k8s.io/v1beta2, Kueue 0.17's stored version);
        None if it does not exist (not made yet, or Kueue is not installed)."""
        try:
            return self.custom.get_namespaced_custom_object(
                "kueue.x-k8s.io", "v1beta2", namespace, "workloads", name
            )
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    @metrics.timed("patch_status")
    def patch_status(
        self, namespace: str, name: str, uid: str, version: str, status: dict[str, Any]
    ) -> dict:
        """Replace ``.status`` of the job ``name`` if it still is object ``uid`` at
        resourceVersion ``version`` (the copy the caller decided from); returns the job as
        written. One JSON patch, applied as a whole or not at all: its ``test`` on metadata.uid
        fails with 422 (:class:`Gone`: a status meant for a deleted job never lands on a new
        job of the same name); the resourceVersion it sets is the apiserver's optimistic-
        concurrency precondition, answered 409 (:class:`Conflict`) when the job moved on, so a
        write never overwrites one it did not read. Not a ``test`` on the resourceVersion: that
        fails with 422 too, and a moved job would read as a deleted one."""
        patch = [
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "replace", "path": "/metadata/resourceVersion", "value": version},
            {"op": "add", "path": "/status", "value": status},
        ]
        try:
            return self.custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                patch,
                field_manager=FIELD_MANAGER,
                _content_type="application/json-patch+json",
            )
        except client.ApiException as e:
            if e.status in (404, 422):
                raise Gone(f"{namespace}/{name} is no longer object {uid}") from e
            if e.status == 409:
                raise Conflict(
                    f"{namespace}/{name} changed after resourceVersion {version}, which its "
                    "status was decided from"
                ) from e
            raise

    @metrics.timed("delete_job")
    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        """Delete the job (object ``uid`` only); its children follow by owner reference."""
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                propagation_policy="Background",
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            )
        except client.ApiException as e:
            if e.status not in (404, 409):  # gone, or another object now (uid precondition)
                raise


def _release(response: urllib3.BaseHTTPResponse) -> None:
    """The connection of a response whose body nobody reads, back to the pool: unread, it
    stays with the response, and the next call opens and TLS-handshakes a new one (at 1,000
    jobs every create and delete did: a tenth of the operator's CPU, bench/RESULTS.md)."""
    response.drain_conn()
    response.release_conn()


def api_error_status(error: BaseException) -> int | None:
    """The HTTP status of an API error (for retry decisions), None for anything else."""
    return error.status if isinstance(error, client.ApiException) else None


def error_text(error: BaseException) -> str:
    if isinstance(error, client.ApiException):
        try:
            return json.loads(error.body).get("message", str(error))
        except (TypeError, ValueError):
            return f"{error.status} {error.reason}"
    return str(error)
