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
from .options import KubeRayPlacement
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
    cluster["headGroupSpec"] = {"rayStartParams": ray_start_params(plan, True),
                                "template": pod_template(plan, options, True)}
    workers = plan.nodes - 1
    if workers:
        cluster["workerGroupSpecs"] = [{
            "groupName": WORKER_GROUP, "replicas": workers, "minReplicas": workers, "maxReplicas": workers,
            "rayStartParams": ray_start_params(plan, False),
            "template": pod_template(plan, options, False)}]
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
