"""`placement.kuberay` and `checkpoints.shared.kuberay`, read with this provider's models: every
Kubernetes option a task can give the RayJob and its pods, validated as Kubernetes and KubeRay would
(names, label keys, securityContext fields, volumes), each refusal naming the field. spec.py keeps the
mapping; `check`, `render` and `launch` read it here. Also which claims every pod can share (SHARING).
"""

from __future__ import annotations

import copy
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from ...models import StrictModel, parse_duration
from ...spec import Placement, group_part, provider_part
from ..base import Sharing

#: The Ray rlhf-tasks pins (pyproject's `ray` extra): `rayproject/ray:<it>` is the default image.
DEFAULT_RAY_VERSION = "2.60.0"
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
#: KubeRay's ttlSecondsAfterFinished: a duration, or 0 (the cluster goes as soon as the job ends).
TTL = Annotated[float, BeforeValidator(lambda v: 0.0 if str(v).strip() in ("0", "0s", "0.0") else parse_duration(v))]


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


def group_placement(placement: Placement, group: Any, index: int) -> KubeRayPlacement:
    """A node group's options: its `placement.kuberay` keys over the task's (a GPU type's node selector, say),
    read with this provider's model (BadInput naming `groups[i].placement.kuberay`)."""
    return group_part(KubeRayPlacement, placement, group, index, "kuberay")
