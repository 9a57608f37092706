"""scripts/k8s.sh as other tools call it: `up DIR --gpu-nodes N` starts a plane that says
v1.37.2 with N GPU nodes, `down DIR` leaves no process behind, options it does not know are
refused by name."""

from __future__ import annotations

import json
import os
import subprocess

from plane import K8S_SH, KUBECTL, Plane, build


def k8s_sh(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KUBECTL=KUBECTL or "kubectl")
    return subprocess.run(["bash", str(K8S_SH), *args], capture_output=True, text=True, env=env)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_up_starts_n_gpu_nodes_and_down_leaves_no_process(tmp_path):
    build()
    started = k8s_sh("up", str(tmp_path), "--gpu-nodes", "1")
    assert started.returncode == 0, started.stdout + started.stderr
    pids = [int(line.split()[1]) for line in (tmp_path / "pids").read_text().splitlines()]
    try:
        plane = Plane(tmp_path)
        version = json.loads(plane.kubectl("version", "-o", "json").stdout)
        assert version["serverVersion"]["gitVersion"] == "v1.37.2"
        nodes = plane.get("nodes", namespace="default")
        assert [n["status"]["allocatable"]["nvidia.com/gpu"] for n in nodes] == ["8"]
        assert len(pids) == 5 and all(alive(p) for p in pids)
    finally:
        stopped = k8s_sh("down", str(tmp_path))
    assert stopped.returncode == 0, stopped.stderr
    assert not [p for p in pids if alive(p)]


def test_unknown_options_are_refused_by_name(tmp_path):
    # --kueue: test_kueue.py; --nodes N: test_real_nodes.py.
    for options in (["--gpus"], ["--nodes"], ["--nodes", "two"], ["--gpu-nodes", "x"]):
        result = k8s_sh("up", str(tmp_path), *options)
        assert result.returncode != 0 and options[0] in result.stderr, result.stderr
    assert not (tmp_path / "pids").exists()
