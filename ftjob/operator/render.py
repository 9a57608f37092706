"""PURE: a FineTuneJob and an attempt number -> the child objects the operator applies.

    ftjob render examples/llama3-8b-lora-efa.yaml     # prints what this module builds

Children, all owned by the job (garbage-collected with it) and named deterministically so
that re-running a reconcile never makes a second copy:

* ``<job>`` -- a headless Service; gives every pod the DNS name ``<job>-node-<i>.<job>``
  (publishNotReadyAddresses: rendezvous happens before any pod is ready).
* ``<job>-spec`` -- a ConfigMap with the job document the trainer reads.
* ``<job>-node-<i>`` -- one Pod per node; ``ftjob.dev/attempt`` says which gang it belongs to.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
from typing import Any

from ftjob.api import contract
from ftjob.api.jobspec import API_VERSION, DEFAULT_IMAGE, KIND, FineTuneJobSpec
from ftjob.api.jobspec.tracking import TrackingSpec
from ftjob.api.schema import camel, parse, to_dict
from ftjob.job import launch
from ftjob.plan import quota
from ftjob.plan.layout import estimate
from ftjob.plan.modelshape import shape_for
from ftjob.plan.saving import grace_period_seconds

MANAGER = "ftjob-operator"
GROUP_PREFIX = "ftjob.dev"
LABEL_JOB = f"{GROUP_PREFIX}/job-name"
LABEL_RANK = f"{GROUP_PREFIX}/node-rank"
LABEL_ATTEMPT = f"{GROUP_PREFIX}/attempt"
HOSTNAME_LABEL = "kubernetes.io/hostname"  # a node's own: one value per node
CONTAINER = "trainer"
# On every pod: what it was made of (:func:`template`), so that an edit of the job is seen to
# differ from the gang that runs, section by section.
TEMPLATE = f"{GROUP_PREFIX}/template"

SPEC_DIR = "/etc/ftjob"
SPEC_FILE = "spec.json"
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
POD_GROUP_API = "scheduling.k8s.io/v1beta1"  # Kubernetes 1.37's gang (KEP-4671), where served
SHARED_DIR = launch.VOLUME_MOUNT  # the checkpoint volume (CheckpointSpec documents it)
# Trainer processes run as this non-root user; fsGroup makes the shared volume writable.
RUN_AS = 1000

# Kueue "plain pod" groups: the pods of one attempt are admitted together or not at all.
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL = "kueue.x-k8s.io/pod-group-total-count"
# A group is never retried: a failed gang is replaced by a new group (attempt+1). Without this
# Kueue keeps its finalizer on a group's failed pods, waiting for replacements that never come,
# and the old gang's pods, Workload and quota stay (seen with Kueue 0.17).
KUEUE_RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
# spec.scheduling.topology: Kueue's Topology-Aware Scheduling keeps the whole group inside one
# domain of that node-label level.
KUEUE_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"

EFA_RESOURCE = quota.EFA_RESOURCE
# NCCL's bootstrap over every interface but loopback and container bridges, unless told.


# The operator's cluster-wide trainer image (ftjob operator --default-image, the chart's
# trainer.defaultImage); platform teams set it once instead of in every job.
DEFAULT_IMAGE_ENV = "FTJOB_DEFAULT_IMAGE"
# Whether gangs are PodGroups where the API is served (ftjob operator --pod-groups auto|off).
POD_GROUPS_ENV = "FTJOB_POD_GROUPS"


def trainer_image(spec: FineTuneJobSpec, default_image: str | None = None) -> str:
    """The image the pods run: spec.image, else the operator's default, else the release's
    placeholder name (which no registry serves: :func:`image_warning` says so). Only an
    absent spec.image is defaulted; an empty one stays, to be refused with its field."""
    if spec.image is not None:
        return spec.image
    return default_image or DEFAULT_IMAGE


# The operator's cluster-wide experiment trackers (the chart's trainer.tracking), as the JSON
# of a spec.tracking section: given to every job that declares none.
DEFAULT_TRACKING_ENV = "FTJOB_DEFAULT_TRACKING"


def default_tracking(text: str | None) -> TrackingSpec | None:
    """The operator's default spec.tracking from ``$FTJOB_DEFAULT_TRACKING`` (JSON); a wrong
    one is refused when the operator starts (SpecError naming trainer.tracking's field)."""
    if not text or not json.loads(text):
        return None
    return parse(TrackingSpec, json.loads(text), "trainer.tracking")


def with_tracking(spec: FineTuneJobSpec, default: TrackingSpec | None) -> FineTuneJobSpec:
    """The job as its pods run it: the operator's default trackers when the job names none
    (a job opts out with e.g. ``tracking: {tensorboard: {enabled: false}}``)."""
    t = spec.tracking
    if default is None or (t.mlflow or t.wandb or t.tensorboard):
        return spec
    return dataclasses.replace(spec, tracking=default)


# The sections of a spec that a user may edit (the others are immutable: the CRD) and that the
# pods are made of (the trainer's own settings stay those of the ConfigMap written with the
# first gang); runPolicy only through the in-place restarts torchrun is given.
EDITABLE = (
    "env",
    "secrets",
    "scheduling",
    "network",
    "tracking",
    "image_pull_secrets",
    "service_account_name",
)


def template(spec: FineTuneJobSpec, default_image: str | None = None) -> dict[str, str]:
    """What a gang's pods are made of, as far as an edit can change it: the image itself and
    a short digest of each other editable section. Two gangs of the same template differ in
    nothing an edit reaches; lifecycle compares it with the running gang's (its pods'
    :data:`TEMPLATE` annotation) to see what an edit changed."""
    sections = {camel(name): to_dict(getattr(spec, name)) for name in EDITABLE}
    sections["runPolicy.inPlaceRestarts"] = spec.run_policy.in_place_restarts
    out = {"image": trainer_image(spec, default_image)}
    for name, value in sections.items():
        text = json.dumps(value, sort_keys=True, default=str)
        out[name] = hashlib.sha256(text.encode()).hexdigest()[:12]
    return out


def image_warning(spec: FineTuneJobSpec) -> str | None:
    """What ``ftjob validate`` says about a job that names no image: which one it gets."""
    if spec.image is not None:
        return None
    return (
        "spec.image is unset: on a cluster the pods get the operator's default image "
        f"(ftjob operator --default-image, ${DEFAULT_IMAGE_ENV}, chart value "
        f"trainer.defaultImage), else the placeholder {DEFAULT_IMAGE}, which is not published. "
        "Fix: set spec.image, or the operator's default image (docs/install.md)"
    )


def labels(job: str, rank: int | None = None, attempt: int | None = None) -> dict[str, str]:
    """The children's labels (docs/operator.md); rank and attempt only where the child
    belongs to one."""
    out = {
        "app.kubernetes.io/name": "ftjob",
        "app.kubernetes.io/managed-by": MANAGER,
        LABEL_JOB: job,
    }
    if rank is not None:
        out[LABEL_RANK] = str(rank)
    if attempt is not None:
        out[LABEL_ATTEMPT] = str(attempt)
    return out


def owner_reference(job: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pod_name(job: str, rank: int) -> str:
    return f"{job}-node-{rank}"


def spec_config_map_name(job: str) -> str:
    return f"{job}-spec"


def node_address(job: str, namespace: str, rank: int) -> str:
    """DNS name of node ``rank`` through the headless Service (hostname.subdomain.namespace.svc)."""
    return f"{pod_name(job, rank)}.{job}.{namespace}.svc"


def master_address(job: str, namespace: str) -> str:
    return node_address(job, namespace, 0)


def rendezvous_id(job: str, uid: str, attempt: int) -> str:
    """Unique per attempt: a late pod of an old gang can never join the new one."""
    return f"{job}-{uid[:8]}-{attempt}" if uid else f"{job}-{attempt}"


def job_dir(job: str, spec: FineTuneJobSpec, uid: str = "") -> str:
    """The job's folder on the shared volume, as the pods see it (``<job>-<uid8>``)."""
    return launch.job_dir(spec, job, SHARED_DIR, uid)


def job_document(job: str, spec: FineTuneJobSpec) -> dict[str, Any]:
    """The FineTuneJob document the trainer reads (every default filled in)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": job},
        "spec": to_dict(spec),
    }


def _meta(name: str, namespace: str, lbls: dict, uid: str, **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "namespace": namespace, "labels": lbls, **extra}
    if uid:
        meta["ownerReferences"] = [owner_reference(lbls[LABEL_JOB], uid)]
    return meta


def service(job: str, namespace: str, spec: FineTuneJobSpec, uid: str = "") -> dict[str, Any]:
    net = spec.network
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, namespace, labels(job), uid),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job},
            "ports": [
                {"name": "rendezvous", "port": net.rendezvous_port, "protocol": "TCP"},
                {"name": "progress", "port": net.progress_port, "protocol": "TCP"},
            ],
        },
    }


def config_map(job: str, namespace: str, spec: FineTuneJobSpec, uid: str = "") -> dict[str, Any]:
    doc = json.dumps(job_document(job, spec), indent=1, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(spec_config_map_name(job), namespace, labels(job), uid),
        "data": {SPEC_FILE: doc + "\n"},
    }


def resources(spec: FineTuneJobSpec) -> dict[str, Any]:
    """Requests equal limits: Guaranteed QoS, the last pods a node evicts. The same requests
    are what ``ftjob plan`` counts as the gang's Kueue quota (plan/quota.py)."""
    amounts = quota.requests(spec)
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def container_security(spec: FineTuneJobSpec) -> dict[str, Any]:
    # Every fabric, RDMA included, drops every capability. RDMA registers (pins) memory, which
    # counts against RLIMIT_MEMLOCK, but an added IPC_LOCK would never reach the trainer: it
    # runs as a non-root uid, and Kubernetes puts added capabilities of a non-root container
    # only in the bounding set, not in the effective set. What EFA needs is the device
    # plugin's devices (resources(): vpc.amazonaws.com/efa) and an unlimited memlock limit,
    # which the node's container runtime sets (the EKS GPU AMIs' containerd: LimitMEMLOCK=
    # infinity); without it NCCL cannot register memory and preflight's fabric check fails
    # with that fix. So RDMA pods meet "restricted" like TCP ones.
    caps: dict[str, Any] = {"drop": ["ALL"]}
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
        "capabilities": caps,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def volumes(job: str, spec: FineTuneJobSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): the spec, the shared folder, /dev/shm and a writable /tmp."""
    vol = spec.checkpoint.volume
    shared = (
        {"persistentVolumeClaim": {"claimName": vol.claim_name}}
        if vol
        else {"emptyDir": {}}  # one node without a volume: checkpoints live as long as the pod
    )
    vols = [
        {"name": "spec", "configMap": {"name": spec_config_map_name(job)}},
        {"name": "shared", **shared},
        # NCCL and data loader workers pass tensors through shared memory; the runtime's
        # default 64 MiB /dev/shm crashes them.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
        {"name": "shared", "mountPath": SHARED_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    return vols, mounts


def container(
    job: str,
    namespace: str,
    spec: FineTuneJobSpec,
    rank: int,
    attempt: int,
    uid: str,
    default_image: str | None = None,
):
    """The trainer container of node ``rank``: torchrun as :mod:`ftjob.job.launch` builds it."""
    node = launch.node_command(
        spec,
        job,
        rank,
        master_address(job, namespace),
        rendezvous_id(job, uid, attempt),
        f"{SPEC_DIR}/{SPEC_FILE}",
        node_addr=node_address(job, namespace, rank),
        job_folder=job_dir(job, spec, uid),
        source_root=SHARED_DIR,
    )
    # HOME takes what other caches there are (the root filesystem is read-only; the Hugging
    # Face cache is on the volume, see launch); then the fabric defaults;
    # launch's environment (with the user's ncclEnv and env) wins over both.
    # The trainer's rank 0 writes the export path to the termination message on success.
    # The grace period, which the trainer's save on SIGTERM must fit (ftjob.trainer.gang.preempt).
    env = {"HOME": "/tmp", "FTJOB_TERMINATION_LOG": TERMINATION_LOG,
           contract.GRACE_ENV: str(grace_seconds(spec))} | node.env  # fmt: skip
    env_list = [{"name": k, "value": v} for k, v in env.items()]
    for var, ref in node.secret_env.items():
        secret = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
        env_list.append({"name": var, "valueFrom": secret})
    # The node the pod runs on: the trainer's failure records and preflight name it, and the
    # operator keeps a node blamed for a failure away from the next gang.
    node_ref = {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}
    env_list.append({"name": contract.NODE_NAME_ENV, "valueFrom": node_ref})
    net = spec.network
    out = {
        "name": CONTAINER,
        "image": trainer_image(spec, default_image),
        "imagePullPolicy": "IfNotPresent",
        "command": node.argv,
        "env": env_list,
        "ports": [
            {"name": "rendezvous", "containerPort": net.rendezvous_port, "protocol": "TCP"},
            {"name": "progress", "containerPort": net.progress_port, "protocol": "TCP"},
        ],
        "volumeMounts": volumes(job, spec)[1],
        "securityContext": container_security(spec),
        # The last lines of output become the termination message: the operator's diagnosis.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if res := resources(spec):
        out["resources"] = res
    return out


def grace_seconds(spec: FineTuneJobSpec) -> int:
    """terminationGracePeriodSeconds: checkpoint.gracePeriodSeconds, else from the planner's
    save time for this job (the minimum where the plan cannot shape the model offline)."""
    given = spec.checkpoint.grace_period_seconds
    saved = 0.0
    if given is None:
        with contextlib.suppress(ValueError):  # a model the plan knows only from its files
            saved = estimate(spec, shape_for(spec.model.source, None)).checkpoint_bytes
    return grace_period_seconds(saved, spec.resources.nodes, given)


def pod(
    job: str,
    namespace: str,
    spec: FineTuneJobSpec,
    rank: int,
    attempt: int,
    uid: str = "",
    default_image: str | None = None,
    avoid: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Node ``rank`` of gang ``attempt``, kept off the nodes in ``avoid`` (status.badNodes)."""
    return pods(job, namespace, spec, attempt, uid, default_image, [rank], avoid)[0]


def _pod(job, namespace, spec: FineTuneJobSpec, rank: int, attempt: int, uid: str,
         default_image: str | None, avoid, made_of: str) -> dict[str, Any]:  # fmt: skip
    """:func:`pod`, given what every pod of the gang shares (``made_of``: its template)."""
    lbls = labels(job, rank, attempt)
    annotations = {TEMPLATE: made_of}
    sched = spec.scheduling
    if sched.queue:
        lbls[KUEUE_QUEUE] = sched.queue
        lbls[KUEUE_GROUP] = gang_name(job, attempt)
        annotations[KUEUE_TOTAL] = str(spec.resources.nodes)
        annotations[KUEUE_RETRIABLE] = "false"
        if sched.topology:
            annotations[KUEUE_REQUIRED_TOPOLOGY] = sched.topology
    meta = _meta(pod_name(job, rank), namespace, lbls, uid)
    meta["annotations"] = annotations
    pod_spec: dict[str, Any] = {
        "hostname": pod_name(job, rank),
        "subdomain": job,
        # The gang is restarted as a whole by the operator; a pod never restarts alone.
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace_seconds(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container(job, namespace, spec, rank, attempt, uid, default_image)],
        "volumes": volumes(job, spec)[0],
    }
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = to_dict(sched.tolerations)
    # One pod per node (resources.nodes is nodes, each pod its node's GPUs, NICs and NVLink):
    # the gang's pods repel each other on a node's hostname. The attempt is in the selector so
    # that a new gang never waits for the old one's terminating pods to leave.
    gang = {LABEL_JOB: job, LABEL_ATTEMPT: str(attempt)} if spec.resources.nodes > 1 else None
    if sched.affinity or avoid or gang:
        pod_spec["affinity"] = affinity(sched.affinity, avoid, gang)
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    if sched.scheduler_name:
        pod_spec["schedulerName"] = sched.scheduler_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = to_dict(spec.image_pull_secrets)
    if spec.service_account_name:
        # Workload identity (IRSA, GKE's, Azure's) keys on the pod's ServiceAccount and brings
        # its own token; the Kubernetes API token stays unmounted (above).
        pod_spec["serviceAccountName"] = spec.service_account_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def affinity(
    given: dict | None, avoid: list[str] | tuple[str, ...] = (), gang: dict | None = None
) -> dict[str, Any]:
    """The pods' affinity: the spec's, with ``avoid``'s nodes excluded (required node
    anti-affinity) and, with ``gang`` (the labels of one attempt's pods), no two of them on one
    node (required pod anti-affinity on the hostname, added to the spec's own terms). The
    exclusion matches the node's name (matchFields on metadata.name, as
    the DaemonSet controller pins pods), which is what spec.nodeName and status.badNodes
    hold; the kubernetes.io/hostname label usually equals it but need not. The API server
    takes one value per field requirement, so each node is its own NotIn. nodeSelectorTerms
    are ORed: the exclusion goes into every term the spec has (or into a new, only term)."""
    out = copy.deepcopy(dict(given or {}))
    if gang:
        apart = out.setdefault("podAntiAffinity", {}).setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", []
        )
        apart.append({"labelSelector": {"matchLabels": dict(gang)}, "topologyKey": HOSTNAME_LABEL})
    if not avoid:
        return out
    away = [
        {"key": "metadata.name", "operator": "NotIn", "values": [node]}
        for node in sorted(set(avoid))
    ]
    required = out.setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {}
    )
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term["matchFields"] = [*term.get("matchFields", []), *away]
    return out


def pods(
    job: str,
    namespace: str,
    spec: FineTuneJobSpec,
    attempt: int,
    uid: str = "",
    default_image: str | None = None,
    ranks: list[int] | range | None = None,
    avoid: list[str] | tuple[str, ...] = (),
    grouped: bool = False,
) -> list[dict[str, Any]]:
    """The pods of ``ranks`` (default: every node) of gang ``attempt``; ``grouped``: each in
    the gang's :func:`pod_group`. What they share is made once: the template's digests were
    most of a pod's rendering, 16 times over for a 16-node gang that the operator renders to
    admit it and again to create it."""
    made_of = json.dumps(template(spec, default_image), sort_keys=True)
    ranks = range(spec.resources.nodes) if ranks is None else ranks
    out = [_pod(job, namespace, spec, r, attempt, uid, default_image, avoid, made_of)
           for r in ranks]  # fmt: skip
    for p in out if grouped else ():
        p["spec"]["schedulingGroup"] = {"podGroupName": gang_name(job, attempt)}
    return out


def gang_name(job: str, attempt: int) -> str:
    """The name of gang ``attempt`` as a group: its PodGroup's, and Kueue's pod group's."""
    return f"{job}-a{attempt}"


def pod_group(
    job: str, namespace: str, spec: FineTuneJobSpec, attempt: int, uid: str = ""
) -> dict[str, Any]:
    """Gang ``attempt`` as Kubernetes 1.37's PodGroup (scheduling.k8s.io/v1beta1): the
    scheduler binds its pods all together or none (minCount: every node's pod), so a gang
    never holds some nodes while it waits for the rest. Owned by the job, it goes with it."""
    meta = _meta(gang_name(job, attempt), namespace, labels(job, attempt=attempt), uid)
    group = {"schedulingPolicy": {"gang": {"minCount": spec.resources.nodes}}}
    # The scheduler places a group only when its priority is its pods' (without it a job
    # naming a class waited forever: "all pods in a single pod group should have the same
    # priority as the pod group's priority, got 100 and 0").
    if spec.scheduling.priority_class_name:
        group["priorityClassName"] = spec.scheduling.priority_class_name
    return {"apiVersion": POD_GROUP_API, "kind": "PodGroup", "metadata": meta, "spec": group}


def children(
    job: str,
    namespace: str,
    spec: FineTuneJobSpec,
    attempt: int = 0,
    uid: str = "",
) -> list[dict[str, Any]]:
    """Everything one attempt of the job needs, in the order to create it, as on a cluster
    that serves the PodGroup API."""
    return [
        config_map(job, namespace, spec, uid),
        service(job, namespace, spec, uid),
        pod_group(job, namespace, spec, attempt, uid),
        *pods(job, namespace, spec, attempt, uid, grouped=True),
    ]
