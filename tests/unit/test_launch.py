"""launch.py: the per-node command and environment (pure).

python -m pytest tests/unit/test_launch.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ftjob.api.jobspec import parse_spec
from ftjob.api.schema import SpecError
from ftjob.job import launch


def _raw() -> dict:
    return {
        "model": {"source": "hf://meta-llama/Meta-Llama-3-8B"},
        "dataset": {"source": "data/train.jsonl"},
        "training": {"maxSteps": 10},
        "resources": {"nodes": 2, "gpusPerNode": 8},
        "checkpoint": {"volume": {"claimName": "shared"}},
    }


def spec(**sections):
    raw = _raw()
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return parse_spec(raw)


def command(s=None, node=0, **kw):
    return launch.node_command(
        s or spec(), "job", node, "job-node-0.job", "job-3", "/etc/ftjob/spec.json", **kw
    )


def test_every_node_runs_the_same_command_through_the_agent():
    a, b = command(node=0), command(node=1)
    assert (
        a.argv
        == b.argv
        == [
            "python",
            "-m",
            "ftjob.trainer.node",
            "-m",
            "ftjob.trainer",
            "--spec",
            "/etc/ftjob/spec.json",
        ]
    )
    assert {k for k in a.env if a.env[k] != b.env.get(k)} == {"PET_NODE_RANK", "PET_LOCAL_ADDR"}


def test_each_agent_is_reached_at_the_address_it_is_given_node_0_at_the_master_address():
    # The others must resolve it: not left to socket.getfqdn() inside the pod.
    assert command(node=0).env["PET_LOCAL_ADDR"] == "job-node-0.job"
    assert command(node=1, node_addr="job-node-1.job").env["PET_LOCAL_ADDR"] == "job-node-1.job"
    assert "PET_LOCAL_ADDR" not in command(node=1).env  # unknown: torch looks it up


def test_torchrun_is_wired_through_its_environment():
    env = command(node=1).env
    assert env["PET_NNODES"] == "2"
    assert env["PET_NPROC_PER_NODE"] == "8"
    assert env["PET_NODE_RANK"] == "1"
    assert env["PET_MASTER_ADDR"] == "job-node-0.job"
    assert env["PET_MASTER_PORT"] == "29500"  # network.rendezvousPort's default
    assert env["PET_RDZV_ID"] == "job-3"
    # Restarts in place over a c10d rendezvous that node 0 hosts, then the operator's gangs.
    assert env["PET_RDZV_BACKEND"] == "c10d"
    assert env["PET_MAX_RESTARTS"] == "3"  # runPolicy.inPlaceRestarts' default
    assert command(spec(runPolicy={"inPlaceRestarts": 0})).env["PET_MAX_RESTARTS"] == "0"


def test_trainer_environment_defaults_to_the_volume():
    env = command().env
    assert env["FTJOB_JOB_DIR"] == "/ftjob/job"
    assert env["FTJOB_SOURCE_ROOT"] == "/ftjob"
    s = spec(checkpoint={"path": "teams/a/run-1"})
    assert command(s).env["FTJOB_JOB_DIR"] == "/ftjob/teams/a/run-1"
    local = command(master_port=4321, job_folder="/w/runs/job", source_root="/w").env
    assert (local["PET_MASTER_PORT"], local["FTJOB_JOB_DIR"]) == ("4321", "/w/runs/job")
    assert local["FTJOB_SOURCE_ROOT"] == "/w"


def test_the_job_folder_carries_the_uid_and_holds_the_hub_cache():
    uid = "3f2a9c1e-0000-4000-8000-000000000000"
    assert launch.job_dir(spec(), "job", uid=uid) == "/ftjob/job-3f2a9c1e"
    # A folder the user names is reused by whichever job names it.
    assert launch.job_dir(spec(checkpoint={"path": "runs/a"}), "job", uid=uid) == "/ftjob/runs/a"
    assert command().env["HF_HOME"] == "/ftjob/job/hub"
    assert command(job_folder="/w/runs/job").env["HF_HOME"] == "/w/runs/job/hub"
    shared = parse_spec({**_raw(), "env": [{"name": "HF_HOME", "value": "/ftjob/hub-cache"}]})
    assert command(shared).env["HF_HOME"] == "/ftjob/hub-cache"  # shared between jobs


def test_compiled_layers_are_cached_in_the_job_folder():
    # On the volume: a restarted process or a new gang loads them instead of compiling again.
    assert command().env["TORCHINDUCTOR_CACHE_DIR"] == "/ftjob/job/compile-cache"
    local = command(job_folder="/w/runs/job").env["TORCHINDUCTOR_CACHE_DIR"]
    assert local == "/w/runs/job/compile-cache"
    own = parse_spec({**_raw(), "env": [{"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/c"}]})
    assert command(own).env["TORCHINDUCTOR_CACHE_DIR"] == "/c"


def test_fabric_nccl_and_user_environment():
    s = spec(network={"fabric": "efa", "efaDevicesPerNode": 32, "ncclEnv": {"NCCL_PROTO": "LL128"}})
    env = command(s).env
    assert env["NCCL_PROTO"] == "LL128"
    # The fabric's settings come with the command: pods and `ftjob run` on GPUs get the same.
    assert env["FI_PROVIDER"] == "efa" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "FI_PROVIDER" not in command(spec(resources={"gpusPerNode": 0})).env
    s = parse_spec(
        {
            "model": {"source": "m"},
            "dataset": {"source": "d.jsonl"},
            "training": {"maxSteps": 1},
            "env": [{"name": "WANDB_MODE", "value": "offline"}],
            "network": {"socketInterface": "eth0"},
        }
    )
    env = command(s).env
    assert env["WANDB_MODE"] == "offline" and env["NCCL_SOCKET_IFNAME"] == "eth0"


def test_env_takes_ftjobs_knobs_and_refuses_its_wiring():
    """A profile's window is the user's to set in spec.env (docs/gpu.md tells a cluster job to);
    the variables ftjob wires torchrun and the trainer with are refused, naming the field."""
    knob = parse_spec({**_raw(), "env": [{"name": "FTJOB_PROFILE_STEPS", "value": "3"}]})
    assert command(knob).env["FTJOB_PROFILE_STEPS"] == "3"
    for name in ("FTJOB_GRACE_SECONDS", "FTJOB_JOB_DIR", "PET_NNODES", "RANK", "HF_TOKEN"):
        with pytest.raises(SpecError) as e:
            parse_spec({**_raw(), "env": [{"name": name, "value": "1"}]})
        (error,) = e.value.errors
        assert error.path == "spec.env" and "FTJOB_PROFILE_STEPS" in str(error), (name, error)


def test_token_travels_only_as_a_secret_reference():
    s = spec(secrets={"huggingFaceToken": {"name": "hf", "key": "token"}})
    cmd = command(s)
    assert "HF_TOKEN" not in cmd.env
    assert (cmd.secret_env["HF_TOKEN"].name, cmd.secret_env["HF_TOKEN"].key) == ("hf", "token")
    assert command().secret_env == {}


def test_cpu_jobs_get_their_share_of_cpus_per_process():
    s = spec(resources={"gpusPerNode": 0, "processesPerNode": 4, "cpu": "16"})
    assert command(s).env["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in command(spec(resources={"gpusPerNode": 0})).env
    assert "OMP_NUM_THREADS" not in command().env  # GPU jobs: torchrun's default


def test_node_rank_outside_the_gang_is_refused():
    with pytest.raises(ValueError, match="node_rank 2"):
        command(node=2)


def test_launch_imports_no_torch():
    code = "import sys, ftjob.job.launch, ftjob.cli.run; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
