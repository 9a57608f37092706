"""A node of the real control plane whose pods run as podman containers: a small kubelet.

    python tests/cluster/podman_node.py --kubeconfig DIR/admin.kubeconfig --name podman-0

It registers a Node with this machine's capacity (no kwok annotation: kwok leaves it alone),
renews its Lease and Ready condition, and runs every pod the scheduler binds to it: a podman
pod (the sandbox: its own network namespace on podman's bridge, so two pods never share a
port) and the pod's first container in it, translated by tests/images/podrun.py (command,
env with the downward API, security context, ConfigMap, claim -> the PersistentVolume's
hostPath, emptyDir, termination message file). The DNS names of a headless Service's pods
(``hostname.subdomain.namespace.svc``) are a hosts file per subdomain, rewritten in place as
pods get addresses, as cluster DNS would answer. It writes the pod's status as a kubelet does
(podIP, container state, phase, exit code, termination message), stops a deleted pod's
container (SIGTERM, SIGKILL after the grace period) and then removes the object, and on
SIGTERM removes every container it started (they carry the label ``ftjob-podman-node``).

Not a kubelet: no probes, no resource limits, no restarts (restartPolicy Never is what ftjob
renders), no image pulls, admin credentials instead of the node's own identity.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "images"))
from podrun import PODMAN, run_argv  # noqa: E402  (the pod -> podman translation)

LABEL = "ftjob-podman-node"  # on every podman pod and container: the node that made it
NODE_LABEL = "ftjob.dev/podman-node"  # on the Node: what a job's nodeSelector names
HEARTBEAT = 10  # seconds between Lease renewals and Ready updates (a kubelet's default)
LEASE_SECONDS = 40
MESSAGE_LIMIT = 4096  # a kubelet's cap on a termination message
LOG_LINES = 80  # FallbackToLogsOnError: the last lines of the log, 2048 bytes at most


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def podman(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)


@dataclass
class Running:
    """A pod this node started: its podman pod (sandbox) and container."""

    uid: str
    namespace: str
    name: str
    sandbox: str
    cname: str = "trainer"  # the container's name in the pod spec
    container: str = ""  # podman's name for it
    started: str = field(default_factory=now)
    termination: Path | None = None
    policy: str = "File"
    ip: str = ""
    final: bool = False  # Succeeded or Failed reported


class PodmanNode:
    def __init__(self, api: client.ApiClient, name: str, workdir: Path, labels=None):
        self.api, self.name, self.workdir = api, name, workdir
        self.core = client.CoreV1Api(api)
        self.leases = client.CoordinationV1Api(api)
        self.labels = {NODE_LABEL: "true", **(labels or {})}
        self.pods: dict[str, Running] = {}
        self.deleting: set[str] = set()  # uids whose stop runs in a thread
        self.hosts_written: dict[Path, str] = {}

    # ------------------------------------------------------------------ the Node and Lease

    def capacity(self) -> dict[str, str]:
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return {"cpu": str(os.cpu_count() or 1), "memory": f"{pages // 1024}Ki", "pods": "110"}

    def register(self) -> None:
        self.remove_containers()  # a node starting afresh runs nothing from a former life
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **self.labels,
        }
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels},
            "spec": {},
        }
        try:
            self.core.create_node(body)
        except client.ApiException as e:
            if e.status != 409:
                raise
            self.core.patch_node(self.name, {"metadata": {"labels": labels}})
        self.heartbeat()

    def node_status(self) -> dict:
        stamp = now()
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "podman node is posting ready status",
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": stamp,
        }
        cap = self.capacity()
        return {
            "capacity": cap,
            "allocatable": cap,
            "conditions": [ready],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.name},
            ],
            "nodeInfo": {
                "kubeletVersion": "podman",
                "containerRuntimeVersion": "podman",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "osImage": "",
                "kernelVersion": os.uname().release,
                "kubeProxyVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }

    def heartbeat(self) -> None:
        """Ready and the Lease: without them the node lifecycle controller taints the node
        unreachable and evicts its pods."""
        self.core.patch_node_status(self.name, {"status": self.node_status()})
        # A MicroTime: the client writes a datetime's isoformat(), which drops the fraction
        # the server's parser insists on when the microsecond happens to be 0.
        renew = datetime.datetime.now(datetime.timezone.utc)
        renew = renew.replace(microsecond=max(1, renew.microsecond))
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": renew,
        }
        body = {"metadata": {"name": self.name, "namespace": "kube-node-lease"}, "spec": spec}
        try:
            self.leases.patch_namespaced_lease(self.name, "kube-node-lease", {"spec": spec})
        except client.ApiException as e:
            if e.status != 404:
                raise
            self.leases.create_namespaced_lease("kube-node-lease", body)

    # ------------------------------------------------------------------ the pods

    def bound(self) -> list[dict]:
        found = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}")
        return self.api.sanitize_for_serialization(found)["items"]

    def sync(self) -> None:
        """One pass: start what is new, report what ended, stop what is deleted."""
        pods = self.bound()
        self.write_hosts()
        uids = set()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            uids.add(uid)
            run = self.pods.get(uid)
            if pod["metadata"].get("deletionTimestamp"):
                if uid not in self.deleting:
                    self.delete(pod, run)
            elif run is None and pod["status"].get("phase") in (None, "Pending"):
                self.start(pod)
            elif run is not None and not run.final:
                self.check(run)
        for uid in set(self.pods) - uids - self.deleting:  # gone from the API (grace 0)
            self.forget(self.pods[uid])

    def claims(self, pod: dict) -> dict[str, str]:
        """claimName -> the host folder of the PersistentVolume it is bound to (hostPath)."""
        out = {}
        ns = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes", []):
            if claim := volume.get("persistentVolumeClaim"):
                pvc = self.core.read_namespaced_persistent_volume_claim(claim["claimName"], ns)
                pv = self.core.read_persistent_volume(pvc.spec.volume_name)
                out[claim["claimName"]] = pv.spec.host_path.path
        return out

    def configmaps(self, pod: dict) -> dict[str, dict]:
        ns = pod["metadata"]["namespace"]
        names = [v["configMap"]["name"] for v in pod["spec"].get("volumes", []) if "configMap" in v]
        return {n: {"data": self.core.read_namespaced_config_map(n, ns).data or {}} for n in names}

    def secrets(self, pod: dict) -> dict[str, dict]:
        ns, out = pod["metadata"]["namespace"], {}
        for env in pod["spec"]["containers"][0].get("env", []):
            if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                data = self.core.read_namespaced_secret(ref["name"], ns).data or {}
                out[ref["name"]] = {k: base64.b64decode(v).decode() for k, v in data.items()}
        return out

    def start(self, pod: dict) -> None:
        meta = pod["metadata"]
        sandbox = f"{self.name}-{meta['namespace']}-{meta['name']}-{meta['uid'][:8]}"
        run = Running(meta["uid"], meta["namespace"], meta["name"], sandbox)
        self.pods[run.uid] = run
        try:
            self.create_sandbox(run)
            self.write_hosts(extra={run.uid: run.ip})
            self.run_container(pod, run)
        except Exception as e:  # noqa: BLE001  a pod that cannot start is reported, as a kubelet does
            self.report(
                run,
                "Pending",
                waiting={"reason": "CreateContainerError", "message": str(e)[-2000:]},
            )
            return
        self.report(run, "Running", running={"startedAt": now()})

    def create_sandbox(self, run: Running) -> None:
        # Only the network namespace is shared: the container sets its own hostname.
        argv = ["pod", "create", "--name", run.sandbox, "--label", f"{LABEL}={self.name}"]
        done = podman(*argv, "--network", "podman", "--share", "net")
        assert done.returncode == 0, done.stderr
        assert podman("pod", "start", run.sandbox).returncode == 0
        infra = podman("pod", "inspect", "--format", "{{.InfraContainerID}}", run.sandbox)
        ip = podman("inspect", "--format", "{{.NetworkSettings.IPAddress}}", infra.stdout.strip())
        run.ip = ip.stdout.strip()
        assert run.ip, f"the sandbox {run.sandbox} has no address: {ip.stderr}"

    def run_container(self, pod: dict, run: Running) -> None:
        container = pod["spec"]["containers"][0]
        run.cname, run.container = container["name"], f"{run.sandbox}-{container['name']}"
        run.policy = container.get("terminationMessagePolicy", "File")
        argv, run.termination = run_argv(
            pod,
            run.container,
            self.workdir / "pods" / run.sandbox,
            configmaps=self.configmaps(pod),
            claims=self.claims(pod),
            secrets=self.secrets(pod),
            network=f"pod:{run.sandbox}",
            etc_hosts=self.hosts_file(pod),
        )
        argv[2:2] = ["--label", f"{LABEL}={self.name}"]
        done = podman(*argv)
        assert done.returncode == 0, done.stderr

    def hosts_file(self, pod: dict) -> Path:
        spec, ns = pod["spec"], pod["metadata"]["namespace"]
        path = self.workdir / "hosts" / f"{ns}.{spec.get('subdomain') or pod['metadata']['name']}"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("127.0.0.1\tlocalhost\n")
        self.write_hosts()
        return path

    def write_hosts(self, extra: dict[str, str] | None = None) -> None:
        """Every pod with an address (on any node: the API's podIP, and this node's own
        new ones in ``extra``) under its names, one file per headless Service. Rewritten in
        place: the containers bind-mount it."""
        entries: dict[Path, list[str]] = {}
        ips = {**{r.uid: r.ip for r in list(self.pods.values())}, **(extra or {})}
        for pod in self.api.sanitize_for_serialization(self.core.list_pod_for_all_namespaces())[
            "items"
        ]:
            spec, meta = pod["spec"], pod["metadata"]
            ip = pod.get("status", {}).get("podIP") or ips.get(meta["uid"])
            host, sub, ns = spec.get("hostname"), spec.get("subdomain"), meta["namespace"]
            if not (ip and host and sub) or meta.get("deletionTimestamp"):
                continue
            names = f"{host}.{sub}.{ns}.svc.cluster.local {host}.{sub}.{ns}.svc {host}.{sub} {host}"
            entries.setdefault(self.workdir / "hosts" / f"{ns}.{sub}", []).append(f"{ip}\t{names}")
        for path in (self.workdir / "hosts").glob("*") if (self.workdir / "hosts").exists() else []:
            text = "\n".join(["127.0.0.1\tlocalhost", *sorted(entries.get(path, []))]) + "\n"
            if self.hosts_written.get(path) != text:
                with open(path, "r+") as f:  # the same inode: bind mounts see the change
                    f.seek(0)
                    f.truncate()
                    f.write(text)
                self.hosts_written[path] = text

    def check(self, run: Running) -> None:
        out = podman("inspect", "--format", "{{json .State}}", run.container)
        if out.returncode != 0:
            return
        state = json.loads(out.stdout)
        if state["Status"] not in ("exited", "stopped"):
            return
        code = int(state["ExitCode"])
        reason = "OOMKilled" if state.get("OOMKilled") else ("Completed" if code == 0 else "Error")
        terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": now(),
            "finishedAt": now(),
            "containerID": f"podman://{run.container}",
        }
        if message := self.message(run, code):
            terminated["message"] = message
        self.report(run, "Succeeded" if code == 0 else "Failed", terminated=terminated)
        run.final = True

    def message(self, run: Running, code: int) -> str:
        """The termination message: the file the container wrote, else (FallbackToLogsOnError,
        a failure) the log's last lines."""
        text = (
            run.termination.read_text(errors="replace")[:MESSAGE_LIMIT] if run.termination else ""
        )
        if not text.strip() and code and run.policy == "FallbackToLogsOnError":
            done = subprocess.run(
                [*PODMAN, "logs", "--tail", str(LOG_LINES), run.container],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=60,
            )
            text = done.stdout.encode()[-2048:].decode(errors="replace")
        return text

    def report(self, run: Running, phase: str, **state) -> None:
        """The pod's status subresource, as a kubelet writes it."""
        ready = "True" if phase == "Running" else "False"
        conditions = [
            {"type": t, "status": s, "lastTransitionTime": now()}
            for t, s in (
                ("Initialized", "True"),
                ("Ready", ready),
                ("ContainersReady", ready),
                ("PodScheduled", "True"),
            )
        ]
        container = {
            "name": run.cname,
            "ready": ready == "True",
            "restartCount": 0,
            "image": "",
            "imageID": "",
            "started": phase == "Running",
            "state": state,
        }
        status = {
            "phase": phase,
            "conditions": conditions,
            "hostIP": "127.0.0.1",
            "containerStatuses": [container],
        }
        if run.ip:
            status |= {"podIP": run.ip, "podIPs": [{"ip": run.ip}], "startTime": run.started}
        try:
            self.core.patch_namespaced_pod_status(run.name, run.namespace, {"status": status})
        except client.ApiException as e:
            if e.status != 404:  # deleted meanwhile: nothing to report to
                raise

    def delete(self, pod: dict, run: Running | None) -> None:
        """SIGTERM, SIGKILL after the grace period, then the object goes (grace 0): in a
        thread, as the grace period may be long."""
        self.deleting.add(pod["metadata"]["uid"])
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        uid = pod["metadata"]["uid"]
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]

        def stop():
            if run is not None and run.container:
                podman("stop", "-t", str(grace), run.container, timeout=grace + 120)
                if not run.final:
                    self.check(run)
                self.forget(run)
            precondition = client.V1Preconditions(uid=uid)
            body = client.V1DeleteOptions(grace_period_seconds=0, preconditions=precondition)
            try:
                self.core.delete_namespaced_pod(name, ns, body=body)
            except client.ApiException as e:
                if e.status not in (404, 409):
                    raise
            finally:
                self.deleting.discard(uid)

        threading.Thread(target=stop, daemon=True, name=f"delete-{name}").start()

    def forget(self, run: Running) -> None:
        podman("pod", "rm", "-f", "-t", "0", run.sandbox)
        self.pods.pop(run.uid, None)

    def remove_containers(self) -> None:
        """Every podman pod (and so container) this node made, by its label."""
        found = podman("pod", "ps", "-q", "--filter", f"label={LABEL}={self.name}")
        for pod_id in found.stdout.split():
            podman("pod", "rm", "-f", "-t", "0", pod_id)
        left = podman("ps", "-aq", "--filter", f"label={LABEL}={self.name}")
        for container in left.stdout.split():
            podman("rm", "-f", "-t", "0", container)

    # ------------------------------------------------------------------ the loop

    def serve(self, stop: threading.Event, every: float = 0.5) -> None:
        self.register()
        beat = threading.Thread(target=self.beat, args=(stop,), daemon=True, name="heartbeat")
        beat.start()
        while not stop.is_set():
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001  a node outlives one failed pass (a 409, a timeout)
                print(f"podman-node {self.name}: sync failed: {e!r}", file=sys.stderr, flush=True)
            stop.wait(every)

    def beat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT):
            try:
                self.heartbeat()
            except Exception as e:  # noqa: BLE001
                print(f"podman-node {self.name}: heartbeat failed: {e!r}", file=sys.stderr)

    def shutdown(self, delete_node: bool = True) -> None:
        """Remove every container started here, and the Node (its pods would wait for a
        kubelet that never comes back)."""
        self.remove_containers()
        if delete_node:
            try:
                self.core.delete_node(self.name)
            except client.ApiException as e:
                if e.status != 404:
                    raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--name", default="podman-0", help="the Node's name")
    parser.add_argument(
        "--workdir", help="hosts files, termination messages (default: a temp folder)"
    )
    parser.add_argument("--label", action="append", default=[], help="KEY=VALUE on the Node")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or f"/tmp/ftjob-podman-node-{args.name}")
    workdir.mkdir(parents=True, exist_ok=True)
    api = config.new_client_from_config(config_file=args.kubeconfig)
    node = PodmanNode(api, args.name, workdir, dict(x.split("=", 1) for x in args.label))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"podman-node {args.name}: serving (stop with SIGTERM or Ctrl-C)", flush=True)
    try:
        node.serve(stop)
    finally:
        node.shutdown()
        print(f"podman-node {args.name}: stopped, every container removed", flush=True)


if __name__ == "__main__":
    main()
