"""The cluster plan: the resolved, provider-neutral description of what every node
does, built from the task, the recipe and the provider's choices, and never edited by
hand. It travels to the nodes as JSON, where the node agent (standard library only)
reads it and refuses a plan of another version.

The provider's environment contract travels in it as data: how a node learns its rank,
the node count, the head's address and its own from that provider's environment, in a
small fixed set of rule kinds the agent interprets (`Rule`). So the agent names no
provider, and a provider added from outside works on the nodes unchanged."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from . import runtimeenv, workdir
from .agent.protocol import GROUP_ADDR, GROUP_LABEL, PLAN_VERSION  # the agent owns them: the version it reads,
                                                                 # the group label and the group address placeholder
from .errors import BadInput
from .models import Service, StrictModel, WandbOptions, size_bytes
from .recipes.base import GroupShape, Shape
from .spec import GroupPlacement, Placement, Resources, Task

TOKEN_ENV = "RAY_AUTH_TOKEN"

#: Kept out of every uploaded working_dir: VCS data, run artifacts, weights, data (and, measured where it
#: is uploaded from this machine, any virtualenv in it: workdir.py).
DEFAULT_EXCLUDES = [
    ".git", ".venv", "node_modules", "runs/", "checkpoints/", "data/", "wandb/", "__pycache__",
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.parquet", "*.arrow",
]


# ------------------------------------------------------------------ the environment contract

class Rule(StrictModel):
    """How a node reads one value from its provider's environment. Exactly one source:

    - `env`: the variable's value; with `item`, the Nth entry (or the entry at this
      node's rank: `item: rank`) of a list the variable holds, one per line or comma;
    - `template`: a string with `{VAR}` filled from the environment, e.g.
      `{HEAD_ID}.pods.internal`;
    - `command`: the output of a command whose arguments may hold `{VAR}` (with `item`,
      one line of it), e.g. a scheduler's command that expands a node list;
    - `value`: a constant.

    `plus` adds to an integer (a worker count + 1 = the node count); `default` is used
    when the source is unset or empty."""

    env: str | None = None
    template: str | None = None
    command: list[str] | None = None
    value: str | None = None
    item: int | Literal["rank"] | None = None
    plus: int = 0
    default: str | None = None

    @model_validator(mode="after")
    def _one_source(self):
        sources = [k for k in ("env", "template", "command", "value") if getattr(self, k) is not None]
        if len(sources) != 1:
            raise ValueError(f"a contract rule needs exactly one of env, template, command, value (got {sources})")
        return self


def env(name: str, **kw: Any) -> Rule:
    return Rule(env=name, **kw)


def template(text: str, **kw: Any) -> Rule:
    return Rule(template=text, **kw)


def command(argv: list[str], **kw: Any) -> Rule:
    return Rule(command=argv, **kw)


def value(text: str) -> Rule:
    return Rule(value=text)


class Contract(StrictModel):
    """Where a node finds its place in the cluster. `head` may be left out for providers
    where only workers are told the head (the head then uses its own address); a node
    whose own address is not given uses the one on its route to the head. `peer` names
    another node: a head whose own name resolves only to loopback (127.0.1.1 on some
    hosts) takes its address on the route to that node instead."""

    rank: Rule
    nodes: Rule
    head: Rule | None = None
    node_addr: Rule | None = None
    cluster_id: Rule | None = None
    gpus_per_node: Rule | None = None
    peer: Rule | None = None


def contract_variables(contract: Contract) -> set[str]:
    """The variables a contract reads from the node's environment (`env`, and `{VAR}` in a
    `template` or a `command`): the provider sets them, so the task's env must not."""
    names: set[str] = set()
    for field in Contract.model_fields:
        rule = getattr(contract, field)
        if rule is None:
            continue
        names.update([rule.env] if rule.env else [])
        for text in [rule.template or "", *(rule.command or [])]:
            names.update(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", text))
    return names


def check_contract_env(task: Task, contract: Contract, provider: str) -> None:
    """BadInput naming `env.NAME` when the task sets a variable of the provider's contract."""
    clash = sorted(set(task.env) & contract_variables(contract))
    if clash:
        also = f" (also: {', '.join('env.' + n for n in clash[1:])})" if clash[1:] else ""
        raise BadInput(f"env.{clash[0]}: the {provider} provider sets it on every node (it tells the node its place "
                       f"in the cluster); remove it{also}")


#: Network presets every provider offers: the collective libraries' variables.
#: `{iface}` is the interface that carries the node's address (or its route to the head),
#: found on the node. The task's `env` overrides any of them.
GENERIC_NETWORKS: dict[str, dict[str, str]] = {
    "auto": {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}"},
    "ethernet": {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}", "NCCL_IB_DISABLE": "1"},
    "infiniband": {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}", "NCCL_IB_DISABLE": "0"},
}


#: AMD Instinct GPUs (MI300X, MI250, MI355X, ...): their nodes get the ROCm preset.
AMD_GPU = re.compile(r"^(?:amd[-_]?)?(?:instinct[-_]?)?mi\d{2,3}[a-z]?(?:[-_].*)?$", re.IGNORECASE)
#: RCCL/HIP settings of verl's AMD Slurm script (docs/amd_tutorial) that hold on any
#: cluster; the cluster-specific ones (NCCL_IB_HCA, NCCL_IB_GID_INDEX, NCCL_CROSS_NIC)
#: belong in the task's env.
ROCM_ENV = {
    "RCCL_MSCCL_ENABLE": "0",            # AMD: avoids a data mismatch of past RCCL releases
    "TORCH_NCCL_HIGH_PRIORITY": "1",
    "GPU_MAX_HW_QUEUES": "2",
    "HSA_NO_SCRATCH_RECLAIM": "1",
    "NCCL_CHECKS_DISABLE": "1",
    "NCCL_PROTO": "Simple",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
}


def gpu_vendor(gpu_name: str | None) -> Literal["amd", "nvidia"] | None:
    """Whose GPUs the task asks for (None: no GPUs, or a bare count)."""
    if not gpu_name:
        return None
    return "amd" if AMD_GPU.match(gpu_name) else "nvidia"


def accelerator_env(vendor: Literal["amd", "nvidia"] | None) -> dict[str, str]:
    """The ROCm preset for AMD GPUs: the RCCL settings above. Nothing for NVIDIA. The variables
    that choose the node's GPUs are the node agent's to set (raynode.visible_devices_env): only the
    node knows what its scheduler chose."""
    if vendor != "amd":
        return {}
    return dict(ROCM_ENV)


# ------------------------------------------------------------------ the plan

class RayPlan(StrictModel):
    port: int
    dashboard_port: int
    dashboard_host: str                  # 127.0.0.1, or {node_addr} when the task opts in
    client_server_port: int
    ready_port: int
    agent_listen_port: int               # 0: Ray picks one (several nodes on one host)
    auth: Literal["token", "none"]
    debug: Literal["off", "legacy", "post_mortem"]
    object_store_memory: int | None
    num_cpus: int | None
    num_gpus: int | None
    temp_dir: str | None = None          # one per node below it, when set
    min_worker_port: int | None = None   # Ray's worker port range when a provider moves it (SkyPilot's
    max_worker_port: int | None = None   # own Ray holds Ray's default one); None: Ray's default


class WaitPlan(StrictModel):
    head_s: float
    nodes_s: float
    node_loss_s: float = 40.0
    node_silence_s: float | None = None  # the head's Ray health checks declare a silent node dead within it


class PreflightPlan(StrictModel):
    """What the head checks before it submits the job (see rlhf_tasks/agent/preflight.py)."""

    enabled: bool
    timeout_s: float
    min_bandwidth_bits: float
    torch: bool = True                   # torch and the all_reduce; else TCP streams only
    model: str | None = None             # the job's model, to say what a slow link means for weight sync
    weight_bytes: int | None = None      # one bf16 copy of its weights, from the size in its name (7B: 14 GB)


#: The model a recipe trains, by the argument the recipes use for it.
MODEL_ARGS = ("pretrain", "model")
_PARAMS = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z])")


def name_bytes(name: str) -> int | None:
    """Bytes of one bf16 copy of a model whose name says its size (`Qwen2.5-7B-Instruct`: 7e9
    parameters, 14 GB), else None; a heuristic for messages."""
    sizes = _PARAMS.findall(name.rsplit("/", 1)[-1])
    return int(float(sizes[-1]) * 1e9 * 2) if sizes else None


def model_weights(job_args: Any) -> tuple[str | None, int | None]:
    """(model name, bytes of one bf16 copy) from the job's model argument (name_bytes)."""
    for key in MODEL_ARGS:
        name = getattr(job_args, key, None)
        if isinstance(name, str) and name:
            return name, name_bytes(name)
    return None, None


#: The caches below a provider's cache directory (Provider.cache_dir), as each library reads its variable:
#: huggingface_hub (constants.py: HF_HOME, the models in its hub/), torch (torch/hub.py, _get_torch_home:
#: TORCH_HOME), vLLM (vllm/envs.py: VLLM_CACHE_ROOT, its compiled graphs). The task's env wins.
CACHE_ENV = {"HF_HOME": "huggingface", "TORCH_HOME": "torch", "VLLM_CACHE_ROOT": "vllm"}
#: The secrets huggingface_hub reads a token from (constants.py: HF_TOKEN; the older name after it).
HUB_TOKENS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
OFFLINE_ENV = "HF_HUB_OFFLINE"


class HubPlan(StrictModel):
    """The Hugging Face Hub models the job loads, fetched before the head starts (agent/hub.py)."""

    models: list[str]
    #: Every node sees one cache: rank 0 fetches, once; else each node fetches into its own.
    shared: bool = False
    #: HF_HOME (or HF_HUB_CACHE) the nodes get; None: each node's default (~/.cache/huggingface).
    cache: str | None = None
    #: The secret holding the hub's token, by name (the fetch reads it from the node's environment).
    token_env: str | None = None
    #: The plan sets HF_HUB_OFFLINE=1 for Ray, its job and the services (not setup, prepare, the fetch).
    offline: bool = True
    #: What the job reads from the hub by name at run time, which keeps it online.
    online_for: list[str] = []


def hub_plan(task: Task, models: list[str], reads: list[str]) -> HubPlan | None:
    """The hub part of the plan (None: the task names no model, and nothing is fetched)."""
    if not models:
        return None
    return HubPlan(models=models, token_env=next((n for n in HUB_TOKENS if n in task.secrets), None),
                   offline=not reads and OFFLINE_ENV not in task.env, online_for=reads)


def inside(path: str, directory: str | None) -> bool:
    return bool(directory) and (path.rstrip("/") + "/").startswith(directory.rstrip("/") + "/")


def with_caches(plan: "Plan", cache_dir: str | None, shares_filesystem: bool) -> "Plan":
    """The plan with the provider's cache directory in its env (CACHE_ENV below it, where the task's env sets
    none), and whether the nodes fetch the models once into one cache every node sees: on one filesystem, or
    a cache on the checkpoint storage every node mounts."""
    env = dict(plan.env)
    if cache_dir:
        for name, below in CACHE_ENV.items():
            env.setdefault(name, f"{cache_dir.rstrip('/')}/{below}")
    hub = plan.hub
    if hub is not None:
        home = env.get("HF_HUB_CACHE") or env.get("HF_HOME")
        shared = shares_filesystem or bool(plan.checkpoint_shared and home and inside(home, plan.checkpoint_dir))
        hub = hub.model_copy(update={"shared": shared, "cache": home})
    return plan.replace(env=env, hub=hub)


class GroupPlan(StrictModel):
    """One node group of the task (spec.Group): its ranks (first_rank .. first_rank + nodes - 1, in the task's
    order), what its nodes tell Ray, and what the provider places for it. `resources` are Ray's custom
    resources of each of its nodes (`ray start --resources`): one named for the group and one for its GPU
    type, lowercased, each the group's GPUs per node (1 for a CPU group), as OpenRLHF's Slurm guide's
    `ray start --resources '{"v100": 8}'`; `labels` Ray's node labels (`ray start --labels`)."""

    name: str
    nodes: int
    first_rank: int
    gpus_per_node: int
    gpu_name: str | None
    num_cpus: int | None                  # ray start --num-cpus (the group's resources.cpus)
    labels: dict[str, str]
    resources: dict[str, int]
    setup: list[str]                      # after the task's setup, on this group's nodes
    image: str | None                     # the group's, else the task's
    machine: Resources                    # the group's resources block, for the provider to place
    price_per_hour: float | None = None   # US dollars per hour for each of its nodes, where the task gives it
    placement: GroupPlacement = GroupPlacement()  # the group's own provider options, over the task's
    #: The GPUs its nodes give Ray (`ray start --num-gpus`): 0 for a group whose GPUs the recipe serves outside
    #: Ray (RecipeOutput.served_groups), so that no framework's placement group lands on them; None: its GPUs.
    ray_gpus: int | None = None

    @property
    def worker_ranks(self) -> range:
        """Its ranks but the head's: a provider that starts the head apart (KubeRay's head group) places these."""
        return range(self.first_rank + (1 if self.first_rank == 0 else 0), self.first_rank + self.nodes)


def group_plans(task: Task, served: list[str] = ()) -> list[GroupPlan]:
    """The task's groups in the plan, ranks counted in the task's order (the first group holds rank 0); those in
    `served` (the recipe serves their GPUs outside Ray) with no GPUs for Ray."""
    out, rank = [], 0
    for group in task.groups:
        res = group.resources
        count = res.gpus_per_node or 1
        resources = {group.name: count, **({res.gpu_name.lower(): count} if res.gpus_per_node and res.gpu_name else {})}
        out.append(GroupPlan(name=group.name, nodes=group.nodes, first_rank=rank, gpus_per_node=res.gpus_per_node,
                             gpu_name=res.gpu_name, num_cpus=res.cpus, labels={GROUP_LABEL: group.name},
                             resources=resources, setup=list(group.setup), image=group.image or task.image, machine=res,
                             placement=group.placement, price_per_hour=group.price_per_hour,
                             ray_gpus=0 if group.name in served else None))
        rank += group.nodes
    return out


def shape_of(task: Task, **common: Any) -> Shape:
    """The cluster a recipe is built for. With groups, the nodes with GPUs (a CPU group's nodes are not the
    trainer's) and the fewest GPUs per node among them, so that what a framework is told fits every one; a
    task whose groups have no GPUs counts every node. Without groups: the task's nodes and resources."""
    if not task.groups:
        return Shape(nodes=task.nodes, gpus_per_node=task.resources.gpus_per_node, gpu_name=task.resources.gpu_name,
                     **common)
    groups = tuple(GroupShape(g.name, g.nodes, g.resources.gpus_per_node, g.resources.gpu_name) for g in task.groups)
    gpu = [g for g in groups if g.gpus_per_node]
    if not gpu:
        return Shape(nodes=task.nodes, gpus_per_node=0, groups=groups, **common)
    return Shape(nodes=sum(g.nodes for g in gpu), gpus_per_node=min(g.gpus_per_node for g in gpu),
                 gpu_name=gpu[0].gpu_name, groups=groups, **common)


class JobPlan(StrictModel):
    recipe: str
    #: ray: submitted to Ray; every_node: no Ray, every node runs the entrypoint (torchrun)
    mode: Literal["ray", "every_node"] = "ray"
    submit: Literal["head", "client"]
    entrypoint: list[str]
    wandb_args: list[str]
    working_dir: str | None
    excludes: list[str]
    #: job.runtime_env as Ray takes it, besides working_dir and excludes (runtimeenv.plan_env): pip, uv,
    #: env_vars, py_modules (a relative one is of working_dir, wherever the provider puts it).
    runtime_env: dict[str, Any] = {}
    timeout_s: float | None
    summary: dict | None
    max_restarts: int = 0
    stall_timeout_s: float | None = None


class MachinePrice(StrictModel):
    """A GET a node sends about its own machine: `url` a template whose `{VAR}` come from the node's environment
    (`defaults` when unset), `bearer_env` the variable with the token, `field` the answer's JSON number of US
    dollars per hour. Data, so the agent names no provider; every node of the plan is the same machine."""

    url: str
    defaults: dict[str, str] = {}
    bearer_env: str | None = None
    field: str
    what: str                             # for the log: "RunPod's `cost` of this pod"


class BudgetPlan(StrictModel):
    """What the head agent enforces, so that it holds with no launcher attached (agent/budget.py):
    the cluster's price, the caps, the grace its job's driver gets at a cap, and how long a kept
    cluster may stay without a running job."""

    price_per_hour: float | None = None  # US dollars for the whole cluster; RunPod's: filled in at launch
    max_cost: float | None = None
    max_duration_s: float | None = None
    stop_grace_s: float = 120.0
    idle_s: float | None = 3600.0        # None: never (a kept cluster stays until `down`)
    #: The training the caps belong to, whatever restarts it (the cluster's name; `launch --fresh` starts a new
    #: one): the head adds up the spend of every attempt of it (agent/budget.py, the spend record).
    training: str | None = None
    #: The attempts of the training the launcher knows of (its record, runs/NAME/spend.json): attempt id -> spend.
    spent: dict[str, dict] = {}
    #: The head agent's exit status at a cap, one the provider does not relaunch (dstack: 0, its DONE_BY_RUNNER).
    cap_exit: int = 1
    #: How often the provider relaunches after the job's own failure with no count of its own (dstack): the head
    #: ends the last allowed attempt's failure with cap_exit. None: the head counts no failures.
    error_retries: int | None = None
    #: Where the head reads what the provider bills for its own machine, once it runs (RunPod: its pod's `cost`):
    #: the head counts that times the node count instead of price_per_hour. None: price_per_hour is counted.
    machine_price: MachinePrice | None = None


#: The action a node takes to end its own machine once its agent is done (RunPod: terminate its pod with
#: the pod-scoped key RunPod puts in every pod); None where ending the agent ends the machine's bill.
class SelfEnd(StrictModel):
    """An HTTP request a node sends about itself when its agent ends: `url` is a template whose
    `{VAR}` come from the node's environment (`defaults` when unset), `bearer_env` names the
    variable holding the token for its Authorization header. Data, so the agent names no provider."""

    method: Literal["POST", "DELETE"]
    url: str
    defaults: dict[str, str] = {}
    json_body: dict[str, Any] | None = None
    bearer_env: str | None = None
    what: str                             # for the log: "terminate this pod"


class Plan(StrictModel):
    version: int = PLAN_VERSION
    name: str
    provider: str
    cluster_id: str | None = None        # set by providers that name the cluster before it starts
    keep_cluster: bool = False           # the head stays up after the job, until `rlhf-tasks down`
    nodes: int
    gpus_per_node: int
    #: Whose GPUs the nodes have: on AMD's the agent sets the visible-device variables ROCm's readers need.
    gpu_vendor: Literal["amd", "nvidia"] | None = None
    #: The task's node groups (left out of the JSON without them). With groups, gpus_per_node and resources
    #: are the first group's (the head's), and each group's nodes take theirs from here.
    groups: list[GroupPlan] = []
    contract: Contract
    network: str
    network_env: dict[str, str]
    env: dict[str, str]
    secrets: list[str]
    token_env: str | None
    setup: list[str]
    prepare: list[str]
    services: list[Service]
    ray: RayPlan
    wait: WaitPlan
    checkpoint_dir: str | None
    preflight: PreflightPlan
    job: JobPlan
    # What the provider needs to place the nodes (render reads these; the agent does not).
    placement: Placement
    resources: Resources
    image: str | None
    resume: bool = False                 # the job resumes from checkpoint_dir (checkpoints.resume: auto)
    #: `launch --fresh`: the launch's UTC stamp; the head moves checkpoint_dir aside (DIR.old-STAMP) before prepare.
    fresh: str | None = None
    #: The recipe's checkpoint files below checkpoint_dir (shell patterns, e.g. `step_*.pt`); [] where not known.
    checkpoint_files: list[str] = []
    #: This provider's entry of checkpoints.shared (its own check() validated it); None: a directory on each node.
    checkpoint_shared: dict[str, Any] | None = None
    #: Packages of rlhf_tasks the recipe's commands import; providers that ship the agent ship them too.
    modules: list[str] = []
    budget: BudgetPlan = BudgetPlan()
    self_end: SelfEnd | None = None
    #: After a failed job, the head keeps its forensics bundle this long (until it was read) before it
    #: exits: where the provider deletes the cluster as soon as the job ends, the launcher fetches it first.
    bundle_hold_s: float = 0.0
    #: The open-files soft limit every node's agent raises before it starts anything (job.open_files, else the
    #: recipe's); None: the node's stands.
    open_files: int | None = None
    #: The Hugging Face Hub models the job loads, fetched before the head starts; None: the task names none.
    hub: HubPlan | None = None
    #: Paths `prepare` makes on the head that every node reads (the recipe's): the provider's to check
    #: (Provider.check_node_inputs); the nodes need not know them.
    node_inputs: list[str] = Field([], exclude=True)

    @model_validator(mode="after")
    def _version(self):
        if self.version != PLAN_VERSION:
            raise ValueError(f"plan version {self.version}; this rlhf-tasks reads version {PLAN_VERSION}")
        return self

    def to_json(self) -> str:
        """What travels to the nodes (field names as the agent reads them)."""
        return self.model_dump_json(indent=2, by_alias=True, exclude=None if self.groups else {"groups"}) + "\n"

    @property
    def unshared_checkpoints(self) -> bool:
        """The job resumes from a checkpoint directory no shared storage backs (each node has its own)."""
        return bool(self.resume and self.checkpoint_dir and not self.checkpoint_shared)

    @property
    def task_price(self) -> float | None:
        """The cluster's price per hour as the task gives it (placement.price_per_hour, or its groups' prices per
        node summed: spec.Task.price_per_hour), not what a provider counts at launch (budget.price_per_hour)."""
        if self.groups and self.groups[0].price_per_hour is not None:
            return sum(group.nodes * group.price_per_hour for group in self.groups)
        return self.placement.price_per_hour

    @property
    def node_price_bound(self) -> float | None:
        """The most one node may cost per hour as the task prices it, the bound a provider hears on every
        instance (dstack's max_price, SkyPilot's max_hourly_cost): the dearest group's price per node, else the
        cluster's split over its nodes; None without a price."""
        if self.groups and self.groups[0].price_per_hour is not None:
            return max(group.price_per_hour for group in self.groups)
        price = self.placement.price_per_hour
        return price / self.nodes if price is not None else None

    def for_group(self, group: GroupPlan) -> "Plan":
        """The plan as one group's nodes see it: the group's machine, GPUs per node and image (a provider that
        builds each group's nodes apart, KubeRay's worker groups or Slurm's hetjob components, builds from it)."""
        return self.model_copy(update={"resources": group.machine, "gpus_per_node": group.gpus_per_node,
                                       "image": group.image})

    def replace(self, **changes: Any) -> "Plan":
        """A copy with some fields changed (and `ray=` merged field by field)."""
        if "ray" in changes and isinstance(changes["ray"], dict):
            changes["ray"] = self.ray.model_copy(update=changes["ray"])
        return self.model_copy(update=changes)


def check_group_addrs(task: Task, entrypoint: list[str], mode: str) -> None:
    """`{group_addr:NAME}` in the job's command names a group of the task, and the head fills it (a Ray job):
    BadInput naming the job's field otherwise."""
    named = [m.group(1) for arg in entrypoint for m in GROUP_ADDR.finditer(arg)]
    if not named:
        return
    field = "job.args.entrypoint" if task.job.recipe == "command" else "job.args"
    groups = [g.name for g in task.groups]
    unknown = [name for name in dict.fromkeys(named) if name not in groups]
    if unknown:
        have = f"its groups: {', '.join(groups)}" if groups else "it has no groups"
        raise BadInput(f"{field}: {{group_addr:{unknown[0]}}} names no group of the task ({have})")
    if mode != "ray":
        raise BadInput(f"{field}: {{group_addr:NAME}} is filled by the head when it starts a Ray job; the "
                       f"{task.job.recipe} recipe runs its command on every node without Ray")


def check_budget(task: Task, provider: str, priced: bool) -> None:
    """BadInput naming the field when a cost cap has no price to count against (`priced`: the
    provider knows its own price, e.g. RunPod's catalog)."""
    placement = task.placement
    if placement.max_cost is not None and task.price_per_hour is None and not priced:
        give = ("each group's price_per_hour (US dollars per hour for each of its nodes)" if task.groups else
                "placement.price_per_hour (US dollars per hour for the whole cluster)")
        raise BadInput(f"placement.max_cost: the head agent counts the cost from the cluster's price per hour, and "
                       f"the {provider} provider does not know it; give {give}, or use placement.max_duration")


def wandb_options(task: Task) -> WandbOptions | None:
    """placement.wandb with job.wandb over it, field by field; None where the task names neither."""
    if task.placement.wandb is None and task.job.wandb is None:
        return None
    return (task.placement.wandb or WandbOptions()).merged(task.job.wandb)


def build_plan(task: Task, provider: str, contract: Contract, networks: dict[str, dict[str, str]],
               checkpoint_dir: str | None, ray_overrides: dict | None = None, priced: bool = False) -> Plan:
    """Task + recipe + the provider's choices -> the plan every node runs.

    `networks` are the presets the provider offers (beyond the generic ones);
    `checkpoint_dir` is the provider's default when the task names none;
    `ray_overrides` lets a provider move ports (local, SkyPilot);
    `priced`: the provider fills in the cluster's price itself at launch (RunPod's catalog)."""
    check_contract_env(task, contract, provider)
    check_budget(task, provider, priced)
    checkpoint_dir = task.checkpoints.path or checkpoint_dir
    wandb = wandb_options(task)
    shape = shape_of(task, checkpoint_dir=checkpoint_dir, resume=task.checkpoints.resume == "auto",
                     node_silence_s=task.wait.node_silence, wandb=wandb)
    out = task.job.build(shape)

    services = list(out.services) + list(task.services) + task.group_services()
    names = [s.name for s in services]
    if len(set(names)) != len(names):
        raise BadInput(f"services: a service name is also used by the {task.job.recipe} recipe: {names}")

    check_group_addrs(task, out.entrypoint, out.mode)

    if out.mode == "every_node" and task.job.submit == "client":
        raise BadInput(f"job.submit: the {task.job.recipe} recipe runs its command on every node without Ray, "
                       f"so there is nothing to submit from a client; use submit: head")

    presets = {**GENERIC_NETWORKS, **networks}
    if task.network not in presets:
        raise BadInput(f"network: {task.network!r} is not a network of the {provider} provider "
                       f"(choose one of: {', '.join(presets)})")

    ray = RayPlan(
        port=task.ray.port,
        dashboard_port=task.ray.dashboard_port,
        dashboard_host="{node_addr}" if task.ray.dashboard_public else "127.0.0.1",
        client_server_port=task.ray.client_server_port,
        ready_port=task.ray.ready_port,
        agent_listen_port=52365,
        auth=task.ray.auth,
        debug=task.ray.debug,
        object_store_memory=size_bytes(task.ray.object_store_memory) if task.ray.object_store_memory else None,
        num_cpus=task.resources.cpus,
        num_gpus=task.resources.gpus_per_node if task.resources.gpus else None,
    ).model_copy(update=ray_overrides or {})
    job = task.job
    model, weight_bytes = model_weights(getattr(job, "args", None))
    hub = hub_plan(task, list(dict.fromkeys(out.models + list(task.models))), out.hub_reads)
    working_dir = None
    if out.mode == "ray" and job.working_dir:
        working_dir = workdir.resolve(job.working_dir, task.base_dir)
        workdir.require_dir(working_dir, job.working_dir)
    if job.runtime_env is not None and out.mode != "ray":
        raise BadInput(f"job.runtime_env: the {job.recipe} recipe runs its command on every node without Ray, so "
                       f"no Ray runtime environment reaches it: install what it needs in setup, set variables under "
                       f"env, or remove job.runtime_env")
    runtime_env = runtimeenv.plan_env(job.runtime_env, task.base_dir, working_dir)
    groups = group_plans(task, out.served_groups)
    resources = task.groups[0].resources if task.groups else task.resources  # the head's
    vendors = {gpu_vendor(g.gpu_name) for g in groups if g.gpus_per_node} if groups else \
        {gpu_vendor(resources.gpu_name)} if resources.gpus_per_node else set()
    vendor = vendors.pop() if len(vendors) == 1 else None
    return Plan(
        name=task.name,
        provider=provider,
        nodes=task.nodes,
        gpus_per_node=resources.gpus_per_node,
        gpu_vendor=vendor,
        groups=groups,
        contract=contract,
        network=task.network,
        network_env=presets[task.network],
        env={**accelerator_env(vendor), **out.env,
             **(wandb.env() if wandb else {}), **({OFFLINE_ENV: "1"} if hub and hub.offline else {}), **task.env},
        secrets=list(task.secrets),
        token_env=TOKEN_ENV if task.ray.auth == "token" and out.mode == "ray" else None,
        setup=list(task.setup) + out.setup,
        prepare=out.prepare + list(task.prepare),
        services=services,
        ray=ray,
        wait=WaitPlan(head_s=task.wait.head, nodes_s=task.wait.nodes, node_loss_s=task.wait.node_loss,
                      node_silence_s=task.wait.node_silence),
        checkpoint_dir=checkpoint_dir,
        preflight=PreflightPlan(enabled=task.preflight.enabled, timeout_s=task.preflight.timeout,
                                min_bandwidth_bits=task.preflight.min_bandwidth_bits,
                                torch=out.uses_torch if task.preflight.torch is None else task.preflight.torch,
                                model=model,
                                weight_bytes=weight_bytes),
        job=JobPlan(
            recipe=job.recipe,
            mode=out.mode,
            submit=job.submit,
            entrypoint=out.entrypoint,
            wandb_args=out.wandb_args,
            working_dir=working_dir,  # absolute: each provider writes it as its own files resolve it
            excludes=DEFAULT_EXCLUDES + out.excludes + list(job.excludes)
            + (list(job.runtime_env.excludes) if job.runtime_env else []),
            runtime_env=runtime_env,
            timeout_s=job.timeout,
            summary=out.summary,
            max_restarts=job.max_restarts,
            stall_timeout_s=job.stall_timeout,
        ),
        placement=task.placement,
        resources=resources,
        image=task.image,
        resume=task.checkpoints.resume == "auto",
        checkpoint_files=out.checkpoint_files if checkpoint_dir else [],
        checkpoint_shared=task.checkpoints.shared.get(provider),
        modules=out.modules,
        open_files=job.open_files if job.open_files is not None else out.open_files,
        node_inputs=out.node_inputs,
        hub=hub,
        budget=BudgetPlan(price_per_hour=task.price_per_hour, max_cost=task.placement.max_cost,
                          max_duration_s=task.placement.max_duration, stop_grace_s=task.placement.stop_grace,
                          idle_s=task.placement.idle, training=task.name),
    )
