"""KubeRay's pure half (the package's `__init__` adds `launch`, `status`, `down` through kubectl):
one file for `kubectl apply -f`: a ConfigMap with the plan (readable `data`) and the agent's package
as one xz-compressed tar (`binaryData`, so the object stays below the 256 KiB `kubectl apply -f` keeps
of it in its last-applied annotation; each pod unpacks it into an emptyDir at NODE_DIR), and a
RayJob (`ray.io/v1`) whose cluster has a head group and one worker group of nodes - 1.

KubeRay forms the cluster: its own `ray start` in every pod, its `wait-gcs-ready` init
container on the workers, its probes, the head service `<cluster>-head-svc`. rlhf-tasks keeps
its guarantees around that, with the agent in its attached roles (agent/attached.py):

- every Ray container runs, before KubeRay's `ray start` in the same shell (KubeRay appends its
  command to ours with `&&`), setup (once per pod), the head's `prepare`, a worker's every-node
  services (ready before the node joins) and the environment Ray starts with (network preset,
  the plan's env, the agent on PYTHONPATH);
  a startupProbe covers that time, so KubeRay's liveness probe cannot kill a long setup;
- the RayJob's entrypoint is the agent's job runner on the head: the head's services, every node
  and GPU in (a late worker pod within preRunningDeadlineSeconds), preflight, then the recipe's command with
  the restart policy (a lost worker pod is replaced by KubeRay; the runner waits for it and
  resumes from the checkpoint, where KubeRay's own `backoffLimit` would rebuild the cluster).

Submission is K8sJobMode with a submitter pod of our own in `rayproject/ray:<ray_version>`:
KubeRay's submitter runs `ray job submit`, and SidecarMode would run it in the head's image,
which may hold no Ray until setup installs it. KubeRay submits once every pod is Ready.

The rank is the group's (the head group's pods say 0, the workers' 1), the head the workers'
FQ_RAY_IP (KubeRay's head service), a node's own address its pod IP (downward API). Secrets
are `secretKeyRef`s into one Secret named by `placement.kuberay.secret` (default
`<name>-secrets`, key = variable name); the Ray token is KubeRay's own (`authOptions: {mode:
token}`: the operator makes the Secret and sets RAY_AUTH_TOKEN on every pod and the submitter).
No value of either is ever in the rendered file.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import lzma
import math
import re
import shlex
import tarfile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from ...errors import BadInput
from ...models import StrictModel, parse_duration, size_bytes
from ...plan import Contract, Plan, env, gpu_vendor
from ...recipes.base import Shape
from ...spec import Placement, Task, provider_part
from ..base import Provider, Sharing
from ..shipping import AGENT, LIB, NODE_DIR, NODE_ENTRY, dump_yaml, module_files, shared_entry

RANK_ENV, POD_IP_ENV, WORKERS_ENV = "RLHF_TASKS_RANK", "RLHF_TASKS_POD_IP", "RLHF_TASKS_WORKER_REPLICAS"
WORKER_GROUP = "workers"
#: Where the Ray container keeps the environment the agent wrote for KubeRay's `ray start`.
RAY_ENV_FILE = "/tmp/rlhf-tasks/ray.env"
#: KubeRay's dashboard agent port (it sets it when rayStartParams leave it out): a worker's startup is done once it answers.
AGENT_PORT = 52365
PROBE_PERIOD_S = 10
#: The head's dashboard port: KubeRay's submitter and the operator's job polling use the head
#: container's port named `dashboard` (common/job.go, utils/util.go FetchHeadServiceURL), which
#: the head declares; `forward` uses it too.
DASHBOARD_PORT = 8265
#: The Ray rlhf-tasks pins (pyproject's `ray` extra): `rayproject/ray:<it>` is the default image.
DEFAULT_RAY_VERSION = "2.60.0"
#: A RayJob's name: a DNS-1035 label of at most 47 characters (KubeRay's validation: its
#: RayCluster is `<name>-<5 random>`, and a Service name must start with a letter).
RAYJOB_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,45}[a-z0-9])?$")
#: The API server's cap on an object's annotations (keys and values), and the one where client-side
#: `kubectl apply -f` keeps the whole object.
ANNOTATIONS_LIMIT = 256 * 1024
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
#: Where the pods mount the ConfigMap (read-only): the plan, and lib/ as one archive that each pod
#: unpacks into NODE_DIR (an emptyDir: the agent runs from there as on every provider).
CONFIGMAP_DIR = "/opt/rlhf-tasks-configmap"
#: The ConfigMap's binaryData key of that archive.
LIB_ARCHIVE = "lib.tar.xz"
#: ConfigMap keys for an image without Ray: BASH_ENV appends the ConfigMap's directory to PATH in
#: KubeRay's `bash -c` lines, where `ray` (ray_standin.py) answers wait-gcs-ready's health check.
RAY_PATH_KEY, RAY_STANDIN_KEY = "ray-path.sh", "ray"
RAY_PATH_SH = (f'case ":$PATH:" in *":{CONFIGMAP_DIR}:"*) ;; *) PATH="$PATH:{CONFIGMAP_DIR}" ;; esac\n')
SUBMITTER_NAME = "ray-job-submitter"
#: What `check` and the rendered file's header say of job.working_dir with `submit: head`.
WORKING_DIR_WORDS = ("none: the job runs in the head container's working directory (the image's); nothing is "
                     "uploaded from this machine")
GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_QUEUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
#: An extended resource's name (a device plugin's, e.g. rdma/ib): a domain, then a name.
_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
#: Label and annotation keys that KubeRay, the gang schedulers or rlhf-tasks set or read on the pods:
#: a pod label of the user's there would be overwritten, or change what they decide.
RESERVED_KEY_PREFIXES = ("ray.io/", "rlhf-tasks/", "kueue.x-k8s.io/", "volcano.sh/", "scheduling.k8s.io/",
                         "yunikorn.apache.org/")
RESERVED_KEYS = ("app.kubernetes.io/name", "app.kubernetes.io/created-by", "app.kubernetes.io/managed-by")
#: Volume names in the pods that are ours (volumes()) or KubeRay's (/dev/shm, logs, its token).
RESERVED_VOLUMES = ("rlhf-tasks", "rlhf-tasks-node", "checkpoints", "shm", "infiniband", "shared-mem", "ray-logs",
                    "ray-token")
#: Where the InfiniBand devices are, on the node and in the Ray container (ib_host_device).
IB_DEVICES = "/dev/infiniband"
#: The Affinity object's fields (core/v1 Affinity).
AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")
#: The pod's and a container's securityContext fields (core/v1 PodSecurityContext, SecurityContext).
POD_SECURITY_FIELDS = ("appArmorProfile", "fsGroup", "fsGroupChangePolicy", "runAsGroup", "runAsNonRoot", "runAsUser",
                       "seLinuxChangePolicy", "seLinuxOptions", "seccompProfile", "supplementalGroups",
                       "supplementalGroupsPolicy", "sysctls", "windowsOptions")
CONTAINER_SECURITY_FIELDS = ("allowPrivilegeEscalation", "appArmorProfile", "capabilities", "privileged", "procMount",
                             "readOnlyRootFilesystem", "runAsGroup", "runAsNonRoot", "runAsUser", "seLinuxOptions",
                             "seccompProfile", "windowsOptions")
#: The user the `restricted` preset runs the pods as (rayproject/ray's own user `ray` is 1000).
DEFAULT_RUN_AS_USER = 1000


#: With a ttl_after_finished shorter than this, KubeRay would delete a failed job's cluster before `launch`
#: fetched the head's bundle: the head keeps it up to this long, until it was read (Plan.bundle_hold_s).
BUNDLE_HOLD_S = 60.0
#: KubeRay's ttlSecondsAfterFinished: a duration, or 0 (the cluster goes as soon as the job ends).
TTL = Annotated[float, BeforeValidator(lambda v: 0.0 if str(v).strip() in ("0", "0s", "0.0") else parse_duration(v))]


#: What KubeRay's submitter requests (common/job.go); the head's Ray container leaves room for it.
SUBMITTER_CPU, SUBMITTER_MEMORY = 0.5, 200 * 2**20
#: Kubernetes' quantity suffixes (apimachinery resource.Quantity): Ki..Ti powers of 2, k..T powers of 10.
K8S_UNITS = (("Ti", 2**40), ("T", 10**12), ("Gi", 2**30), ("G", 10**9), ("Mi", 2**20), ("M", 10**6), ("Ki", 2**10),
             ("k", 10**3))


def quantity(size: str, less: int = 0) -> str:
    """A task's size as a Kubernetes quantity of the same bytes ('128GB' -> '128G', '64GiB' -> '64Gi', '1.5TB' ->
    '1500G'; plain bytes where no suffix is exact), `less` bytes taken off (then in Mi, rounded down)."""
    if less:
        return f"{(size_bytes(size) - less) // 2**20}Mi"
    nbytes = size_bytes(size)
    return next((f"{nbytes // unit}{suffix}" for suffix, unit in K8S_UNITS if nbytes % unit == 0), str(nbytes))


def _dns(value, what: str = "a DNS label (lowercase letters, digits, dashes)", pattern=_DNS_LABEL):
    if value is not None and not pattern.match(value):
        raise ValueError(f"{value!r} is not {what}")
    return value


class Toleration(StrictModel):
    """A Kubernetes toleration (the pod spec's own field names)."""

    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = Field(None, ge=0)


class TopologySpread(StrictModel):
    """A pod topology spread constraint (the pod spec's own field names)."""

    maxSkew: int = Field(ge=1, description="how uneven the matching pods may be across the topology's domains")
    topologyKey: str = Field(description="the node label whose values are the domains "
                             "(e.g. topology.kubernetes.io/zone)")
    whenUnsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        description="DoNotSchedule holds a pod back; ScheduleAnyway only prefers")
    labelSelector: dict[str, Any] | None = Field(None, description="the pods counted (a LabelSelector; the Ray "
                                                 "pods alone: ray.io/is-ray-node: \"yes\")")
    matchLabelKeys: list[str] | None = Field(None, description="label keys whose values the counted pods share "
                                             "with the pod placed")
    minDomains: int | None = Field(None, ge=1, description="the fewest domains (DoNotSchedule only)")
    nodeAffinityPolicy: Literal["Honor", "Ignore"] | None = Field(None, description="whether the pod's node "
                                                                  "affinity limits the domains counted")
    nodeTaintsPolicy: Literal["Honor", "Ignore"] | None = Field(None, description="whether node taints limit "
                                                                "the domains counted")


class ExtraVolume(StrictModel):
    """A volume of the user's, mounted in every Ray container (head and workers)."""

    name: str = Field(description="the volume's name in the pod")
    claim: str | None = Field(None, description="a PersistentVolumeClaim (e.g. a model cache)")
    host_path: str | None = Field(None, description="a directory of the node (e.g. its NVMe)")
    path: str = Field(description="where the Ray container sees it")
    read_only: bool = Field(False, description="mounted read-only")

    _name = field_validator("name")(classmethod(lambda cls, v: _dns(v)))
    _claim = field_validator("claim")(classmethod(lambda cls, v: _dns(v, pattern=_DNS_NAME)))

    @field_validator("path", "host_path")
    @classmethod
    def _absolute(cls, value):
        if value is not None and (not value.startswith("/") or value.rstrip("/") == ""):
            raise ValueError(f"{value!r} is not an absolute path below /")
        return value if value is None else value.rstrip("/")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.claim is None) == (self.host_path is None):
            raise ValueError(f"volume {self.name}: name exactly one of claim and host_path")
        return self


class SecurityContexts(StrictModel):
    """Free-form securityContexts: the pods' own, and each container's (the Ray containers and the submitter)."""

    pod: dict[str, Any] = Field({}, description="the pods' securityContext (PodSecurityContext's field names)")
    container: dict[str, Any] = Field({}, description="each container's securityContext (SecurityContext's "
                                      "field names)")

    @field_validator("pod")
    @classmethod
    def _pod(cls, value):
        return _fields_of(value, POD_SECURITY_FIELDS, "a pod securityContext")

    @field_validator("container")
    @classmethod
    def _container(cls, value):
        return _fields_of(value, CONTAINER_SECURITY_FIELDS, "a container securityContext")


def _fields_of(value: dict, fields: tuple[str, ...], what: str) -> dict:
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a field of {what} ({', '.join(fields)})")
    return value


def _nested(path: str, other: str) -> str | None:
    """How two mount paths clash (the same, or one inside the other), else None."""
    if path == other:
        return "is"
    if path.startswith(other + "/"):
        return "is inside"
    if other.startswith(path + "/"):
        return "holds"
    return None


def _user_keys(value: dict, what: str) -> dict:
    """Label or annotation keys of the user's: Kubernetes' key syntax, none of the keys KubeRay, the
    schedulers or rlhf-tasks set or read."""
    for key in value:
        if not _LABEL_KEY.match(key):
            raise ValueError(f"{key!r} is not {what} key (an optional DNS prefix and '/', then at most 63 "
                             f"letters, digits, '-', '_', '.')")
        if key.startswith(RESERVED_KEY_PREFIXES) or key in RESERVED_KEYS:
            raise ValueError(f"{key!r}: KubeRay, a gang scheduler or rlhf-tasks sets or reads this key on the pods")
    return value


# The task's `placement.kuberay`: spec.py keeps it as a mapping, this provider reads it with this model.
class KubeRayPlacement(StrictModel):
    """Kubernetes' own options for the RayJob and its pods."""

    namespace: str | None = Field(None, description="the namespace (default: the kubeconfig context's)")
    service_account: str | None = Field(None, description="the pods' service account")
    node_selector: dict[str, str] = Field({}, description="node labels every pod needs (e.g. the GPU product)")
    tolerations: list[Toleration] = []
    priority_class: str | None = Field(None, description="the pods' PriorityClass")
    scheduler: Literal["kueue", "volcano", "yunikorn"] | None = Field(
        None, description="the gang scheduler that admits the RayJob (kueue when a queue is named alone)")
    queue: str | None = Field(None, description="its queue: a Kueue LocalQueue, a Volcano queue, a YuniKorn queue")
    secret: str | None = Field(None, description="the Secret the task's secrets are read from, one key per "
                               "variable name (default: <name>-secrets)")
    ray_version: str | None = Field(None, description="the Ray the image runs (KubeRay picks its probes by it, "
                                    "and its token auth needs >= 2.52.0); default " + DEFAULT_RAY_VERSION +
                                    ", the Ray of the default image rayproject/ray:" + DEFAULT_RAY_VERSION)
    network_policy: bool = Field(False, description="KubeRay's NetworkPolicies for the cluster (needs the operator's "
                                 "alpha feature gate RayClusterNetworkPolicy): only the cluster's pods and the "
                                 "operator's namespace reach the head")
    ephemeral_storage: bool = Field(False, description="request resources.disk as each pod's ephemeral-storage "
                                    "(off: many GPU node pools offer less than a task's disk; the pods then "
                                    "use what the node gives)")
    operator_namespace: str = Field("default", description="the namespace the KubeRay operator runs in (what "
                                    "network_policy admits to the head's dashboard)")
    ttl_after_finished: TTL = Field(600.0, description="how long KubeRay keeps the finished cluster "
                                         "(its logs) before deleting it")
    image_pull_secrets: list[str] = Field([], description="Secrets (names) to pull the images with: "
                                          "imagePullSecrets of every pod, the submitter's too")
    affinity: dict[str, Any] | None = Field(None, description="the Ray pods' affinity (the pod spec's Affinity: "
                                            "nodeAffinity, podAffinity, podAntiAffinity); the submitter pod gets "
                                            "its nodeAffinity")
    topology_spread: list[TopologySpread] = Field([], description="the Ray pods' topologySpreadConstraints "
                                                  "(the pod spec's field names; maxSkew, topologyKey and "
                                                  "whenUnsatisfiable required)")
    pod_labels: dict[str, str] = Field({}, description="labels on every pod (not ray.io/*, rlhf-tasks/*, the "
                                       "schedulers' keys)")
    pod_annotations: dict[str, str] = Field({}, description="annotations on every pod (not ray.io/*, "
                                            "rlhf-tasks/*, the schedulers' keys)")
    security_context: Literal["restricted"] | SecurityContexts | None = Field(
        None, description="`restricted`: every pod passes the restricted Pod Security Standard (non-root as "
        "run_as_user, RuntimeDefault seccomp, no privilege escalation, every capability dropped); or "
        "{pod: {...}, container: {...}}: the pods' and the containers' securityContext as given")
    run_as_user: int | None = Field(None, ge=1, description="the user (and group) `security_context: restricted` "
                                    f"runs the pods as (default {DEFAULT_RUN_AS_USER}, rayproject/ray's `ray`)")
    volumes: list[ExtraVolume] = Field([], description="volumes mounted in every Ray container: "
                                       "{name, claim: PVC | host_path: DIR, path, read_only}")
    kueue_priority_class: str | None = Field(None, description="Kueue's WorkloadPriorityClass for the RayJob "
                                             "(label kueue.x-k8s.io/priority-class; scheduler kueue only)")
    rdma_resource: dict[str, int] = Field({}, description="the RDMA device plugin's resource for each Ray "
                                          "container, name -> count (e.g. {rdma/ib: 1}; a bare name is 1), "
                                          "requests = limits")
    ipc_lock: bool = Field(False, description="the IPC_LOCK capability in the Ray containers (NCCL pins "
                           "memory for RDMA)")
    ib_host_device: bool = Field(False, description="mount the node's /dev/infiniband in the Ray containers "
                                 "(hostPath), with IPC_LOCK: InfiniBand without an RDMA device plugin")

    _names = field_validator("namespace", "service_account", "secret", "operator_namespace")(classmethod(lambda cls, v: _dns(v)))
    _priority = field_validator("priority_class")(classmethod(
        lambda cls, v: _dns(v, "a DNS name (lowercase letters, digits, dashes, dots)", _DNS_NAME)))
    _queue = field_validator("queue")(classmethod(
        lambda cls, v: _dns(v, "a queue name (letters, digits, dashes, underscores, dots)", _QUEUE)))

    _pull_secrets = field_validator("image_pull_secrets")(classmethod(
        lambda cls, v: [_dns(name, "a Secret's name (a DNS name)", _DNS_NAME) for name in v]))
    _kueue_priority = field_validator("kueue_priority_class")(classmethod(
        lambda cls, v: _dns(v, "a DNS name (lowercase letters, digits, dashes, dots)", _DNS_NAME)))
    _annotations = field_validator("pod_annotations")(classmethod(lambda cls, v: _user_keys(v, "an annotation")))

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value):
        for key in value:
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a label key")
        return value

    @field_validator("pod_labels")
    @classmethod
    def _pod_labels(cls, value):
        for key, label in _user_keys(value, "a label").items():
            if not _LABEL_VALUE.match(label):
                raise ValueError(f"{key}: {label!r} is not a label value (at most 63 letters, digits, '-', '_', "
                                 f"'.', starting and ending with a letter or digit)")
        return value

    @field_validator("affinity")
    @classmethod
    def _affinity(cls, value):
        if value is None:
            return value
        _fields_of(value, AFFINITY_KINDS, "the pod spec's Affinity")
        for kind, part in value.items():
            if not isinstance(part, dict):
                raise ValueError(f"{kind} is not a mapping")
        return value

    @field_validator("rdma_resource", mode="before")
    @classmethod
    def _rdma(cls, value):
        value = {value: 1} if isinstance(value, str) else value
        if isinstance(value, dict):
            for name, count in value.items():
                if not isinstance(name, str) or not _RESOURCE.match(name) or name.startswith("kubernetes.io/"):
                    raise ValueError(f"{name!r} is not an extended resource's name (DOMAIN/NAME, e.g. rdma/ib)")
                if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                    raise ValueError(f"{name}: {count!r} is not a count of at least 1")
        return value

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, value, info: ValidationInfo):
        host = [v.name for v in value if v.host_path]
        if host and info.data.get("security_context") == "restricted":
            raise ValueError(f"security_context restricted allows no hostPath volume ({', '.join(host)}): use a "
                             f"PersistentVolumeClaim (claim)")
        for i, volume in enumerate(value):
            if volume.name in RESERVED_VOLUMES:
                raise ValueError(f"volume name {volume.name!r} is one of the pods' own "
                                 f"({', '.join(RESERVED_VOLUMES)})")
            for other in value[:i]:
                if volume.name == other.name:
                    raise ValueError(f"volume name {volume.name!r} is given twice")
                clash = _nested(volume.path, other.path)
                if clash:
                    raise ValueError(f"volume {volume.name}: path {volume.path} {clash} {other.name}'s {other.path}")
        return value

    # The combinations: each checked on the later field (it sees the earlier ones in `info.data`), so
    # the error names the field to change.
    @field_validator("kueue_priority_class")
    @classmethod
    def _kueue_only(cls, value, info: ValidationInfo):
        scheduler, queue = info.data.get("scheduler") or "kueue", info.data.get("queue")
        if value is not None and (queue is None or scheduler != "kueue"):
            raise ValueError(f"Kueue's priority class needs a queue with scheduler kueue (scheduler is {scheduler}, "
                             f"queue {queue or 'not named'})")
        return value

    @field_validator("run_as_user")
    @classmethod
    def _restricted_user(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("security_context") != "restricted":
            raise ValueError("the user of security_context: restricted (set that, or runAsUser in "
                             "security_context.pod)")
        return value

    @field_validator("ipc_lock", "ib_host_device")
    @classmethod
    def _no_capability_when_restricted(cls, value, info: ValidationInfo):
        if value and info.data.get("security_context") == "restricted":
            raise ValueError("security_context restricted allows no added capability (IPC_LOCK) and no hostPath "
                             "(/dev/infiniband): with an RDMA device plugin (rdma_resource), IPC_LOCK needs a "
                             "namespace that allows it (baseline or privileged)")
        return value

    @field_validator("ray_version")
    @classmethod
    def _version(cls, value):
        if value is not None and not _VERSION.match(value):
            raise ValueError(f"{value!r} is not a Ray version (MAJOR.MINOR.PATCH, e.g. 2.52.0)")
        return value

    @model_validator(mode="after")
    def _queue_needs_scheduler(self):
        if self.scheduler is not None and self.queue is None:
            raise ValueError(f"scheduler {self.scheduler} needs a queue")
        return self

    def pod_security(self) -> dict:
        """The pods' securityContext (head, workers, submitter)."""
        if self.security_context == "restricted":
            user = self.run_as_user or DEFAULT_RUN_AS_USER
            return {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user, "fsGroup": user,
                    "seccompProfile": {"type": "RuntimeDefault"}}
        return dict(self.security_context.pod) if self.security_context else {}

    def container_security(self, ray: bool) -> dict:
        """A container's securityContext: the Ray containers' (which KubeRay copies into its
        wait-gcs-ready) add IPC_LOCK where asked; the submitter's never does."""
        if self.security_context == "restricted":
            out = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        else:
            out = copy.deepcopy(self.security_context.container) if self.security_context else {}
        if ray and (self.ipc_lock or self.ib_host_device):
            added = out.setdefault("capabilities", {}).setdefault("add", [])
            if "IPC_LOCK" not in added:
                added.append("IPC_LOCK")
        return out

    @property
    def ray(self) -> str:
        """The Ray that runs: as given, else the default image's."""
        return self.ray_version or DEFAULT_RAY_VERSION

    @property
    def version(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.ray.split("."))


#: Which claims every pod of a RayJob can mount read-write, by the claim's access mode (Kubernetes' persistent
#: volumes docs, concepts/storage/persistent-volumes, "Access Modes"). `check` cannot see the cluster; `launch`
#: reads the claim's modes (`kubectl get pvc`) and refuses one that is not ReadWriteMany for several pods.
SHARING = (
    Sharing("claim", "ReadWriteMany", "yes", "\"mounted as read-write by many nodes\" (Kubernetes' docs, persistent "
            "volumes, access modes; e.g. NFS, CephFS, EFS, Filestore); `check` cannot see the cluster: `launch` reads "
            "the claim's modes (kubectl get pvc) and refuses another for several pods"),
    Sharing("claim", "ReadWriteOnce", "no", "\"mounted as read-write by a single node\": a pod scheduled on "
            "another node stays ContainerCreating (Multi-Attach error)"),
    Sharing("claim", "ReadWriteOncePod", "no", "\"mounted as read-write by a single Pod\""),
    Sharing("claim", "ReadOnlyMany", "no", "\"mounted as read-only by many nodes\": no checkpoint can be written"),
)
SHARED_MODE = "ReadWriteMany"


class KubeRayShared(StrictModel):
    """`checkpoints.shared.kuberay`: storage every pod mounts at checkpoints.path."""

    claim: str = Field(description="a PersistentVolumeClaim every pod can mount at once (ReadWriteMany)")

    _name = field_validator("claim")(classmethod(lambda cls, v: _dns(v, pattern=_DNS_NAME)))


def kuberay_placement(placement: Placement) -> KubeRayPlacement:
    """A task's or plan's `placement.kuberay`, read with this provider's model (BadInput naming the field)."""
    return provider_part(KubeRayPlacement, placement.kuberay, "placement.kuberay")


def pack(files: dict[str, str]) -> bytes:
    """Path -> text as an xz-compressed tar that is the same bytes for the same files (sorted members,
    fixed times, owners and modes; xz keeps no time): render stays pure, a re-apply changes nothing.
    xz, not gzip: the agent gzipped came within 1 KiB of the annotations' cap, xz takes a fifth less,
    and the pods' python3 unpacks either (tarfile.open detects it)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files):
            data = files[path].encode()
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(raw.getvalue(), preset=9 | lzma.PRESET_EXTREME)


def last_applied_size(obj: dict) -> int:
    """The bytes of annotations `kubectl apply -f` gives an object: its key and the object as compact
    JSON, which Go writes with `<`, `>`, `&` as 6-byte escapes."""
    text = json.dumps(obj, separators=(",", ":"))
    return len(LAST_APPLIED) + len(text.encode()) + 5 * sum(text.count(c) for c in "<>&")


def unpack_shell() -> str:
    """A shell command that unpacks the ConfigMap's archive into NODE_DIR with the image's python3
    (tarfile, the data filter where the Python has it)."""
    program = ("import sys, tarfile; t = tarfile.open(sys.argv[1]); "
               "t.extraction_filter = getattr(tarfile, \"data_filter\", None); t.extractall(sys.argv[2])")
    return shlex.join(["python3", "-c", program, f"{CONFIGMAP_DIR}/{LIB_ARCHIVE}", NODE_DIR])


class KubeRayRender(Provider):
    """The provider's pure part: options, checks, plan, render."""

    name = "kuberay"
    shared_option = "checkpoints.shared.kuberay: {claim: PVC}"
    sharing = SHARING
    contract = Contract(
        rank=env(RANK_ENV),
        nodes=env(WORKERS_ENV, plus=1),
        head=env("FQ_RAY_IP"),           # workers: KubeRay's head service; the head uses its own address
        node_addr=env(POD_IP_ENV),
        cluster_id=env("RAY_CLUSTER_NAME"),
    )
    placement_options = KubeRayPlacement
    ignores = {"spot": "the pods go where Kubernetes schedules them (placement.kuberay.node_selector, tolerations)",
               "retry": "a failed RayJob is not rebuilt (backoffLimit 0); the head restarts the job (job.max_restarts)",
               "fleets": "the pods go where Kubernetes schedules them (placement.kuberay.node_selector)",
               "backends": "the cluster is the kubeconfig's",
               "regions": "the pods go where Kubernetes schedules them (placement.kuberay.node_selector)"}

    def check(self, task: Task) -> None:
        options = kuberay_placement(task.placement)
        if self.runs_without_ray(task):
            raise BadInput(f"job.recipe: the {task.job.recipe} recipe runs its command on every node without Ray, "
                           f"and KubeRay always starts Ray; use another provider")
        shared_entry(KubeRayShared, task.checkpoints.shared.get(self.name), self.name)
        if not RAYJOB_NAME.match(task.name):
            raise BadInput(f"name: {task.name!r} is not a name KubeRay accepts for a RayJob: at most 47 characters, "
                           f"starting with a letter (a DNS-1035 label), e.g. "
                           f"{('r-' + task.name if task.name[:1].isdigit() else task.name)[:47].rstrip('-')!r}")
        if task.ray.auth == "token" and options.version < (2, 52, 0):
            raise BadInput(f"placement.kuberay.ray_version: {options.ray} is below 2.52.0, which KubeRay's "
                           f"token auth needs (ray.auth: token); use an image with Ray >= 2.52.0")
        ours = {CONFIGMAP_DIR: "the ConfigMap's mount", NODE_DIR: "the agent's directory", "/dev/shm": "/dev/shm",
                IB_DEVICES: "ib_host_device's mount"}
        ckpt = task.checkpoints.path or self.default_checkpoint_dir(task)
        if ckpt:
            ours[ckpt.rstrip("/") or "/"] = "checkpoints.path"
        for i, volume in enumerate(options.volumes):
            for path, what in ours.items():
                clash = _nested(volume.path, path)
                if clash:
                    raise BadInput(f"placement.kuberay.volumes[{i}].path: {volume.path} {clash} {path}, "
                                   f"{what}, which the pods mount themselves")
        labels = ("/gpu.product", "/gpu.memory", "/gpu.vram")
        if task.resources.gpu_memory and not any(key.endswith(labels) for key in options.node_selector):
            raise BadInput(f"resources.gpus: {task.resources.gpus}: a pod requests GPUs by count only "
                           f"(nvidia.com/gpu), and Kubernetes selects their nodes by the labels the cluster gives "
                           f"them; give placement.kuberay.node_selector with your nodes' GPU label: GPU feature "
                           f"discovery's nvidia.com/gpu.product (e.g. NVIDIA-A100-SXM4-80GB) or nvidia.com/gpu.memory "
                           f"(MiB, e.g. \"81920\"), AMD's labeller's amd.com/gpu.vram")
        if task.resources.memory and size_bytes(task.resources.memory) <= SUBMITTER_MEMORY:
            raise BadInput(f"resources.memory: {task.resources.memory} is not more than the "
                           f"{SUBMITTER_MEMORY // 2**20}MiB KubeRay's submitter requests in the head's pod, which the "
                           f"head's Ray container leaves it: give more")
        if task.ray.dashboard_public:
            raise BadInput("ray.dashboard_public: KubeRay binds the dashboard to the pod network itself; reach it "
                           "with kubectl port-forward (leave dashboard_public off)")
        if task.job.submit == "head" and "working_dir" in task.job.model_fields_set and task.job.working_dir:
            raise BadInput(f"job.working_dir: {task.job.working_dir} would not reach the job: with job.submit: head, "
                           f"KubeRay's submitter runs on the cluster and nothing is uploaded from this machine; put "
                           f"the code in the image (or on a volume, e.g. checkpoints.shared.kuberay) and leave "
                           f"job.working_dir out, or set job.submit: client (launch then submits the job from this "
                           f"machine through kubectl port-forward, uploading job.working_dir; or `rlhf-tasks forward` "
                           f"and `rlhf-tasks submit`)")

    def runs_without_ray(self, task: Task) -> bool:
        """Whether the recipe runs its command on every node itself (torchrun): asked of the recipe."""
        shape = Shape(nodes=task.nodes, gpus_per_node=task.resources.gpus_per_node, gpu_name=task.resources.gpu_name,
                      checkpoint_dir=task.checkpoints.path or self.default_checkpoint_dir(task), resume=False)
        try:
            return task.job.build(shape).mode == "every_node"
        except BadInput:
            return False  # an infeasible job is the plan's to report, with its fields

    def build(self, task: Task) -> Plan:
        """With `submit: head` the job runner submits from the head pod, where nothing of this machine
        is: no working_dir (check refuses one the task names), the job runs in the head container's."""
        plan = super().build(task)
        if plan.job.submit == "head" and plan.job.working_dir:
            plan = plan.replace(job=plan.job.model_copy(update={"working_dir": None}))
        return plan

    def working_dir_words(self, plan: Plan) -> str | None:
        if plan.job.submit == "head" and plan.job.mode == "ray":
            return WORKING_DIR_WORDS
        return None

    def plan(self, task: Task) -> Plan:
        plan = super().plan(task)
        options = kuberay_placement(plan.placement)
        hold = BUNDLE_HOLD_S if options.ttl_after_finished < BUNDLE_HOLD_S else 0.0
        return plan.replace(placement=plan.placement.model_copy(update={"kuberay": options.model_dump()}),
                            bundle_hold_s=hold)  # every option in the plan, defaults too: the plan says them

    def notes(self, plan: Plan) -> list[str]:
        options, res = kuberay_placement(plan.placement), plan.resources
        out = super().notes(plan)
        claim = self.shared_claim_note(plan)
        if claim:
            out.append(claim)
        if plan.image:
            out.append(f"image {plan.image}: it must hold bash and python3 (the agent), and Ray {options.ray} "
                       f"(`ray` on PATH) by the time KubeRay's `ray start` runs: in the image, or installed by setup "
                       f"(before setup, KubeRay's `ray health-check` in every worker's init container is answered by "
                       f"a stand-in in the ConfigMap; the submitter runs in rayproject/ray:{options.ray})"
                       + ("" if options.ray_version else "; say which Ray it holds in placement.kuberay.ray_version "
                          f"(KubeRay picks its probes by it; {options.ray} assumed)"))
        if res.gpu_name and not any(k.endswith("/gpu.product") for k in options.node_selector):
            out.append(f"resources.gpus: the pods request {plan.gpus_per_node} GPUs of any type; KubeRay cannot "
                       f"select {res.gpu_name}: add placement.kuberay.node_selector with your nodes' product label "
                       f"(GPU feature discovery's nvidia.com/gpu.product, e.g. NVIDIA-H100-80GB-HBM3)")
        if plan.network == "infiniband":
            missing = []
            if not options.rdma_resource and not options.ib_host_device:
                missing.append("no RDMA device: name your device plugin's resource in placement.kuberay.rdma_resource "
                               "(e.g. {rdma/ib: 1}), or mount the node's /dev/infiniband with ib_host_device: true")
            if not (options.ipc_lock or options.ib_host_device):
                missing.append("no IPC_LOCK capability (NCCL pins memory for RDMA): placement.kuberay.ipc_lock: true")
            if missing:
                out.append("network: infiniband sets NCCL's InfiniBand variables, but the pods get "
                           + "; and ".join(missing))
        return out

    def shared_claim_note(self, plan: Plan) -> str | None:
        """What `check` cannot see of a claim several pods mount: its access mode (`launch` reads it)."""
        shared = shared_entry(KubeRayShared, plan.checkpoint_shared, self.name)
        if not shared or plan.nodes < 2:
            return None
        return (f"checkpoints.shared.kuberay.claim {shared.claim}: the {plan.nodes} pods share it only if it is "
                f"{SHARED_MODE} (a ReadWriteOnce claim mounts on one Kubernetes node); `check` cannot see the "
                f"cluster, `launch` reads the claim's access modes there and refuses another")

    def shared_storage_warning(self, plan: Plan) -> str | None:
        if plan.nodes < 2 or not plan.unshared_checkpoints:
            return None
        return (f"checkpoints {plan.checkpoint_dir} is an emptyDir in each pod: the {plan.nodes} pods do not share "
                f"it, and a replaced pod starts without it; add checkpoints.shared.kuberay: {{claim: PVC}} "
                f"(a ReadWriteMany PersistentVolumeClaim)")

    # ------------------------------------------------------------------ render

    def shipped(self, plan: Plan) -> dict[str, str]:
        """Path below NODE_DIR -> content: the agent's package (with what the recipe imports) under lib/."""
        return {f"{LIB}/{path}": text for path, text in module_files([AGENT, *plan.modules]).items()}

    @staticmethod
    def plan_path(plan: Plan) -> str:
        return f"{CONFIGMAP_DIR}/{plan.name}.plan.json"

    def configmap(self, plan: Plan, options: KubeRayPlacement) -> dict:
        configmap = {"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": self.metadata(plan, options, self.configmap_name(plan)),
                     "data": {f"{plan.name}.plan.json": plan.to_json(), RAY_PATH_KEY: RAY_PATH_SH,
                              RAY_STANDIN_KEY: (Path(__file__).parent / "ray_standin.py").read_text()},
                     "binaryData": {LIB_ARCHIVE: base64.b64encode(pack(self.shipped(plan))).decode()}}
        size = last_applied_size(configmap)
        if size > ANNOTATIONS_LIMIT:
            raise BadInput(f"--provider kuberay: the ConfigMap (plan and packed agent) would take {size} bytes of "
                           f"annotations once `kubectl apply -f` keeps it in {LAST_APPLIED}; the API server "
                           f"caps them at {ANNOTATIONS_LIMIT}")
        return configmap

    @staticmethod
    def configmap_name(plan: Plan) -> str:
        return f"{plan.name}-rlhf-tasks"

    @staticmethod
    def metadata(plan: Plan, options: KubeRayPlacement, name: str, labels: dict | None = None) -> dict:
        meta: dict = {"name": name}
        if options.namespace:
            meta["namespace"] = options.namespace
        meta["labels"] = {"app.kubernetes.io/managed-by": "rlhf-tasks", "rlhf-tasks/task": plan.name, **(labels or {})}
        return meta

    def queue_labels(self, plan: Plan, options: KubeRayPlacement) -> dict[str, str]:
        """What the cluster's gang scheduler reads on the RayJob (KubeRay's integrations)."""
        if options.queue is None:
            return {}
        scheduler = options.scheduler or "kueue"
        if scheduler == "kueue":
            return {"kueue.x-k8s.io/queue-name": options.queue}
        if scheduler == "volcano":  # the operator must run with --batch-scheduler=volcano
            return {"volcano.sh/queue-name": options.queue}
        return {"ray.io/gang-scheduling-enabled": "true", "yunikorn.apache.org/app-id": plan.name,
                "yunikorn.apache.org/queue": options.queue}

    def resources(self, plan: Plan, options: KubeRayPlacement, head: bool) -> dict:
        """Requests = limits (a GPU pod with CPU and memory is Guaranteed QoS), in Kubernetes'
        units. The task's sizes are a node's: the head's Ray container leaves room for the
        submitter KubeRay adds to its pod (500m CPU, 200Mi), so the head pod fits the same node.
        `resources.disk` becomes ephemeral-storage only with placement.kuberay.ephemeral_storage."""
        res, amounts = plan.resources, {}
        if res.cpus:
            cpus = res.cpus - (SUBMITTER_CPU if head else 0)
            amounts["cpu"] = f"{round(cpus * 1000)}m" if cpus != int(cpus) else str(int(cpus))
        if res.memory:
            amounts["memory"] = quantity(res.memory, less=SUBMITTER_MEMORY if head else 0)
        if res.disk and options.ephemeral_storage:
            amounts["ephemeral-storage"] = quantity(res.disk)
        if plan.gpus_per_node:
            amounts[GPU_RESOURCE[gpu_vendor(res.gpu_name) or "nvidia"]] = str(plan.gpus_per_node)
        amounts.update({name: str(count) for name, count in options.rdma_resource.items()})
        return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}

    def env(self, plan: Plan, options: KubeRayPlacement, rank: int) -> list[dict]:
        """The container's environment: the contract's variables, the plan's env, the secrets by reference."""
        out = [{"name": RANK_ENV, "value": str(rank)},
               {"name": WORKERS_ENV, "value": str(plan.nodes - 1)},
               {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        out += [{"name": key, "value": value} for key, value in plan.env.items()]
        secret = options.secret or f"{plan.name}-secrets"
        out += [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name}}} for name in plan.secrets]
        out.append({"name": "BASH_ENV", "value": f"{CONFIGMAP_DIR}/{RAY_PATH_KEY}"})  # `ray` last on PATH
        return out

    def volumes(self, plan: Plan, options: KubeRayPlacement) -> tuple[list[dict], list[dict]]:
        """(the pod's volumes, the Ray container's mounts): the ConfigMap (plan, packed agent) and the
        emptyDir the agent is unpacked into, the checkpoints, /dev/shm, then the user's: the node's
        /dev/infiniband (ib_host_device) and placement.kuberay.volumes."""
        volumes = [{"name": "rlhf-tasks", "configMap": {"name": self.configmap_name(plan), "defaultMode": 0o555}},
                   {"name": "rlhf-tasks-node", "emptyDir": {}}]
        mounts = [{"name": "rlhf-tasks", "mountPath": CONFIGMAP_DIR, "readOnly": True},
                  {"name": "rlhf-tasks-node", "mountPath": NODE_DIR}]
        if plan.checkpoint_dir:
            shared = shared_entry(KubeRayShared, plan.checkpoint_shared, self.name)
            volumes.append({"name": "checkpoints", **({"persistentVolumeClaim": {"claimName": shared.claim}}
                                                      if shared else {"emptyDir": {}})})
            mounts.append({"name": "checkpoints", "mountPath": plan.checkpoint_dir})
        if plan.resources.shm_size:
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory",
                                                        "sizeLimit": quantity(plan.resources.shm_size)}})
            mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        if options.ib_host_device:
            volumes.append({"name": "infiniband", "hostPath": {"path": IB_DEVICES, "type": "Directory"}})
            mounts.append({"name": "infiniband", "mountPath": IB_DEVICES})
        for extra in options.volumes:
            volumes.append({"name": extra.name, **({"persistentVolumeClaim": {"claimName": extra.claim}}
                                                   if extra.claim else {"hostPath": {"path": extra.host_path}})})
            mounts.append({"name": extra.name, "mountPath": extra.path, **({"readOnly": True} if extra.read_only
                                                                          else {})})
        return volumes, mounts

    def agent_shell(self, plan: Plan, *flags: str, unpack: bool = False) -> str:
        """A shell line that runs the agent (unpacked from the ConfigMap first, with `unpack`) with one
        of its attached roles."""
        agent = shlex.join(["python3", NODE_ENTRY, "--plan", self.plan_path(plan), *flags])
        line = f"export PYTHONPATH={NODE_DIR}/{LIB}${{PYTHONPATH:+:$PYTHONPATH}} && {agent}"
        return f"{unpack_shell()} && {line}" if unpack else line

    def startup_probe(self, plan: Plan, head: bool) -> dict:
        """How long the container may take before its Ray answers (setup, a worker's services):
        until then KubeRay's liveness probe is off. The head's GCS, a worker's dashboard agent."""
        budget = plan.wait.head_s
        if not head:
            budget += sum(s.timeout for s in plan.services if s.where == "every_node")
        return {"tcpSocket": {"port": plan.ray.port if head else AGENT_PORT}, "periodSeconds": PROBE_PERIOD_S,
                "failureThreshold": max(1, math.ceil(budget / PROBE_PERIOD_S))}

    def pod_template(self, plan: Plan, options: KubeRayPlacement, head: bool) -> dict:
        image = plan.image or f"rayproject/ray:{options.ray}"
        volumes, mounts = self.volumes(plan, options)
        env = self.env(plan, options, 0 if head else 1)
        container: dict = {
            "name": "ray-head" if head else "ray-worker",
            "image": image,
            # KubeRay runs this, then its own `ray start`, in one shell: `OURS && ulimit ...; ray start ...`.
            # `;` binds looser than `&&`, so a failure here must end the shell itself (`|| exit`), or Ray
            # would start (and the node join) without its setup and environment.
            # It unpacks the agent into the pod's emptyDir, runs setup (once per pod, here where Ray runs:
            # an init container's installs would not reach this container) and, on the head, prepare.
            "args": [self.agent_shell(plan, "--before-ray", RAY_ENV_FILE, unpack=True)
                     + f" && . {RAY_ENV_FILE} || exit"],
            "env": env,
            "volumeMounts": mounts,
            "startupProbe": self.startup_probe(plan, head),
        }
        if head:
            container["ports"] = [{"name": "gcs-server", "containerPort": plan.ray.port},
                                  {"name": "dashboard", "containerPort": plan.ray.dashboard_port},
                                  {"name": "client", "containerPort": plan.ray.client_server_port}]
        resources = self.resources(plan, options, head)
        if resources:
            container["resources"] = resources
        security = options.container_security(ray=True)
        if security:  # KubeRay copies it into the workers' wait-gcs-ready (common/pod.go)
            container["securityContext"] = security
        spec: dict = {"containers": [container], "volumes": volumes}
        if options.service_account:
            spec["serviceAccountName"] = options.service_account
        spec.update(self.placed(options, ray=True))
        return {"metadata": self.pod_metadata(plan, options), "spec": spec}

    @staticmethod
    def pod_metadata(plan: Plan, options: KubeRayPlacement) -> dict:
        """A pod template's labels (the task's, then the user's) and the user's annotations."""
        meta: dict = {"labels": {"rlhf-tasks/task": plan.name, **options.pod_labels}}
        if options.pod_annotations:
            meta["annotations"] = dict(options.pod_annotations)
        return meta

    @staticmethod
    def placed(options: KubeRayPlacement, ray: bool) -> dict:
        """Where a pod may go and how it runs: the task's node selector, tolerations, priority class,
        affinity, pull secrets and securityContext. The submitter pod (`ray` False) gets the
        affinity's nodeAffinity only: the pod (anti-)affinity and the topology spread are the Ray pods'."""
        out: dict = {}
        if options.node_selector:
            out["nodeSelector"] = dict(options.node_selector)
        if options.tolerations:
            out["tolerations"] = [t.model_dump(exclude_none=True) for t in options.tolerations]
        if options.priority_class:
            out["priorityClassName"] = options.priority_class
        affinity = {k: v for k, v in (options.affinity or {}).items() if ray or k == "nodeAffinity"}
        if affinity:
            out["affinity"] = copy.deepcopy(affinity)
        if ray and options.topology_spread:
            out["topologySpreadConstraints"] = [t.model_dump(exclude_none=True) for t in options.topology_spread]
        if options.image_pull_secrets:
            out["imagePullSecrets"] = [{"name": name} for name in options.image_pull_secrets]
        security = options.pod_security()
        if security:
            out["securityContext"] = security
        return out

    def ray_start_params(self, plan: Plan, head: bool) -> dict[str, str]:
        ray, params = plan.ray, {}
        if head:
            params.update({"port": str(ray.port), "dashboard-port": str(ray.dashboard_port),
                           "ray-client-server-port": str(ray.client_server_port)})
        if ray.object_store_memory:
            params["object-store-memory"] = str(ray.object_store_memory)
        if ray.num_cpus:
            params["num-cpus"] = str(ray.num_cpus)
        if ray.debug == "legacy":
            params["ray-debugger-external"] = "true"
        return params

    def deadlines(self, plan: Plan) -> dict[str, int]:
        """preRunningDeadlineSeconds: every pod up (the head's setup and prepare, every node joining);
        activeDeadlineSeconds, from the RayJob's start, KubeRay's backstop: the shorter of that, the
        runner's bring-up and every attempt the restart policy allows; and the budget's cap (what the
        head agent enforces, agent/budget.py cap_seconds, counted from its start, which is within
        preRunningDeadlineSeconds of the RayJob's) plus the stop_grace its job's driver gets there:
        never longer than the bill the task allows, never cutting that grace short."""
        pre = plan.wait.head_s + plan.wait.nodes_s
        out = {"preRunningDeadlineSeconds": math.ceil(pre)}
        ends = []
        if plan.job.timeout_s:
            services = sum(s.timeout for s in plan.services)
            preflight = plan.preflight.timeout_s if plan.preflight.enabled else 0
            attempts = (plan.job.max_restarts + 1) * plan.job.timeout_s
            ends.append(pre + services + preflight + attempts)
        budget = plan.budget
        caps = ([budget.max_duration_s] if budget.max_duration_s else []) + (  # as agent/budget.py's cap_seconds
            [budget.max_cost / budget.price_per_hour * 3600.0] if budget.max_cost is not None and budget.price_per_hour
            else [])
        if caps:
            ends.append(pre + min(caps) + budget.stop_grace_s)
        if ends:
            out["activeDeadlineSeconds"] = math.ceil(min(ends))
        return out

    def submitter(self, plan: Plan, options: KubeRayPlacement) -> dict:
        """KubeRay's submitter pod in Ray's own image (KubeRay fills in its `ray job submit` command,
        the dashboard's address and the token), placed where the task's pods may go."""
        container: dict = {
            "name": SUBMITTER_NAME, "image": f"rayproject/ray:{options.ray}",
            "resources": {"requests": {"cpu": f"{round(SUBMITTER_CPU * 1000)}m",
                                       "memory": f"{SUBMITTER_MEMORY // 2**20}Mi"},
                          "limits": {"cpu": "1", "memory": "1Gi"}}}
        security = options.container_security(ray=False)
        if security:
            container["securityContext"] = security
        spec: dict = {"restartPolicy": "Never", "containers": [container], **self.placed(options, ray=False)}
        return {"metadata": self.pod_metadata(plan, options), "spec": spec}

    def rayjob(self, plan: Plan, options: KubeRayPlacement) -> dict:
        cluster: dict = {"rayVersion": options.ray}
        if plan.token_env:
            cluster["authOptions"] = {"mode": "token"}
        if options.network_policy:
            # KubeRay's DenyAllIngress admits the cluster's own pods only; the operator polls the head's
            # dashboard from its namespace, so that namespace is let in (networkpolicy_controller.go).
            cluster["networkPolicy"] = {"mode": "DenyAllIngress", "head": {"ingressRules": [{
                "from": [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": options.operator_namespace}}}],
                "ports": [{"port": plan.ray.dashboard_port}]}]}}
        cluster["headGroupSpec"] = {"rayStartParams": self.ray_start_params(plan, True),
                                    "template": self.pod_template(plan, options, True)}
        workers = plan.nodes - 1
        if workers:
            cluster["workerGroupSpecs"] = [{
                "groupName": WORKER_GROUP, "replicas": workers, "minReplicas": workers, "maxReplicas": workers,
                "rayStartParams": self.ray_start_params(plan, False),
                "template": self.pod_template(plan, options, False)}]
        # KubeRay pastes the entrypoint unquoted into the submitter's `bash -c` line: one quoted `bash -c`
        # word keeps our `&&` and `${PYTHONPATH...}` for the job's shell (Ray's CLI joins the words back).
        entrypoint = shlex.join(["bash", "-c", self.agent_shell(plan, "--ray-started", "--skip-setup")])
        spec: dict = {
            "entrypoint": entrypoint,
            # K8sJobMode with a submitter of our own: KubeRay's submitter runs `ray job submit`, and in
            # SidecarMode it runs in the head's image, which may hold no Ray before setup installs it.
            "submissionMode": "K8sJobMode",
            "submitterConfig": {"backoffLimit": 0},  # one submission: the runner restarts the job itself
            "submitterPodTemplate": self.submitter(plan, options),
            "backoffLimit": 0,  # a retry rebuilds the whole cluster: the runner restarts the job instead
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": math.ceil(options.ttl_after_finished),
            **self.deadlines(plan),
            "rayClusterSpec": cluster,
        }
        if options.queue and (options.scheduler or "kueue") == "kueue":
            spec["suspend"] = True  # created held, as Kueue's webhook would make it: Kueue admits it (suspend: false)
        labels = self.queue_labels(plan, options)
        if options.kueue_priority_class:
            labels["kueue.x-k8s.io/priority-class"] = options.kueue_priority_class
        return {"apiVersion": "ray.io/v1", "kind": "RayJob",
                "metadata": self.metadata(plan, options, plan.name, labels),
                "spec": spec}

    def render(self, plan: Plan) -> dict[str, str]:
        options = kuberay_placement(plan.placement)
        configmap = self.configmap(plan, options)
        rayjob = self.rayjob(plan, options)
        ns = f" -n {options.namespace}" if options.namespace else ""
        header = f"# Rendered by rlhf-tasks for KubeRay (v1.7): kubectl apply{ns} -f <this file>\n"
        if plan.secrets and options.secret:
            header += (f"# The task's secrets come from your Secret {options.secret}, one key per name "
                       f"({', '.join(plan.secrets)}).\n")
        elif plan.secrets:
            secret = f"{plan.name}-secrets"
            header += (f"# The task's secrets come from Secret {secret}, one key per name; `rlhf-tasks launch` makes "
                       f"it from your environment. Applying by hand, create it first from a file of NAME=value lines "
                       f"(not on the command line, where ps shows the values):\n"
                       f"#   kubectl create secret generic{ns} {secret} --from-env-file=FILE   "
                       f"# {', '.join(plan.secrets)}\n")
        words = self.working_dir_words(plan)
        if words:
            header += f"# job.working_dir: {words}.\n"
        header += f"# Follow: kubectl get rayjob{ns} {plan.name} -w; kubectl logs{ns} -f job/{plan.name}\n"
        text = dump_yaml(configmap, header) + "---\n" + dump_yaml(rayjob)
        return {f"{plan.name}.rayjob.yaml": text}
