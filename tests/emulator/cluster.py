"""A test cluster: the API emulator and a test kubelet on a background event loop, plus a
kubeconfig that real clients (the operator, kubectl) use to reach it."""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path

import hangs
import kmock
import yaml
from apiserver import CRD_RESOURCE, ApiServer, now_iso
from hangs import FLOOR

from ftjob.api import crd


class Kubelet:
    """Moves pods along: Pending -> Running (on "node-<rank>", IP 127.0.0.1), and ends those
    the test terminates. Pods being deleted are removed, as a kubelet does once they stop."""

    def __init__(self, api: ApiServer):
        self.api = api

    def tick(self) -> None:
        for pod in self.api.objects("pods"):
            meta, ns = pod["metadata"], pod["metadata"]["namespace"]
            if meta.get("deletionTimestamp"):
                self.api.remove("pods", ns, meta["name"])
            elif pod["status"].get("phase") == "Pending":
                rank = meta.get("labels", {}).get("ftjob.dev/node-rank", "0")
                self.api.set_spec_field("pods", ns, meta["name"], "nodeName", f"node-{rank}")
                self.api.write_status("pods", ns, meta["name"], running_status())

    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(0.05)


def container_status(state: dict, ready: bool) -> dict:
    image = {"image": "ghcr.io/ftjob/trainer:test", "imageID": "sha256:0", "restartCount": 0}
    return {"name": "trainer", "ready": ready, "state": state, **image}


def running_status() -> dict:
    state = {"running": {"startedAt": now_iso()}}
    return {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "startTime": now_iso(),
        "containerStatuses": [container_status(state, True)],
    }


def terminated_status(exit_code: int, reason: str | None = None, message: str = "") -> dict:
    term = {"exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error")}
    if message:
        term["message"] = message
    return {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "podIP": "127.0.0.1",
        "containerStatuses": [container_status({"terminated": term}, False)],
    }


class Cluster:
    """``with Cluster(tmp_path) as c:`` -- c.kubeconfig, c.url, c.api (in its own thread)."""

    def __init__(self, workdir: Path, kubelet=Kubelet):
        self.workdir = workdir
        self.loop = asyncio.new_event_loop()
        self.api = ApiServer()
        self.kubelet = kubelet(self.api)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.api, kmock.Server(self.api) as server:
            self.url = str(server.url).rstrip("/")
            kubelet = asyncio.create_task(self.kubelet.run())
            self._ready.set()
            await self._stop.wait()
            kubelet.cancel()
            self.api.drop_watches()
            await asyncio.sleep(0.05)

    def __enter__(self) -> Cluster:
        self.thread.start()
        assert self._ready.wait(FLOOR), "the API emulator did not start"
        self.kubeconfig = self.workdir / "kubeconfig"
        cluster = {"server": self.url, "insecure-skip-tls-verify": False}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": cluster}],
            "users": [{"name": "tester", "user": {"token": "test"}}],
            "contexts": [
                {"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}
            ],
            "current-context": "emulator",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.call(lambda: self.api.create_object(CRD_RESOURCE, None, crd.crd()))
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(FLOOR)

    def call(self, fn):
        """Run ``fn`` on the emulator's loop (its state is not thread-safe) and return its value."""

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    # ------------------------------------------------------------------ conveniences

    def get(self, plural: str, name: str, namespace: str | None = "default"):
        return self.call(lambda: self.api.get(plural, namespace, name))

    def list(self, plural: str, namespace: str | None = "default") -> list[dict]:
        return self.call(lambda: self.api.objects(plural, namespace))

    def create_job(self, doc: dict, namespace: str = "default") -> dict:
        gvp = ("ftjob.dev", "v1alpha1", "finetunejobs")
        return self.call(lambda: self.api.create_object(gvp, namespace, copy.deepcopy(doc)))

    def patch_job_spec(self, name: str, changes: dict, namespace: str = "default") -> None:
        self.call(lambda: self.api.merge_spec("finetunejobs", namespace, name, changes))

    def terminate(self, pod: str, exit_code: int, reason=None, message="", namespace="default"):
        status = terminated_status(exit_code, reason, message)
        self.call(lambda: self.api.write_status("pods", namespace, pod, status))

    def wait(self, predicate, timeout: float = FLOOR, what: str = "condition"):
        """Poll ``predicate()`` until it returns something truthy; that value is returned."""
        return hangs.poll(predicate, timeout, what)
