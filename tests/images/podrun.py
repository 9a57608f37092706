"""A Pod as a podman container, the way a kubelet would run it (what these tests need of one).

:func:`run_argv` turns a rendered Pod (its first container) into ``podman run`` arguments:

* ``command`` / ``args`` replace the image's ENTRYPOINT / CMD, ``env`` and ``workingDir`` as
  given (a ``secretKeyRef`` from ``secrets``, a ``fieldRef`` from the pod's metadata);
* the security context: ``runAsUser``/``runAsGroup`` -> ``--user``, ``fsGroup`` and
  ``supplementalGroups`` -> ``--group-add``, ``readOnlyRootFilesystem`` -> ``--read-only``
  (and none of podman's own writable tmpfs on /tmp, /run, /var/tmp), capabilities dropped and
  added, ``allowPrivilegeEscalation: false`` -> ``no-new-privileges``, seccomp
  ``RuntimeDefault`` -> podman's default profile; ``runAsNonRoot`` is checked;
* volumes: a configMap's data as read-only files, a persistentVolumeClaim as a host folder
  (``claims``), an emptyDir as a tmpfs (``medium: Memory`` or not);
* the termination message file is a host file bind-mounted at ``terminationMessagePath``
  (``/dev/termination-log``), as the kubelet does, so the test reads what the container wrote;
* ``hostname``, and an /etc/hosts of the kubelet's kind in which the DNS names of the gang's
  headless Service (``hosts``) are 127.0.0.1, as every "node" is this machine.

Not emulated: resource limits (requests = limits: the machine's cores are shared), the
service-account token (the rendered pods mount none), image pulls (the image is local).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

# crun refuses this machine's cgroups; there is no systemd (scripts/podman-host.sh).
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
NODE_NAME = "podman-node"  # what spec.nodeName resolves to for every pod run here


def podman(*args: str, check: bool = True, timeout: float = 120, **kw) -> str:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} ...: {result.stderr[-2000:]}")
    return result.stdout


def _security(pod_ctx: dict, ctx: dict, image_user: str) -> list[str]:
    merged = {**pod_ctx, **ctx}  # the container's settings win over the pod's
    argv = []
    uid, gid = merged.get("runAsUser"), merged.get("runAsGroup")
    if uid is not None:
        argv += ["--user", f"{uid}:{gid if gid is not None else 0}"]
    if merged.get("runAsNonRoot"):
        effective = str(uid) if uid is not None else image_user.split(":")[0]
        assert effective not in ("", "0", "root"), "runAsNonRoot, but it would run as root"
    groups = [*([pod_ctx["fsGroup"]] if "fsGroup" in pod_ctx else [])]
    groups += pod_ctx.get("supplementalGroups", [])
    for group in groups:
        argv += ["--group-add", str(group)]
    if ctx.get("readOnlyRootFilesystem"):
        argv += ["--read-only", "--read-only-tmpfs=false"]
    if ctx.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    if ctx.get("privileged"):
        argv += ["--privileged"]
    caps = ctx.get("capabilities", {})
    argv += [a for cap in caps.get("drop", []) for a in ("--cap-drop", cap)]
    argv += [a for cap in caps.get("add", []) for a in ("--cap-add", cap)]
    seccomp = merged.get("seccompProfile", {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        argv += ["--security-opt", "seccomp=unconfined"]
    else:
        assert seccomp == "RuntimeDefault", f"seccomp profile {seccomp} is not emulated"
    return argv


def _volumes(pod: dict, container: dict, folder: Path, configmaps: dict, claims: dict) -> list:
    argv = []
    sources = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume, path = sources[mount["name"]], mount["mountPath"]
        ro = ",ro" if mount.get("readOnly") else ""
        if "configMap" in volume:
            data = configmaps[volume["configMap"]["name"]]["data"]
            host = folder / f"configmap-{mount['name']}"
            host.mkdir()
            for key, text in data.items():
                (host / key).write_text(text)
            argv += ["-v", f"{host}:{path}:ro"]
        elif "persistentVolumeClaim" in volume:
            host = claims[volume["persistentVolumeClaim"]["claimName"]]
            argv += ["-v", f"{host}:{path}{ro.replace(',', ':')}"]
        elif "emptyDir" in volume:
            # Mode 1777 as an emptyDir's 0777 (+ sticky); exec allowed, as on a node.
            argv += ["--tmpfs", f"{path}:rw,exec,nosuid,nodev,mode=1777"]
        else:
            raise AssertionError(f"volume {volume} is not emulated")
    return argv


def hosts_of(pods: list[dict]) -> dict[str, str]:
    """Every pod's DNS names under its headless Service (hostname.subdomain.namespace.svc,
    with and without the cluster domain) -> 127.0.0.1: all "nodes" are this machine."""
    names = {}
    for pod in pods:
        spec, ns = pod["spec"], pod["metadata"].get("namespace", "default")
        host, sub = spec.get("hostname"), spec.get("subdomain")
        if host and sub:
            for name in (f"{host}.{sub}", f"{host}.{sub}.{ns}.svc",
                         f"{host}.{sub}.{ns}.svc.cluster.local"):  # fmt: skip
                names[name] = "127.0.0.1"
    return names


def run_argv(
    pod: dict,
    name: str,
    folder: Path,
    *,
    configmaps: dict | None = None,
    claims: dict | None = None,
    hosts: dict | None = None,
    network: str = "none",
    secrets: dict | None = None,
    extra_env: dict | None = None,
) -> tuple[list[str], Path]:
    """``podman run -d`` arguments for ``pod``'s first container, and the host file standing
    in for its termination message. ``folder`` (new, empty) holds what the pod's volumes need.
    ``extra_env`` is what a node would add (the tests keep it to thread counts). ``network``
    ``pod:NAME`` joins a podman pod's network namespace (its sandbox)."""
    spec = pod["spec"]
    container = spec["containers"][0]
    folder.mkdir(parents=True)
    image_user = podman("image", "inspect", "--format", "{{.Config.User}}", container["image"])
    argv = ["run", "-d", "--name", name, "--pull", "never", "--log-driver", "k8s-file"]
    argv += ["--label", f"ftjob-test.pod={pod['metadata']['name']}"]
    if spec.get("hostname"):
        argv += ["--hostname", spec["hostname"]]
    argv += ["--pod", network[4:]] if network.startswith("pod:") else ["--network", network]
    # /etc/hosts as the kubelet writes it (its own file, bind-mounted; also in containers that
    # join another's network namespace, where podman refuses --add-host).
    etc_hosts = folder / "hosts"
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{ip}\t{host}" for host, ip in (hosts or {}).items()]
    if spec.get("hostname"):
        lines.append(f"127.0.0.1\t{spec['hostname']}")
    etc_hosts.write_text("\n".join(lines) + "\n")
    argv += ["--no-hosts", "-v", f"{etc_hosts}:/etc/hosts:ro"]
    argv += _security(spec.get("securityContext", {}), container.get("securityContext", {}),
                      image_user.strip())  # fmt: skip
    argv += _volumes(pod, container, folder, configmaps or {}, claims or {})
    termination = folder / "termination-log"
    termination.touch()
    termination.chmod(0o666)  # as the kubelet makes it: writable by any container user
    argv += [
        "-v",
        f"{termination}:{container.get('terminationMessagePath', DEFAULT_TERMINATION_PATH)}",
    ]
    for env in container.get("env", []):
        source = env.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = (secrets or {})[ref["name"]][ref["key"]]
        elif "fieldRef" in source:  # the downward API, as the kubelet fills it in
            path = source["fieldRef"]["fieldPath"]
            if path == "spec.nodeName":  # the node the pod was bound to: here, this machine
                value = pod["spec"].get("nodeName") or NODE_NAME
            else:
                kind, _, field = path.partition(".")
                assert kind == "metadata" and field in ("name", "namespace"), source
                value = pod["metadata"].get(field, "default")
        else:
            value = env.get("value", "")
        argv += ["--env", f"{env['name']}={value}"]
    for key, value in (extra_env or {}).items():
        argv += ["--env", f"{key}={value}"]
    if container.get("workingDir"):
        argv += ["--workdir", container["workingDir"]]
    command, args = container.get("command"), container.get("args", [])
    if command:
        argv += ["--entrypoint", json.dumps(command)]
    argv += [container["image"], *args]
    return argv, termination


def logs(name: str) -> str:
    """The container's output, stdout and stderr together (podman keeps them apart)."""
    result = subprocess.run([*PODMAN, "logs", name], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=60)  # fmt: skip
    return result.stdout


def layer_writes(name: str) -> list[str]:
    """What a container changed in its own layer besides the mount points the runtime made
    there (and their parent folders): the files it wrote outside its volumes."""
    inspect = json.loads(podman("inspect", name))[0]
    mounts = [m["Destination"] for m in inspect["Mounts"]] + ["/etc/hosts", "/tmp"]
    changed = json.loads(podman("diff", "--format", "json", name) or "{}")
    paths = [p for kind in changed.values() for p in kind]
    # The mount points at least are there: an empty diff would mean the check saw nothing.
    assert paths, f"podman diff {name} shows not even the mount points"
    return [p for p in paths if not any(m == p or m.startswith(p + "/") for m in mounts)]


def state(name: str) -> tuple[str, int]:
    """(status, exit code) of a container: ("running", 0), ("exited", 137), ..."""
    out = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name)
    status, code = out.split()
    return status, int(code)


def remove(*names: str) -> None:
    """Remove containers, last first: one that joined another's namespace goes before it."""
    for name in reversed(names):
        podman("rm", "-f", "-t", "0", name, check=False)


def fs_group(path: Path, gid: int) -> None:
    """What the kubelet does to a volume for ``fsGroup``: group-owned, group-writable, new
    files inherit the group (setgid directories)."""
    for root, dirs, files in os.walk(path):
        for entry in [root, *(os.path.join(root, f) for f in files)]:
            os.chown(entry, -1, gid)
        os.chmod(root, 0o2775)
        for f in files:
            os.chmod(os.path.join(root, f), os.stat(os.path.join(root, f)).st_mode | 0o060)
        del dirs  # walked by os.walk itself
