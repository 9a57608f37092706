"""The command and environment of one node of a FineTuneJob (PURE: no torch, no I/O).

Every node runs the same command::

    python -m ftjob.trainer.node -m ftjob.trainer --spec /etc/ftjob/spec.json

(:mod:`ftjob.trainer.node`, which takes SIGTERM first and then runs torchrun's elastic agent
with ftjob's restart rules, :mod:`ftjob.trainer.agent`) and differs
only in its environment: the agent reads torchrun's options from ``PET_*`` variables
(``PET_NODE_RANK=1`` is ``--node-rank 1``), the trainer reads ``FTJOB_*``. The operator puts
:func:`node_command`'s result into each pod; ``ftjob run`` runs it as local processes.

    python -c "from ftjob.api import jobspec as s; from ftjob.job import launch as l; print(
        l.node_command(s.parse_spec({'model': {'source': 'm'}, 'dataset': {'source': 'd.jsonl'},
                      'training': {'maxSteps': 1}}), 'demo', 0, 'demo-node-0.demo',
        'demo-1', '/etc/ftjob/spec.json'))"
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftjob.api.contract import COMPILE_CACHE, DOWNLOADS, SECRET_ENV
from ftjob.api.jobspec import FineTuneJobSpec
from ftjob.api.jobspec.fields import SecretKeyRef
from ftjob.api.schema import quantity

VOLUME_MOUNT = "/ftjob"  # where pods mount checkpoint.volume
# NCCL's bootstrap traffic: any interface but loopback and container bridges.
DEFAULT_SOCKET_IFNAME = "^lo,docker"
TRAINER = ["python", "-m", "ftjob.trainer.node", "-m", "ftjob.trainer", "--spec"]


@dataclass(frozen=True)
class NodeCommand:
    """What one node runs: argv, plain environment, and variables that come from Secrets."""

    argv: list[str]
    env: dict[str, str]
    # name -> Secret key; the operator renders these as secretKeyRefs, never as values.
    secret_env: dict[str, SecretKeyRef] = field(default_factory=dict)


def job_folder_name(spec: FineTuneJobSpec, name: str, uid: str = "") -> str:
    """The job's folder, relative to the volume: ``checkpoint.path`` when the user chose one,
    else ``<name>-<uid8>``. A name is not an identity: a job deleted and created again with the
    same name has a new UID, and so a new, empty folder (``checkpoint.resumeFrom`` seeds it
    from an older one on request)."""
    if spec.checkpoint.path:
        return spec.checkpoint.path
    return f"{name}-{uid[:8]}" if uid else name


def job_dir(spec: FineTuneJobSpec, name: str, mount: str = VOLUME_MOUNT, uid: str = "") -> str:
    """The job's folder on the shared volume: checkpoints, progress, caches, exported model."""
    return f"{mount.rstrip('/')}/{job_folder_name(spec, name, uid)}"


def node_command(
    spec: FineTuneJobSpec,
    name: str,
    node_rank: int,
    master_addr: str,
    rdzv_id: str,
    spec_path: str,
    *,
    node_addr: str | None = None,
    master_port: int | None = None,
    job_folder: str | None = None,
    source_root: str | None = None,
) -> NodeCommand:
    """The command and environment of node ``node_rank`` of job ``name``.

    ``master_addr`` is node 0's address (a pod's DNS name, or 127.0.0.1 locally);
    ``node_addr`` this node's own (the address the others reach it at; node 0's is
    ``master_addr``);
    ``rdzv_id`` must change with every gang attempt. ``master_port`` defaults to
    network.rendezvousPort; ``job_folder`` to :func:`job_dir`; ``source_root`` (where relative
    model and dataset sources are read) to the volume.
    """
    r, net = spec.resources, spec.network
    folder = job_folder or job_dir(spec, name)
    if not 0 <= node_rank < r.nodes:
        raise ValueError(f"node_rank {node_rank} is outside 0..{r.nodes - 1}")
    env = {
        "PET_NNODES": str(r.nodes),
        "PET_NPROC_PER_NODE": str(r.nproc_per_node),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": master_addr,
        "PET_MASTER_PORT": str(master_port or net.rendezvous_port),
        "PET_RDZV_ID": rdzv_id,
        # c10d rendezvous, hosted by node 0 at PET_MASTER_ADDR:PET_MASTER_PORT: a worker
        # failure restarts the workers of every node in place (the rendezvous re-forms, every
        # rank resumes from the newest checkpoint; all shards are needed to go on), up to
        # runPolicy.inPlaceRestarts times; then the node fails and the operator decides on a
        # new gang (backoffLimit).
        "PET_RDZV_BACKEND": "c10d",
        "PET_MAX_RESTARTS": str(spec.run_policy.in_place_restarts),
        "FTJOB_JOB_DIR": folder,
        # Model and dataset downloads land in the job's folder on the shared volume: fetched
        # once (by global rank 0), read from there by every restarted gang. A job's env may
        # point HF_HOME at a folder that several jobs on the volume share.
        "HF_HOME": f"{folder}/{DOWNLOADS}",  # the Hugging Face cache inside the job's folder
        # training.compile: inductor's and AOT autograd's caches (on by default in torch) and
        # the kernels they build go to the job's folder instead of the container's /tmp, so a
        # process restarted in place, a new gang or a resumed run loads the compiled layers
        # instead of compiling them again (on CPU, tiny model: 11 s to the first step instead of
        # 65 s; docs/operator.md). Writes are atomic renames: the ranks of every node may share
        # it. A job's env may point it elsewhere.
        "TORCHINDUCTOR_CACHE_DIR": f"{folder}/{COMPILE_CACHE}",
        "FTJOB_SOURCE_ROOT": source_root or VOLUME_MOUNT,
        "PYTHONUNBUFFERED": "1",  # log lines reach the pod log (and ftjob run) at once
    }
    node_addr = node_addr or (master_addr if node_rank == 0 else None)
    if node_addr:
        # Where the others reach this node's agent; node 0's hosts the store the workers of
        # every node join. Said, not left to socket.getfqdn(), which inside a pod or a
        # container need not give a name the other nodes can resolve.
        env["PET_LOCAL_ADDR"] = node_addr
    if r.on_gpu:
        env.update(fabric_env(spec))  # includes the user's ncclEnv
    else:
        # torchrun would pin every process to 1 thread; give each its share of the pod's CPUs.
        cpus = int(quantity(r.cpu)) if r.cpu is not None else 0
        if cpus:
            env["OMP_NUM_THREADS"] = str(max(1, cpus // r.nproc_per_node))
        env.update(net.nccl_env)  # said explicitly: passed on, though gloo ignores NCCL_*
    env.update({e.name: e.value for e in spec.env if e.value_from is None})
    secrets = {e.name: e.value_from.secret_key_ref for e in spec.env if e.value_from}
    if spec.secrets.hugging_face_token is not None:
        secrets["HF_TOKEN"] = spec.secrets.hugging_face_token
    secrets.update(tracking_secrets(spec))
    env.update(s3_env(spec))
    secrets.update(s3_secrets(spec))
    # Names only: the trainer masks these variables' values in all it prints and records.
    env[SECRET_ENV] = ",".join(sorted(secrets))
    return NodeCommand([*TRAINER, spec_path], env, secrets)


def s3_env(spec: FineTuneJobSpec) -> dict[str, str]:
    """Where s3:// sources are, under the names the AWS SDKs (and obstore) read."""
    s3 = spec.storage.s3
    named = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": s3.region}
    return {k: v.rstrip("/") for k, v in named.items() if v}


def s3_secrets(spec: FineTuneJobSpec) -> dict[str, SecretKeyRef]:
    """The key pair of s3:// sources, from the Secret the job names."""
    s3 = spec.storage.s3
    if s3.access_key_id is None or s3.secret_access_key is None:
        return {}
    return {"AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key}


def tracking_secrets(spec: FineTuneJobSpec) -> dict[str, SecretKeyRef]:
    """The experiment trackers' credentials, under the names their client libraries read."""
    mlflow, wandb = spec.tracking.mlflow, spec.tracking.wandb
    named = {}
    if mlflow is not None:
        named |= {
            "MLFLOW_TRACKING_USERNAME": mlflow.username,
            "MLFLOW_TRACKING_PASSWORD": mlflow.password,
            "MLFLOW_TRACKING_TOKEN": mlflow.token,
        }
    if wandb is not None:
        named["WANDB_API_KEY"] = wandb.api_key
    return {var: ref for var, ref in named.items() if ref is not None}


def fabric_env(spec: FineTuneJobSpec) -> dict[str, str]:
    """NCCL / libfabric settings for the job's fabric; the user's ncclEnv wins."""
    net = spec.network
    env = {
        # Fail a rank on a NCCL error or timeout instead of hanging the gang forever.
        # (The collective timeout itself is network.collectiveTimeoutSeconds, which the
        # trainer passes to init_process_group; the CRD keeps it below the stall timeout.)
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_DEBUG": "WARN",
    }
    ifname = net.socket_interface
    if net.fabric == "efa":
        env |= {
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            # NCCL and data loaders fork; without this libfabric's registered memory breaks.
            "FI_EFA_FORK_SAFE": "1",
            "NCCL_SOCKET_IFNAME": ifname or DEFAULT_SOCKET_IFNAME,
        }
    elif net.fabric == "infiniband":
        env |= {"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": ifname or DEFAULT_SOCKET_IFNAME}
    else:
        # Plain TCP: keep NCCL from probing RDMA devices that a shared node may expose.
        env |= {"NCCL_IB_DISABLE": "1"}
        if ifname:
            env["NCCL_SOCKET_IFNAME"] = ifname
    return env | dict(net.nccl_env)
