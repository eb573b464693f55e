"""KubeRay's pure half (the package's `__init__` adds `launch`, `status`, `down` through kubectl):
one file for `kubectl apply -f`: a ConfigMap with the plan (readable `data`) and the agent's package
as one gzipped tar (`binaryData`, so the object stays far below the 256 KiB `kubectl apply -f` keeps
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
  and GPU in (however late a worker pod is scheduled), preflight, then the recipe's command with
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
import gzip
import io
import json
import math
import re
import shlex
import tarfile
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from ...errors import BadInput
from ...models import StrictModel, parse_duration, size_bytes
from ...plan import Contract, Plan, env, gpu_vendor
from ...recipes.base import Shape
from ...spec import Placement, Task, provider_part
from ..base import Provider
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
LIB_ARCHIVE = "lib.tar.gz"
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


#: With a ttl_after_finished shorter than this, KubeRay would delete a failed job's cluster before `launch`
#: fetched the head's bundle: the head keeps it up to this long, until it was read (Plan.bundle_hold_s).
BUNDLE_HOLD_S = 60.0
#: KubeRay's ttlSecondsAfterFinished: a duration, or 0 (the cluster goes as soon as the job ends).
TTL = Annotated[float, BeforeValidator(lambda v: 0.0 if str(v).strip() in ("0", "0s", "0.0") else parse_duration(v))]


#: What KubeRay's submitter requests (common/job.go); the head's Ray container leaves room for it.
SUBMITTER_CPU, SUBMITTER_MEMORY = 0.5, 200 * 2**20
_K8S_UNITS = {"b": "", "kb": "k", "mb": "M", "gb": "G", "tb": "T", "kib": "Ki", "mib": "Mi", "gib": "Gi", "tib": "Ti"}


def quantity(size: str, less: int = 0) -> str:
    """A task's size ('128GB', '64GiB') as a Kubernetes quantity ('128G', '64Gi'), `less` bytes
    taken off (then in Mi, rounded down)."""
    if less:
        return f"{(size_bytes(size) - less) // 2**20}Mi"
    m = re.match(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$", str(size))
    unit = (m.group(2) or "b").lower() if m else None
    if unit not in _K8S_UNITS:
        return str(size_bytes(size))
    return m.group(1) + _K8S_UNITS[unit]


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

    _names = field_validator("namespace", "service_account", "secret", "operator_namespace")(classmethod(lambda cls, v: _dns(v)))
    _priority = field_validator("priority_class")(classmethod(
        lambda cls, v: _dns(v, "a DNS name (lowercase letters, digits, dashes, dots)", _DNS_NAME)))
    _queue = field_validator("queue")(classmethod(
        lambda cls, v: _dns(v, "a queue name (letters, digits, dashes, underscores, dots)", _QUEUE)))

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value):
        for key in value:
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a label key")
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

    @property
    def ray(self) -> str:
        """The Ray that runs: as given, else the default image's."""
        return self.ray_version or DEFAULT_RAY_VERSION

    @property
    def version(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.ray.split("."))


class KubeRayShared(StrictModel):
    """`checkpoints.shared.kuberay`: storage every pod mounts at checkpoints.path."""

    claim: str = Field(description="a PersistentVolumeClaim every pod can mount at once (ReadWriteMany)")

    _name = field_validator("claim")(classmethod(lambda cls, v: _dns(v, pattern=_DNS_NAME)))


def kuberay_placement(placement: Placement) -> KubeRayPlacement:
    """A task's or plan's `placement.kuberay`, read with this provider's model (BadInput naming the field)."""
    return provider_part(KubeRayPlacement, placement.kuberay, "placement.kuberay")


def pack(files: dict[str, str]) -> bytes:
    """Path -> text as a gzipped tar that is the same bytes for the same files (sorted members,
    fixed times, owners and modes, gzip mtime 0): render stays pure, a re-apply changes nothing."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files):
            data = files[path].encode()
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as zipped:
        zipped.write(raw.getvalue())
    return out.getvalue()


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
    contract = Contract(
        rank=env(RANK_ENV),
        nodes=env(WORKERS_ENV, plus=1),
        head=env("FQ_RAY_IP"),           # workers: KubeRay's head service; the head uses its own address
        node_addr=env(POD_IP_ENV),
        cluster_id=env("RAY_CLUSTER_NAME"),
    )
    placement_options = KubeRayPlacement

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
        if plan.image:
            out.append(f"image {plan.image}: it must hold bash and python3 (the agent), and `python` and Ray "
                       f"{options.ray} (`ray` on PATH: KubeRay runs `ray health-check` in every worker's init "
                       f"container and `ray job submit` beside the head, before setup could install it)"
                       + ("" if options.ray_version else "; say which Ray it holds in placement.kuberay.ray_version "
                          f"(KubeRay picks its probes by it; {options.ray} assumed)"))
        if res.gpu_name and not any(k.endswith("/gpu.product") for k in options.node_selector):
            out.append(f"resources.gpus: the pods request {plan.gpus_per_node} GPUs of any type; KubeRay cannot "
                       f"select {res.gpu_name}: add placement.kuberay.node_selector with your nodes' product label "
                       f"(GPU feature discovery's nvidia.com/gpu.product, e.g. NVIDIA-H100-80GB-HBM3)")
        if plan.network == "infiniband":
            out.append("network: infiniband sets NCCL's InfiniBand variables, but the pods get no RDMA device: "
                       "your cluster's RDMA resource (e.g. rdma/ib from its device plugin), the IPC_LOCK "
                       "capability and /dev/infiniband are not rendered")
        return out

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

    def volumes(self, plan: Plan) -> tuple[list[dict], list[dict]]:
        """(the pod's volumes, the containers' mounts): the ConfigMap (plan, packed agent) and the
        emptyDir the agent is unpacked into (shared by the head's init and Ray containers), the
        checkpoints, /dev/shm."""
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
        volumes, mounts = self.volumes(plan)
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
        spec: dict = {"containers": [container], "volumes": volumes}
        if options.service_account:
            spec["serviceAccountName"] = options.service_account
        spec.update(self.placed(options))
        return {"metadata": {"labels": {"rlhf-tasks/task": plan.name}}, "spec": spec}

    @staticmethod
    def placed(options: KubeRayPlacement) -> dict:
        """Where a pod may go: the task's node selector, tolerations and priority class."""
        out: dict = {}
        if options.node_selector:
            out["nodeSelector"] = dict(options.node_selector)
        if options.tolerations:
            out["tolerations"] = [t.model_dump(exclude_none=True) for t in options.tolerations]
        if options.priority_class:
            out["priorityClassName"] = options.priority_class
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
        activeDeadlineSeconds, from the RayJob's start: that, the runner's bring-up and every attempt
        the restart policy allows."""
        pre = plan.wait.head_s + plan.wait.nodes_s
        out = {"preRunningDeadlineSeconds": math.ceil(pre)}
        if plan.job.timeout_s:
            services = sum(s.timeout for s in plan.services)
            preflight = plan.preflight.timeout_s if plan.preflight.enabled else 0
            attempts = (plan.job.max_restarts + 1) * plan.job.timeout_s
            out["activeDeadlineSeconds"] = math.ceil(pre + services + preflight + attempts)
        return out

    def submitter(self, plan: Plan, options: KubeRayPlacement) -> dict:
        """KubeRay's submitter pod in Ray's own image (KubeRay fills in its `ray job submit` command,
        the dashboard's address and the token), placed where the task's pods may go."""
        spec: dict = {"restartPolicy": "Never", "containers": [{
            "name": SUBMITTER_NAME, "image": f"rayproject/ray:{options.ray}",
            "resources": {"requests": {"cpu": f"{round(SUBMITTER_CPU * 1000)}m",
                                       "memory": f"{SUBMITTER_MEMORY // 2**20}Mi"},
                          "limits": {"cpu": "1", "memory": "1Gi"}}}], **self.placed(options)}
        return {"metadata": {"labels": {"rlhf-tasks/task": plan.name}}, "spec": spec}

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
        return {"apiVersion": "ray.io/v1", "kind": "RayJob",
                "metadata": self.metadata(plan, options, plan.name, self.queue_labels(plan, options)),
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
