"""The RayJob (`ray.io/v1`): its RayCluster spec (a head group and one worker group of nodes - 1, Ray's
start parameters, token auth, KubeRay's NetworkPolicy), the entrypoint (the agent's job runner on the
head), the submission in K8sJobMode with a submitter pod of our own, the deadlines that bound a run,
and the labels a gang scheduler (Kueue, Volcano, YuniKorn) reads.
"""

from __future__ import annotations

import math
import shlex

from ...plan import Plan
from .configmap import agent_shell, metadata
from .options import KubeRayPlacement, group_placement
from .pods import pod_template, submitter_template

WORKER_GROUP = "workers"


def ray_start_params(plan: Plan, head: bool) -> dict[str, str]:
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


def worker_group(name: str, replicas: int, spec: dict) -> dict:
    return {"groupName": name, "replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas, **spec}


def group_specs(plan: Plan, options: KubeRayPlacement) -> tuple[dict, list[dict]]:
    """The head group and the worker groups. Without node groups: the head, and one worker group of nodes - 1.
    With them, KubeRay's own heterogeneous form: the head is the first group's first node, and each group's
    other nodes are a worker group of their name, each its group's machine and image, with its own
    placement.kuberay keys over the task's, and the group's Ray labels and custom resources in KubeRay's
    group `labels` and `resources` (common/pod.go: `--labels`, and `--resources` beside the GPUs the container's
    limits give; rayStartParams may then name neither, utils/validation.go). A group whose GPUs the recipe serves
    outside Ray (GroupPlan.ray_gpus 0) says `GPU: "0"` there: updateRayStartParamsResources maps a key ending in
    "gpu" (utils/resources.go IsGPUResourceKey) to num-gpus, which addWellKnownAcceleratorResources then does not
    take from the container's GPU limits (v1.6.2), so its pods keep their GPUs and Ray gets none."""
    if not plan.groups:
        head = {"rayStartParams": ray_start_params(plan, True), "template": pod_template(plan, options, True)}
        spec = {"rayStartParams": ray_start_params(plan, False), "template": pod_template(plan, options, False)}
        return head, [worker_group(WORKER_GROUP, plan.nodes - 1, spec)] if plan.nodes > 1 else []
    head, workers = {}, []
    for index, group in enumerate(plan.groups):
        own = group_placement(plan.placement, group, index)
        # the group's CPUs as Ray's (num-cpus without groups, which KubeRay refuses beside group resources)
        resources = {name: str(count) for name, count in group.resources.items()}
        if group.num_cpus:
            resources["cpu"] = str(group.num_cpus)
        if group.ray_gpus is not None:
            resources["GPU"] = str(group.ray_gpus)

        def spec(is_head: bool) -> dict:
            return {"rayStartParams": ray_start_params(plan, is_head), "labels": dict(group.labels),
                    "resources": resources, "template": pod_template(plan, own, is_head, group)}
        if index == 0:
            head = spec(True)
        if group.worker_ranks:
            workers.append(worker_group(group.name, len(group.worker_ranks), spec(False)))
    return head, workers


def deadlines(plan: Plan) -> dict[str, int]:
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


def queue_labels(plan: Plan, options: KubeRayPlacement) -> dict[str, str]:
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


def rayjob_document(plan: Plan, options: KubeRayPlacement) -> dict:
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
    cluster["headGroupSpec"], workers = group_specs(plan, options)
    if workers:
        cluster["workerGroupSpecs"] = workers
    # KubeRay pastes the entrypoint unquoted into the submitter's `bash -c` line: one quoted `bash -c`
    # word keeps our `&&` and `${PYTHONPATH...}` for the job's shell (Ray's CLI joins the words back).
    entrypoint = shlex.join(["bash", "-c", agent_shell(plan, "--ray-started", "--skip-setup")])
    spec: dict = {
        "entrypoint": entrypoint,
        # K8sJobMode with a submitter of our own: KubeRay's submitter runs `ray job submit`, and in
        # SidecarMode it runs in the head's image, which may hold no Ray before setup installs it.
        "submissionMode": "K8sJobMode",
        "submitterConfig": {"backoffLimit": 0},  # one submission: the runner restarts the job itself
        "submitterPodTemplate": submitter_template(plan, options),
        "backoffLimit": 0,  # a retry rebuilds the whole cluster: the runner restarts the job instead
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": math.ceil(options.ttl_after_finished),
        **deadlines(plan),
        "rayClusterSpec": cluster,
    }
    if options.queue and (options.scheduler or "kueue") == "kueue":
        spec["suspend"] = True  # created held, as Kueue's webhook would make it: Kueue admits it (suspend: false)
    labels = queue_labels(plan, options)
    if options.kueue_priority_class:
        labels["kueue.x-k8s.io/priority-class"] = options.kueue_priority_class
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": metadata(plan, options, plan.name, labels),
            "spec": spec}
