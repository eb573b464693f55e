"""The pod template builder, as KubeRay's own (common/pod.go): the one place every fact about a pod
lives. The Ray containers of the head and the workers (the agent's attached roles before KubeRay's
`ray start`, the contract's environment, the secrets by reference, volumes and mounts, requests =
limits in Kubernetes' units, the startupProbe that covers setup), where a pod may go (node selector,
tolerations, affinity, topology spread, securityContext), and KubeRay's submitter pod.
"""

from __future__ import annotations

import copy
import math

from ...models import size_bytes
from ...plan import GroupPlan, Plan, gpu_vendor
from ..shipping import NODE_DIR, shared_entry
from .configmap import CONFIGMAP_DIR, RAY_PATH_KEY, agent_shell, configmap_name
from .options import KubeRayPlacement, KubeRayShared

RANK_ENV, POD_IP_ENV, WORKERS_ENV = "RLHF_TASKS_RANK", "RLHF_TASKS_POD_IP", "RLHF_TASKS_WORKER_REPLICAS"
#: Where the Ray container keeps the environment the agent wrote for KubeRay's `ray start`.
RAY_ENV_FILE = "/tmp/rlhf-tasks/ray.env"
#: KubeRay's dashboard agent port (it sets it when rayStartParams leave it out): a worker's startup is done once it answers.
AGENT_PORT = 52365
PROBE_PERIOD_S = 10
#: The head's dashboard port: KubeRay's submitter and the operator's job polling use the head
#: container's port named `dashboard` (common/job.go, utils/util.go FetchHeadServiceURL), which
#: the head declares; `forward` uses it too.
DASHBOARD_PORT = 8265
SUBMITTER_NAME = "ray-job-submitter"
GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
#: Where the InfiniBand devices are, on the node and in the Ray container (ib_host_device).
IB_DEVICES = "/dev/infiniband"


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


def container_resources(plan: Plan, options: KubeRayPlacement, head: bool) -> dict:
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


def container_env(plan: Plan, options: KubeRayPlacement, rank: int) -> list[dict]:
    """The container's environment: the contract's variables, the plan's env, the secrets by reference."""
    out = [{"name": RANK_ENV, "value": str(rank)},
           {"name": WORKERS_ENV, "value": str(plan.nodes - 1)},
           {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    out += [{"name": key, "value": value} for key, value in plan.env.items()]
    secret = options.secret or f"{plan.name}-secrets"
    out += [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name}}} for name in plan.secrets]
    out.append({"name": "BASH_ENV", "value": f"{CONFIGMAP_DIR}/{RAY_PATH_KEY}"})  # `ray` last on PATH
    return out


def pod_volumes(plan: Plan, options: KubeRayPlacement) -> tuple[list[dict], list[dict]]:
    """(the pod's volumes, the Ray container's mounts): the ConfigMap (plan, packed agent) and the
    emptyDir the agent is unpacked into, the checkpoints, /dev/shm, then the user's: the node's
    /dev/infiniband (ib_host_device) and placement.kuberay.volumes."""
    volumes = [{"name": "rlhf-tasks", "configMap": {"name": configmap_name(plan), "defaultMode": 0o555}},
               {"name": "rlhf-tasks-node", "emptyDir": {}}]
    mounts = [{"name": "rlhf-tasks", "mountPath": CONFIGMAP_DIR, "readOnly": True},
              {"name": "rlhf-tasks-node", "mountPath": NODE_DIR}]
    if plan.checkpoint_dir:
        shared = shared_entry(KubeRayShared, plan.checkpoint_shared, "kuberay")
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


def startup_probe(plan: Plan, head: bool, group: GroupPlan | None = None) -> dict:
    """How long the container may take before its Ray answers (setup, a worker's services, its group's
    too): until then KubeRay's liveness probe is off. The head's GCS, a worker's dashboard agent."""
    budget = plan.wait.head_s
    if not head:
        where = {"every_node"} | ({f"group {group.name}"} if group else set())
        budget += sum(s.timeout for s in plan.services if s.where in where)
    return {"tcpSocket": {"port": plan.ray.port if head else AGENT_PORT}, "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, math.ceil(budget / PROBE_PERIOD_S))}


def pod_template(plan: Plan, options: KubeRayPlacement, head: bool, group: GroupPlan | None = None) -> dict:
    """A Ray pod's template. Its rank is its group's (0 the head, 1 the workers); with node groups, a worker's
    is the first of its group's worker ranks, by which the agent finds its group's setup and services, and the
    pod is its group's machine (its resources, GPUs and image: plan.for_group)."""
    rank = 0 if head else group.worker_ranks.start if group else 1
    if group is not None:
        plan = plan.for_group(group)
    image = plan.image or f"rayproject/ray:{options.ray}"
    volumes, mounts = pod_volumes(plan, options)
    env = container_env(plan, options, rank)
    container: dict = {
        "name": "ray-head" if head else "ray-worker",
        "image": image,
        # KubeRay runs this, then its own `ray start`, in one shell: `OURS && ulimit ...; ray start ...`.
        # `;` binds looser than `&&`, so a failure here must end the shell itself (`|| exit`), or Ray
        # would start (and the node join) without its setup and environment.
        # It unpacks the agent into the pod's emptyDir, runs setup (once per pod, here where Ray runs:
        # an init container's installs would not reach this container) and, on the head, prepare.
        "args": [agent_shell(plan, "--before-ray", RAY_ENV_FILE, unpack=True)
                 + f" && . {RAY_ENV_FILE} || exit"],
        "env": env,
        "volumeMounts": mounts,
        "startupProbe": startup_probe(plan, head, group),
    }
    if head:
        container["ports"] = [{"name": "gcs-server", "containerPort": plan.ray.port},
                              {"name": "dashboard", "containerPort": plan.ray.dashboard_port},
                              {"name": "client", "containerPort": plan.ray.client_server_port}]
    resources = container_resources(plan, options, head)
    if resources:
        container["resources"] = resources
    security = options.container_security(ray=True)
    if security:  # KubeRay copies it into the workers' wait-gcs-ready (common/pod.go)
        container["securityContext"] = security
    spec: dict = {"containers": [container], "volumes": volumes}
    if options.service_account:
        spec["serviceAccountName"] = options.service_account
    spec.update(placed(options, ray=True))
    return {"metadata": pod_metadata(plan, options), "spec": spec}


def pod_metadata(plan: Plan, options: KubeRayPlacement) -> dict:
    """A pod template's labels (the task's, then the user's) and the user's annotations."""
    meta: dict = {"labels": {"rlhf-tasks/task": plan.name, **options.pod_labels}}
    if options.pod_annotations:
        meta["annotations"] = dict(options.pod_annotations)
    return meta


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


def submitter_template(plan: Plan, options: KubeRayPlacement) -> dict:
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
    spec: dict = {"restartPolicy": "Never", "containers": [container], **placed(options, ray=False)}
    return {"metadata": pod_metadata(plan, options), "spec": spec}
