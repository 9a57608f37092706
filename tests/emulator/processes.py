"""A test kubelet that runs each pod's container as a real local process.

It runs exactly the command and environment the operator rendered, through the process
runner of ``ftjob run`` (:class:`ftjob.cli.nodes.Node`), with what a node would provide mapped
to this machine: the shared volume (``/ftjob``) is a local folder, the spec ConfigMap is a
file, every "node" is 127.0.0.1 (so the rendezvous port is picked per gang). Output becomes
the termination message of a failed pod, as ``terminationMessagePolicy:
FallbackToLogsOnError`` does; a deleted pod's process group gets SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

from cluster import running_status, terminated_status

from ftjob.cli.nodes import Node, free_port
from ftjob.operator import render

GRACE_SECONDS = 5
NODE = "localhost"  # the one node every pod runs on


class ProcessKubelet:
    def __init__(self, api, workdir: Path, shared: Path):
        self.api, self.workdir, self.shared = api, workdir, shared
        self.nodes: dict[str, Node] = {}  # pod uid -> its process
        self.stopping: dict[str, float] = {}
        self.ports: dict[str, int] = {}  # rendezvous id -> node 0's port on 127.0.0.1
        self.termination_logs: dict[str, Path] = {}  # pod uid -> its terminationMessagePath

    def tick(self) -> None:
        for pod in self.api.objects("pods"):
            meta = pod["metadata"]
            uid, ns, name = meta["uid"], meta["namespace"], meta["name"]
            node = self.nodes.get(uid)
            if meta.get("deletionTimestamp"):
                if node is None or node.proc.poll() is not None:
                    self.api.remove("pods", ns, name)
                elif uid not in self.stopping:
                    self.stopping[uid] = time.monotonic()
                    node.stop(signal.SIGTERM)
                elif time.monotonic() - self.stopping[uid] > GRACE_SECONDS:
                    node.stop(signal.SIGKILL)
            elif node is None and pod["status"].get("phase") == "Pending":
                self.nodes[uid] = self._start(pod)
                self.api.set_spec_field("pods", ns, name, "nodeName", NODE)
                self.api.write_status("pods", ns, name, running_status())
            elif node is not None and pod["status"].get("phase") == "Running":
                code = node.proc.poll()
                if code is not None:
                    code = 128 - code if code < 0 else code  # -9 (SIGKILL) -> 137
                    message = self._termination_message(uid, node, code)
                    self.api.write_status("pods", ns, name, terminated_status(code, None, message))

    async def run(self) -> None:
        try:
            while True:
                self.tick()
                await asyncio.sleep(0.05)
        finally:
            for node in self.nodes.values():
                node.stop(signal.SIGKILL)

    def _start(self, pod: dict) -> Node:
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        folder = self.workdir / meta["name"] / meta["uid"][:8]
        folder.mkdir(parents=True)
        cm_name = render.spec_config_map_name(meta["labels"][render.LABEL_JOB])
        cm = self.api.get("configmaps", meta["namespace"], cm_name)
        spec_file = folder / render.SPEC_FILE
        spec_file.write_text(cm["data"][render.SPEC_FILE])
        env = {e["name"]: self._local(e["value"]) for e in container["env"] if "value" in e}
        # The downward API: the node the pod is bound to (set just after this, as a scheduler
        # binds before the kubelet starts the container).
        for e in container["env"]:
            ref = (e.get("valueFrom") or {}).get("fieldRef") or {}
            if ref.get("fieldPath") == "spec.nodeName":
                env[e["name"]] = NODE
        rdzv = env["PET_RDZV_ID"]
        port = self.ports.setdefault(rdzv, free_port())
        env |= {
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_LOCAL_ADDR": "127.0.0.1",  # every node's agent, as the Service's names would
            "PET_MASTER_PORT": str(port),
            "TMPDIR": str(folder),
            "HOME": str(folder),
            "OMP_NUM_THREADS": "1",
            "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
        }
        argv = [self._local(a) for a in container["command"]]
        argv[argv.index(f"{render.SPEC_DIR}/{render.SPEC_FILE}")] = str(spec_file)
        if argv[0] == "python":
            argv[0] = sys.executable
        # The container's terminationMessagePath, as a local file read back at exit.
        env["FTJOB_TERMINATION_LOG"] = str(folder / "termination-log")
        self.termination_logs[meta["uid"]] = folder / "termination-log"
        rank = int(meta["labels"][render.LABEL_RANK])
        return Node(rank, argv, env, folder / "log.txt", screen=None)

    def _termination_message(self, uid: str, node: Node, code: int) -> str:
        """The file the container wrote, else (on failure) its last log lines."""
        written = self.termination_logs[uid]
        if written.is_file() and written.read_text():
            return written.read_text()[:4096]
        lines = node.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-80:])[-2048:] if code else ""

    def _local(self, value: str) -> str:
        """A path on the pod's shared volume -> the local folder standing in for it."""
        mount = render.SHARED_DIR
        if value == mount or value.startswith(mount + "/"):
            return str(self.shared) + value[len(mount) :]
        return value
