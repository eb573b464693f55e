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

This module is the provider's checks, plan, notes and the rendered file; the objects in it are built by
options.py (placement.kuberay), configmap.py (the plan and the agent), pods.py (the pod templates) and
rayjob.py (the RayJob).
"""

from __future__ import annotations

import re

from ...errors import BadInput
from ...models import size_bytes
from ...plan import Contract, GroupPlan, Plan, env
from ...recipes.base import Shape
from ...spec import Resources, Task
from ..base import Provider
from ..shipping import NODE_DIR, dump_yaml, shared_entry
from .configmap import CONFIGMAP_DIR, configmap_document
from .options import (SHARED_MODE, SHARING, KubeRayPlacement, KubeRayShared, _nested, group_placement,
                      kuberay_placement)
from .pods import IB_DEVICES, POD_IP_ENV, RANK_ENV, SUBMITTER_MEMORY, WORKERS_ENV
from .rayjob import rayjob_document

#: A RayJob's name: a DNS-1035 label of at most 47 characters (KubeRay's validation: its
#: RayCluster is `<name>-<5 random>`, and a Service name must start with a letter).
RAYJOB_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,45}[a-z0-9])?$")
#: What `check` and the rendered file's header say of job.working_dir with `submit: head`.
WORKING_DIR_WORDS = ("none: the job runs in the head container's working directory (the image's); nothing is "
                     "uploaded from this machine")
#: With a ttl_after_finished shorter than this, KubeRay would delete a failed job's cluster before `launch`
#: fetched the head's bundle: the head keeps it up to this long, until it was read (Plan.bundle_hold_s).
BUNDLE_HOLD_S = 60.0


def machines(task: Task | Plan, options: KubeRayPlacement) -> list[tuple[str, Resources, KubeRayPlacement]]:
    """Each kind of pod's resources and options, with the field that gives them: the task's (`resources`,
    placement.kuberay), or each node group's (`groups[i].resources`, its placement.kuberay over the task's),
    the head's first."""
    if not task.groups:
        return [("resources", task.resources, options)]
    return [(f"groups[{i}].resources", g.machine if isinstance(g, GroupPlan) else g.resources,
             group_placement(task.placement, g, i)) for i, g in enumerate(task.groups)]


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
    renders_groups = True  # a worker group per node group (rayjob.group_specs)
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
        for field, res, own in machines(task, options):
            if res.gpu_memory and not any(key.endswith(labels) for key in own.node_selector):
                where = "placement.kuberay" if field == "resources" else f"{field.split('.')[0]}.placement.kuberay"
                raise BadInput(f"{field}.gpus: {res.gpus}: a pod requests GPUs by count only "
                               f"(nvidia.com/gpu), and Kubernetes selects their nodes by the labels the cluster gives "
                               f"them; give {where}.node_selector with your nodes' GPU label: GPU feature "
                               f"discovery's nvidia.com/gpu.product (e.g. NVIDIA-A100-SXM4-80GB) or "
                               f"nvidia.com/gpu.memory (MiB, e.g. \"81920\"), AMD's labeller's amd.com/gpu.vram")
        field, head_res, _ = machines(task, options)[0]
        if head_res.memory and size_bytes(head_res.memory) <= SUBMITTER_MEMORY:
            raise BadInput(f"{field}.memory: {head_res.memory} is not more than the "
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
        options = kuberay_placement(plan.placement)
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
        for field, res, own in machines(plan, options):
            if res.gpu_name and not any(k.endswith("/gpu.product") for k in own.node_selector):
                where = "placement.kuberay" if field == "resources" else f"{field.split('.')[0]}.placement.kuberay"
                out.append(f"{field}.gpus: the pods request {res.gpus_per_node} GPUs of any type; KubeRay cannot "
                           f"select {res.gpu_name}: add {where}.node_selector with your nodes' product label "
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

    def render(self, plan: Plan) -> dict[str, str]:
        options = kuberay_placement(plan.placement)
        configmap = configmap_document(plan, options)
        rayjob = rayjob_document(plan, options)
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
