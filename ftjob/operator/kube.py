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

from kubernetes import client, config

from ftjob.operator import metrics
from ftjob.spec import GROUP, PLURAL, VERSION

FIELD_MANAGER = "ftjob-operator"
_KINDS = {"Pod": "pod", "Service": "service", "ConfigMap": "config_map"}


class Kube:
    def __init__(self, api: client.ApiClient | None = None):
        if api is None:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            else:
                config.load_kube_config()
            api = client.ApiClient()
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    @metrics.timed("create")
    def create(self, obj: dict[str, Any]) -> bool:
        """Create a namespaced core object; False if it already existed."""
        create = getattr(self.core, f"create_namespaced_{_KINDS[obj['kind']]}")
        try:
            # Raw responses: nothing to gain from typed models that reject what a server omits.
            create(
                obj["metadata"]["namespace"],
                obj,
                field_manager=FIELD_MANAGER,
                _preload_content=False,
            )
        except client.ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    @metrics.timed("delete_pod")
    def delete_pod(self, namespace: str, name: str) -> bool:
        """Delete a pod (graceful); False if it was already gone."""
        try:
            self.core.delete_namespaced_pod(name, namespace, _preload_content=False)
        except client.ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    @metrics.timed("patch_status")
    def patch_status(self, namespace: str, name: str, changes: dict[str, Any]) -> dict:
        """Merge-patch ``.status`` through the status subresource; returns the new object."""
        return self.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": changes},
            field_manager=FIELD_MANAGER,
            _content_type="application/merge-patch+json",
        )

    @metrics.timed("delete_job")
    def delete_job(self, namespace: str, name: str) -> None:
        """Delete the job; its children follow by owner reference (garbage collection)."""
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Background"
            )
        except client.ApiException as e:
            if e.status != 404:
                raise


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
