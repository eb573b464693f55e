"""The task file: what a user writes, parsed into strict pydantic models.

Provider-neutral, and imports no provider: the parts a provider owns (`placement.slurm`,
`checkpoints.shared.<provider>`) are mappings here, which the provider reads with its own
model through `provider_part`. Every error names the field path (`services[0].ready.http`,
`placement.slurm.partition`) and is raised as BadInput (exit 2) before anything is launched.

The grammar of `resources.gpus` is gpu_spec.py's, the providers' too; whether a field holds a secret's
value is secret_detection.py's, which runtimeenv.py asks as well.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import (BaseModel, BeforeValidator, Field, PrivateAttr, ValidationError, ValidationInfo, WithJsonSchema,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from .errors import BadInput
from .field_errors import error_message
from .gpu_spec import gpu_parts
from .models import (LAUNCHER_ENV, NAME_PATTERN, SIZE_PATTERN, Duration, Service, Size, StrictModel, WandbOptions,
                     bandwidth_bits, did_you_mean, group_where, require_absolute, size_bytes)
from .recipes import JOB_MODELS
from .registry import names as provider_names
from .secret_detection import ENV_MAPPINGS, secret_look, written_secrets

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: A Hugging Face Hub repository id (huggingface_hub/utils/_validators.py, validate_repo_id: at most one '/',
#: 96 characters, no '--' or '..').
_HUB_NAME = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")

#: Ray's smallest object store: `ray start` refuses less (ray/_private/ray_constants.py).
OBJECT_STORE_MINIMUM = 75 * 2**20
#: Amounts a task gives per node (cpus, memory, disk) that a provider may read as "at least" or "exactly".
AMOUNTS = ("cpus", "memory", "disk")
_AT_LEAST = re.compile(r"^\s*(?P<value>\S.*?)\s*(?:\.\.|\+)\s*$")
_AMOUNT_WORDS = ("write N (at least N), or N.. / N+ (the same); list the field under resources.exact for exactly N "
                 "(a range N..M is not supported)")


def _at_least(value: Any) -> Any:
    """`28..`, `28+`, `500GB..` (dstack's and SkyPilot's ways to say "at least") -> the amount itself:
    every amount is a minimum unless the field is listed under resources.exact."""
    if isinstance(value, str):
        match = _AT_LEAST.match(value)
        if match:
            return match.group("value")
        if ".." in value:
            raise ValueError(f"{value!r} is not an amount: {_AMOUNT_WORDS}")
    return value


def _cpu_count(value: Any) -> Any:
    value = _at_least(value)
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise ValueError(f"{value!r} is not a CPU count: {_AMOUNT_WORDS}")
        return int(value)
    return value


_AMOUNT_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": r"^\s*\d+\s*(\.\.|\+)?\s*$"}]}
CpuCount = Annotated[int, BeforeValidator(_cpu_count), WithJsonSchema(_AMOUNT_SCHEMA)]
#: A size as written (`500GB`), or with `..` / `+` (at least, as without); the field holds the size.
AmountSize = Annotated[Size, BeforeValidator(_at_least), WithJsonSchema(
    {"type": "string", "pattern": SIZE_PATTERN.removesuffix(r"\s*$") + r"\s*(\.\.|\+)?\s*$"})]


class Resources(StrictModel):
    gpus: str | None = Field(None, description=(
        "per node: NAME:COUNT (H100:8), NAME (one GPU), COUNT, or by each GPU's memory as dstack writes it: "
        "MEMORY:COUNT (80GB:8), NAME:MEMORY:COUNT (A100:80GB:8), a range (24GB..:1, 24GB..48GB:1)"))
    cpus: CpuCount | None = Field(None, ge=1, description=(
        "CPUs per node to register with Ray; at least this many (28, 28.. or 28+) unless listed under exact"))
    memory: AmountSize | None = Field(None, description="memory per node, at least this much (200GB, 200GB..) "
                                      "unless listed under exact")
    shm_size: Size | None = None
    disk: AmountSize | None = Field(None, description="disk per node, at least this much (500GB, 500GB..) unless "
                                    "listed under exact")
    exact: list[Literal[AMOUNTS]] = Field([], description=(  # type: ignore[valid-type]
        "amounts (cpus, memory, disk) meant exactly, not at least: e.g. [disk] with disk: 500GB asks a 500GB disk "
        "(dstack: `disk: 500GB` instead of `500GB..`; SkyPilot: `cpus: 8` instead of `8+`)"))

    @model_validator(mode="before")
    @classmethod
    def _exact_or_at_least(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("exact"), list):
            for field in data["exact"]:
                value = data.get(field) if field in AMOUNTS else None
                if isinstance(value, str) and _AT_LEAST.match(value):
                    raise ValueError(f"{field}: {value!r} says at least, and exact lists {field}: say one")
        return data

    @model_validator(mode="after")
    def _exact_amounts(self):
        missing = [field for field in self.exact if getattr(self, field) is None]
        if missing:
            raise ValueError(f"exact lists {', '.join(missing)}, which the task does not give")
        return self

    def is_exact(self, field: str) -> bool:
        """Whether the task means this amount exactly (resources.exact), not as a minimum."""
        return field in self.exact

    @field_validator("gpus")
    @classmethod
    def _gpu_spec(cls, value):
        if value is None:
            return value
        gpu_parts(str(value))  # ValueError in the task's words
        return str(value)

    @property
    def gpu_name(self) -> str | None:
        return gpu_parts(self.gpus)[0] if self.gpus else None

    @property
    def gpu_memory(self) -> tuple[int | None, int | None] | None:
        """The memory of each GPU in bytes, (at least, at most: None where open), as `80GB` (both 80GB)
        or `24GB..` says; None where the task names no memory."""
        return gpu_parts(self.gpus)[1] if self.gpus else None

    @property
    def gpus_per_node(self) -> int:
        return gpu_parts(self.gpus)[2] if self.gpus else 0


def _off_on_words(value: Any) -> Any:
    """`off` / `on` unquoted, which YAML 1.1 reads as false / true, stand for the words."""
    return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value


def _words(*words: str) -> Any:
    """A choice of words where YAML's booleans off/on read as those words."""
    return Annotated[Literal[words], BeforeValidator(_off_on_words)]


class RayConfig(StrictModel):
    port: int = Field(6379, ge=1024, le=65535)
    dashboard_port: int = Field(8265, ge=1024, le=65535)
    client_server_port: int = Field(10001, ge=1024, le=65535)
    ready_port: int = Field(6390, ge=1024, le=65535, description="the head agent's ready beacon: workers join when it answers")
    dashboard_public: bool = Field(False, description="bind the dashboard to the private address instead of 127.0.0.1")
    auth: Literal["token", "none"] = "token"
    debug: _words("off", "legacy", "post_mortem") = "off"
    object_store_memory: Size | None = Field(None, description=(
        "each node's Ray object store (ray start --object-store-memory), at least 75MiB, Ray's minimum"))

    @field_validator("object_store_memory")
    @classmethod
    def _object_store(cls, value):
        """`ray start` refuses a smaller one on every node (ray/_private/services.py, determine_plasma_store_config:
        OBJECT_STORE_MINIMUM_MEMORY_BYTES): refused here, before anything starts."""
        if value is not None and size_bytes(value) < OBJECT_STORE_MINIMUM:
            raise ValueError(f"{value} is below Ray's minimum object store of 75MiB ({OBJECT_STORE_MINIMUM / 10**6:g}MB)")
        return value

    @model_validator(mode="after")
    def _ports(self):
        ports = {"port": self.port, "dashboard_port": self.dashboard_port, "client_server_port": self.client_server_port,
                 "ready_port": self.ready_port}
        for field, port in ports.items():
            if 10002 <= port <= 19999 and field != "client_server_port":
                raise ValueError(f"{field} {port} is inside Ray's worker port range 10002-19999")
        if len(set(ports.values())) != len(ports):
            raise ValueError(f"ports must differ: {ports}")
        return self


class Checkpoints(StrictModel):
    path: str | None = Field(None, description="absolute; the provider picks one when omitted")
    resume: Literal["auto", "never"] = "auto"
    shared: dict[str, dict[str, Any]] = Field({}, description=(
        "storage mounted at path that every node (and a later run) sees, per provider: "
        "dstack: {volume: NAME} (for several nodes on runpod only: placement.backends) or {host_path: /PATH} "
        "(a directory every fleet host mounts, e.g. NFS); "
        "sky: {bucket: s3://BUCKET/PREFIX} or {volume: NAME}; runpod: {network_volume: ID}; "
        "kuberay: {claim: PVC} (a ReadWriteMany PersistentVolumeClaim). "
        "Each provider checks its own entry; without one, path is a directory on each node"))

    _absolute = field_validator("path")(classmethod(lambda cls, v: require_absolute(
        v, "relative paths resolve inside Ray's working_dir copy")))

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        if isinstance(data, dict) and "volume" in data:
            raise ValueError(f"volume has moved: write shared: {{dstack: {{volume: {data['volume']}}}}}")
        return data

    @field_validator("shared")
    @classmethod
    def _providers(cls, value):
        known = provider_names()  # read when a task names one: plugins count
        for key in value:
            if key not in known:
                raise ValueError(f"{key!r} is not a provider {did_you_mean(key, known)}")
        return value


class Wait(StrictModel):
    head: Duration = Field(1800.0, description="how long workers wait for the head (it runs setup and prepare first)")
    nodes: Duration = Field(1200.0, description="how long the head waits for every node to join")
    node_loss: Duration = Field(40.0, description="after a failed job, how long the head looks for a node Ray has "
                                "not yet declared dead, before it blames the job itself")
    node_silence: Duration = Field(30.0, ge=6.0, le=86400.0, description=(
        "a node that stops answering (a reclaimed machine: its connections are not closed) is declared dead "
        "within this long: the head sets Ray's health checks from it, and tiny-grpo's collective timeout is "
        "max(this, 60s); the job then restarts on the nodes there are, a replacement's address may differ"))


def _bandwidth_text(value: Any) -> Any:
    bandwidth_bits(value)  # validates; kept as written
    return value


class Preflight(StrictModel):
    """The checks the head runs across every node once they are ALIVE and before the job's
    command starts: versions, the collective network interface of each node, a Gloo
    all_reduce (NCCL too where there are GPUs) and the bandwidth of every pair of nodes."""

    enabled: bool = Field(True, description="false (or `preflight: off`) skips the checks")
    timeout: Duration = Field(120.0, description="deadline for the checks, from when every node is ALIVE; a node "
                              "that does not answer by then is named and the job's command is not started")
    torch: bool | None = Field(None, description="check torch on every node and run a Gloo (and NCCL) all_reduce; "
                               "default: when the recipe's job uses torch (every recipe but `command`)")
    min_bandwidth: Annotated[str, BeforeValidator(_bandwidth_text)] = Field(
        "1Gbit", description="below this (per pair of nodes, and the all_reduce's bus bandwidth) "
        "preflight warns; it never fails on bandwidth")

    @property
    def min_bandwidth_bits(self) -> float:
        return bandwidth_bits(self.min_bandwidth)


def _preflight_shorthand(value: Any) -> Any:
    """`preflight: off` / `on` (YAML reads them as booleans) stand for {enabled: false/true}."""
    if isinstance(value, bool):
        return {"enabled": value}
    if isinstance(value, str) and value.lower() in ("on", "off", "true", "false"):
        return {"enabled": value.lower() in ("on", "true")}
    return value


PreflightField = Annotated[Preflight, BeforeValidator(_preflight_shorthand), WithJsonSchema({"anyOf": [
    {"type": "boolean"}, {"enum": ["on", "off"]}, Preflight.model_json_schema()]})]


def _never(value: Any) -> Any:
    """`idle: never` (or off) stands for no idle limit."""
    return None if isinstance(value, str) and value.strip().lower() in ("never", "off") else value


IdleDuration = Annotated[Union[Duration, None], BeforeValidator(_never), WithJsonSchema({"anyOf": [
    {"type": "number"}, {"type": "string"}], "description": "a duration (90s, 15m, 1h) or never"})]


class RetryOptions(StrictModel):
    """`placement.retry: {errors: N}`: the provider's relaunches after no capacity and an interruption, and
    after the job's own failure too, at most `errors` times (a bad flag or an OOM fails every attempt alike)."""

    errors: int = Field(0, ge=0, le=10, description=(
        "also relaunch the run after the job itself failed, at most this many times (0: never)"))


class Placement(StrictModel):
    """Where and how the provider may place the nodes (used by the providers that have it)."""

    spot: _words("off", "on", "auto") = Field("off", description="spot instances: off, on, or auto (spot when available)")
    max_duration: Duration | None = Field(None, description=(
        "the longest the cluster may run: the head agent stops the job at it (SIGTERM, placement.stop_grace to "
        "checkpoint) and the cluster ends"))
    max_cost: float | None = Field(None, gt=0, description=(
        "US dollars the whole run may cost: the head agent stops the job at it, as at max_duration, at the price the "
        "provider gives (RunPod's billed pod cost, dstack's run plan and SkyPilot's optimizer at launch), elsewhere "
        "placement.price_per_hour"))
    price_per_hour: float | None = Field(None, ge=0, description=(
        "US dollars per hour for the whole cluster (every node together), for max_cost and the cost shown while "
        "following; dstack and SkyPilot hear it as their bound on each instance's price (max_price, "
        "max_hourly_cost: this split over the nodes); RunPod ignores it (its billed pod cost is counted)"))
    stop_grace: Duration = Field(120.0, description=(
        "at max_cost or max_duration, how long the job's driver has after SIGTERM to checkpoint before the "
        "cluster ends"))
    idle: IdleDuration = Field(3600.0, description=(
        "a cluster kept up after its run (launch --keep, or submit: client) ends itself after this long without "
        "a running job; `never` keeps it until `rlhf-tasks down`"))
    retry: Union[bool, RetryOptions] = Field(False, description=(
        "let the provider relaunch the run after an interruption or no capacity (true), and after the job's own "
        "failure at most N times ({errors: N}); every attempt counts against one max_cost and max_duration"))
    fleets: list[str] = Field([], description="named pools of machines to run on, where the provider has them")
    backends: list[str] = Field([], description="clouds or backends the provider may use")
    regions: list[str] = []
    wandb: WandbOptions | None = Field(None, description="W&B entity, project, group and tags of the run (job.wandb "
                                       "overrides them field by field); logging is on when WANDB_API_KEY is a secret")
    slurm: dict[str, Any] = Field({}, description=(
        "Slurm's own options, read by the slurm provider with its model (providers/slurm/placement.py): partition, "
        "account, qos, constraint, reservation, gres, container (pyxis, docker, podman), mounts"))
    dstack: dict[str, Any] = Field({}, description=(
        "dstack's own options, read by the dstack provider with its model (providers/dstack/options.py): ssh "
        "(the fleet is your own hosts: user, identity_file, hosts), and for a custom image its user, cpu_arch and "
        "registry_auth (a dstack secret's name)"))
    kuberay: dict[str, Any] = Field({}, description=(
        "Kubernetes' own options, read by the kuberay provider with its model (providers/kuberay/options.py): "
        "namespace, service_account, node_selector, tolerations, priority_class, scheduler and queue, secret, "
        "ray_version"))

    @property
    def retry_errors(self) -> int:
        """How often the provider may relaunch the run after the job's own failure (placement.retry.errors)."""
        return self.retry.errors if isinstance(self.retry, RetryOptions) else 0


#: Keys of `placement` whose options a provider owns and reads with its own model (spec.py imports
#: no provider; `rlhf-tasks schema` composes the providers' models into the schema).
PROVIDER_PLACEMENT = ("slurm", "kuberay", "dstack")


Job = Annotated[Union[JOB_MODELS], Field(discriminator="recipe")]  # type: ignore[valid-type]

#: Ray's own resource names besides CPU and GPU: a group named so would fight them (`ray start --resources`).
RAY_RESOURCE_NAMES = ("memory", "object_store_memory")


class GroupPlacement(StrictModel):
    """A group's own options of the providers that read theirs with their own model (PROVIDER_PLACEMENT): each
    provider reads the task's placement.<provider> with the group's keys over it."""

    slurm: dict[str, Any] = {}
    kuberay: dict[str, Any] = {}
    dstack: dict[str, Any] = {}


class Group(StrictModel):
    """A role's machines (issue 46): the trainer on H100s, a reward model on cheaper GPUs, a retriever on
    CPUs. Its nodes start Ray with the label `rlhf-tasks/group=NAME` and the custom resources NAME (and its
    GPU type, lowercased), as OpenRLHF's Slurm guide's `ray start --resources '{"v100": 8}'`."""

    name: str = Field(pattern=NAME_PATTERN, description="lowercase letters, digits and dashes; unique in the task")
    nodes: int = Field(1, ge=1, le=1024)
    resources: Resources = Resources()
    image: str | None = Field(None, description="this group's image, instead of the task's")
    setup: list[str] = Field([], description="run on this group's nodes after the task's setup")
    services: list[Service] = Field([], description="started on this group's nodes (as `where: group NAME`)")
    price_per_hour: float | None = Field(None, ge=0, description=(
        "US dollars per hour for each node of this group, as a cloud lists a machine's price: the cluster's price "
        "is the groups' sum (instead of placement.price_per_hour), which max_cost counts; give every group's or "
        "none"))
    placement: GroupPlacement = Field(GroupPlacement(), description=(
        "this group's provider options, key by key over the task's placement.<provider> (e.g. kuberay: "
        "{node_selector: ...} for its GPU type's nodes)"))


def _groups_placeholder(data: Any) -> Any:
    """Before a task with groups is read: top-level `nodes` or `resources` refused (each group gives its own),
    and `nodes` filled with a placeholder the groups' sum replaces once they are read (Task._groups)."""
    if not (isinstance(data, dict) and data.get("groups")):
        return data
    written = [field for field in ("nodes", "resources") if field in data]
    if written:
        raise PydanticCustomError("task_entry", "a task with groups gives each group its nodes and resources; remove "
                                  + " and ".join(f"the top-level `{field}`" for field in written), {"field": "groups"})
    return {**data, "nodes": 1}


class Task(StrictModel):
    _source: str = PrivateAttr("<task>")
    #: The directory of the task file (load_task), against which a relative job.working_dir resolves, as
    #: dstack, SkyPilot and docker compose resolve the paths of their files; None (a task given as data):
    #: the current directory.
    _base_dir: str | None = PrivateAttr(None)

    name: str = Field(pattern=NAME_PATTERN, description="lowercase letters, digits and dashes")
    nodes: int = Field(ge=1, le=1024, description="the node count; with groups, their sum (the task writes none)")
    resources: Resources = Resources()
    groups: list[Group] = Field([], description=(
        "node groups, each its own nodes and resources (instead of top-level nodes and resources): the first holds "
        "rank 0, the head; local, dstack, kuberay, slurm and runpod run them; sky refuses them at check"))
    image: str | None = None
    env_not_secret: list[str] = Field([], description=(
        "names under env that only look like secrets (by their name, e.g. MAX_NEW_TOKEN, or by their value's "
        "format): their values stay under env, written into the rendered files"))
    env: dict[str, str] = Field({}, description=(
        "variables set on every node, written into the rendered files: no secrets here (list those under "
        "secrets); the launcher's own (RAY_AUTH_TOKEN, RAY_AUTH_MODE) and the provider's are refused"))
    secrets: list[str] = Field([], description="names of environment variables taken from the launcher's environment")
    setup: list[str] = []
    prepare: list[str] = []
    models: list[str] = Field([], description=(
        "Hugging Face Hub models (org/name) the job loads besides those its recipe names (policy, reward, "
        "reference, a retriever's encoder): all fetched once before the head starts, into the cache on the "
        "task's shared storage (HF_HOME), then the job runs with HF_HUB_OFFLINE=1"))
    services: list[Service] = []
    network: str = Field("auto", pattern=NAME_PATTERN,
                         description="network preset: auto, ethernet, infiniband, or one the provider offers")
    ray: RayConfig = RayConfig()
    checkpoints: Checkpoints = Checkpoints()
    wait: Wait = Wait()
    placement: Placement = Placement()
    preflight: PreflightField = Preflight()
    job: Job

    @model_validator(mode="before")
    @classmethod
    def _groups_give_nodes(cls, data: Any) -> Any:
        return _groups_placeholder(data)

    @property
    def source(self) -> str:
        """The task file it came from, for error messages."""
        return self._source

    @property
    def base_dir(self) -> str:
        """Where a relative job.working_dir is: the task file's directory, or the current one."""
        return self._base_dir or os.getcwd()

    @field_validator("env")
    @classmethod
    def _env_names(cls, value, info: ValidationInfo):
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        owned = [key for key in value if key in LAUNCHER_ENV]
        if owned:
            raise _entry_error("env", owned, "the launcher sets it on every node itself (each cluster gets its own "
                               "token, and the auth mode of ray.auth); remove it")
        not_secret = set(info.data.get("env_not_secret") or ())  # validated before env: declared before it
        looks = {key: secret_look(key, text) for key, text in value.items() if key not in not_secret}
        secret = [key for key, why in looks.items() if why]
        if secret:
            first = secret[0]
            raise _entry_error("env", secret, f"{looks[first]}, and a secret's value must not be in the task file "
                               f"(env is written into every rendered file): list the name under "
                               f"`secrets: [{first}]` and export it where you launch. If it is not a secret, "
                               f"keep it under env and add `env_not_secret: [{first}]` to the task")
        return value

    @field_validator("env_not_secret")
    @classmethod
    def _not_secret_names(cls, value):
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value):
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name (secrets are listed by name only)")
            if key in LAUNCHER_ENV:
                raise ValueError(f"{key}: the launcher passes it to every node itself; remove it")
        if len(set(value)) != len(value):
            raise ValueError("secrets are listed twice")
        return value

    @field_validator("models")
    @classmethod
    def _hub_names(cls, value):
        for index, name in enumerate(value):
            if not _HUB_NAME.match(name) or "--" in name or ".." in name:
                raise PydanticCustomError("task_entry", f"{name!r} is not a Hugging Face Hub model's name (org/name "
                                          f"or name: letters, digits, '-', '_', '.'; no '--' or '..'); a model on "
                                          f"disk needs no fetching: leave it out", {"field": f"models[{index}]"})
        if len(set(value)) != len(value):
            raise ValueError("a model is listed twice")
        return value

    @field_validator("services")
    @classmethod
    def _unique_services(cls, value):
        names = [s.name for s in value]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate service names {duplicates}")
        return value

    @model_validator(mode="after")
    def _groups(self):
        """The groups' names unique, the node count their sum, and every `where: group NAME` one of them."""
        names = [group.name for group in self.groups]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise PydanticCustomError("task_entry", f"{name!r} names two groups; each group needs its own name",
                                          {"field": f"groups[{index}].name"})
            if name in RAY_RESOURCE_NAMES:
                raise PydanticCustomError("task_entry", f"{name!r} is one of Ray's own resources, which the group's "
                                          f"custom resource would fight: choose another name",
                                          {"field": f"groups[{index}].name"})
            types = {(g.resources.gpu_name or "").lower(): g.name for g in self.groups if g.name != name}
            if name in types:
                raise PydanticCustomError("task_entry", f"{name!r} is also the GPU type of group {types[name]}, whose "
                                          f"nodes carry a Ray resource of that name: choose another name",
                                          {"field": f"groups[{index}].name"})
        if self.groups:
            total = sum(group.nodes for group in self.groups)
            if total > 1024:
                raise PydanticCustomError("task_entry", f"the groups have {total} nodes together; at most 1024",
                                          {"field": "groups"})
            object.__setattr__(self, "nodes", total)  # frozen: set once, here, from the groups
            self._group_prices()
        known = ", ".join(names)
        for index, service in enumerate(self.services):
            group = group_where(service.where)
            if group is not None and group not in names:
                why = (f"the task has no group {group!r} (its groups: {known})" if names else
                       f"the task has no groups; `group {group}` needs one named {group} under groups:")
                raise PydanticCustomError("task_entry", why, {"field": f"services[{index}].where"})
        seen = [s.name for s in self.services]
        for g_index, group in enumerate(self.groups):
            for s_index, service in enumerate(group.services):
                field = f"groups[{g_index}].services[{s_index}]"
                if "where" in service.model_fields_set and service.where != f"group {group.name}":
                    raise PydanticCustomError("task_entry", f"a group's service runs on its group's nodes (group "
                                              f"{group.name}); remove `where: {service.where}`, or move the service "
                                              f"to the task's services", {"field": f"{field}.where"})
                if service.name in seen:
                    raise PydanticCustomError("task_entry", f"{service.name!r}: another service of the task has "
                                              f"this name (services are named once, in the task's services and "
                                              f"every group's)", {"field": f"{field}.name"})
                seen.append(service.name)
        return self

    def _group_prices(self) -> None:
        """Every group's price or none (a cap counted from some groups would undercount the cluster), and not
        beside placement.price_per_hour, which their sum replaces."""
        unpriced = [i for i, group in enumerate(self.groups) if group.price_per_hour is None]
        if len(unpriced) == len(self.groups):
            return
        if unpriced:
            i = unpriced[0]
            raise PydanticCustomError("task_entry", f"group {self.groups[i].name} has no price per node, and "
                                      f"another group has one: give every group's (the cluster's price is their "
                                      f"sum, which placement.max_cost counts) or none", {"field": f"groups[{i}].price_per_hour"})
        if self.placement.price_per_hour is not None:
            raise PydanticCustomError("task_entry", "the groups give their prices per node (groups[i].price_per_hour) "
                                      "and the cluster's is their sum: remove placement.price_per_hour",
                                      {"field": "placement.price_per_hour"})

    @property
    def price_per_hour(self) -> float | None:
        """US dollars per hour for the whole cluster as the task gives it: placement.price_per_hour, or the sum
        of its groups' prices per node (as plan.Plan.task_price); None where it gives none."""
        if self.groups and self.groups[0].price_per_hour is not None:
            return sum(group.nodes * group.price_per_hour for group in self.groups)
        return self.placement.price_per_hour

    def group_services(self) -> list[Service]:
        """Every group's own services, each with `where: group NAME`."""
        return [service.model_copy(update={"where": f"group {group.name}"})
                for group in self.groups for service in group.services]

    @model_validator(mode="after")
    def _cross_checks(self):
        clash = sorted(set(self.env) & set(self.secrets))
        if clash:
            raise _entry_error("env", clash, "also under secrets: a secret's value must not be in the task file")
        service_env = {key for service in self.services for key in service.env} | set(
            self.job.runtime_env.env_vars if self.job.runtime_env else ())
        stray = [key for key in self.env_not_secret if key not in self.env and key not in service_env]
        if stray:
            raise _entry_error("env_not_secret", stray, "not under env (env_not_secret only lets a name under env, "
                               "a service's env or job.runtime_env.env_vars that looks like a secret stay there)")
        self._no_written_secrets()
        return self

    def _no_written_secrets(self) -> None:
        """The checks of `env` over every other string the task writes: setup, prepare, services (command,
        readiness, env), every recipe argument, placement and checkpoints. They are all written into the
        rendered files and the plan the nodes read, so a secret's value there is as public as under env."""
        data = self.model_dump(by_alias=True, exclude={"env", "env_not_secret", "secrets"})
        not_secret = set(self.env_not_secret)
        found = {path: why for path, why in written_secrets(data).items()
                 if not (ENV_MAPPINGS.match(path.rsplit(".", 1)[0]) and path.rsplit(".", 1)[1] in not_secret)}
        if not found:
            return
        paths = list(found)
        first, why = paths[0], found[paths[0]]
        also = f" (also: {', '.join(paths[1:])})" if paths[1:] else ""
        if ENV_MAPPINGS.match(first.rsplit(".", 1)[0]):
            name = first.rsplit(".", 1)[1]
            how = (f"list the name under `secrets: [{name}]` (every process on the nodes, services too, gets it) and "
                   f"export it where you launch. If it is not a secret, keep it and add `env_not_secret: [{name}]`")
        else:
            how = ("list the variable that holds it under `secrets: [NAME]`, export it where you launch, and write "
                   "$NAME here instead (the nodes have it in their environment; a value that is no secret goes under "
                   "env, with env_not_secret where its name looks like one)")
        raise PydanticCustomError("task_entry", f"{why}, and a secret's value must not be in the task file (every "
                                  f"field is written into the rendered files and the plan the nodes read): {how}"
                                  + also, {"field": first})


def _entry_error(field: str, keys: list[str], message: str) -> PydanticCustomError:
    """An error about one entry of a mapping or list (`env.WANDB_API_KEY`), named by field_errors.error_message."""
    also = f" (also: {', '.join(f'{field}.{k}' for k in keys[1:])})" if keys[1:] else ""
    return PydanticCustomError("task_entry", message + also, {"field": f"{field}.{keys[0]}"})


def parse_task(data: Any, source: str = "<task>") -> Task:
    """Validate a task mapping; BadInput lists every problem with its field path."""
    if data is None:
        raise BadInput(f"{source}: the file is empty; a task file is a mapping of fields (name, nodes, job, ...)")
    if not isinstance(data, dict):
        what = "a list" if isinstance(data, list) else f"the single value {data!r}"
        raise BadInput(f"{source}: a task file is a mapping of fields (name: ..., nodes: ..., job: ...), not {what}")
    try:
        task = Task.model_validate(data)
        task._source = source
        return task
    except ValidationError as exc:
        lines = ["  " + ": ".join(part for part in error_message(err, Task) if part) for err in exc.errors()]
        raise BadInput(f"{source}: invalid task\n" + "\n".join(dict.fromkeys(lines))) from None


Part = TypeVar("Part", bound=BaseModel)


def provider_part(model: type[Part], data: Any, where: str) -> Part:
    """A part of the task that a provider owns (`placement.slurm`, `checkpoints.shared.sky`),
    read with that provider's own model: the task holds it as a mapping, so spec.py needs no
    provider. BadInput naming each bad field below `where`, e.g. `placement.slurm.partition`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            path, message = error_message(err, model)
            path = where if not path else where + (path if path.startswith("[") else f".{path}")
            problems.append(f"{path}: {message}")
        raise BadInput("; ".join(dict.fromkeys(problems))) from None


def group_part(model: type[Part], placement: Placement, group: Any, index: int, key: str) -> Part:
    """A node group's part of a provider's placement: the group's `placement.<key>` keys over the task's, read
    with the provider's own model (BadInput naming `groups[i].placement.<key>`)."""
    merged = {**getattr(placement, key), **getattr(group.placement, key)}
    return provider_part(model, merged, f"groups[{index}].placement.{key}")


def load_task(path: str | Path) -> Task:
    """Read and validate a task file."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadInput(f"{path}: cannot read task file ({exc.strerror})") from None
    try:
        twice = _key_twice(yaml.compose(text, Loader=yaml.SafeLoader))
        if twice:
            raise BadInput(f"{path}: {twice}")
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML: {exc}") from None
    task = parse_task(data, str(path))
    task._base_dir = str(path.absolute().parent)
    return task


def _key_twice(node: Any, path: str = "", seen_nodes: set | None = None) -> str | None:
    """A key written twice in one mapping of the task file, named by its path and both lines
    (`nodes: 2` then `nodes: 3`: YAML would silently keep 3); None when there is none. A merge
    (`<<: *anchor`) may still be overridden: that is what it is for."""
    import yaml

    seen_nodes = set() if seen_nodes is None else seen_nodes
    if node is None or id(node) in seen_nodes:
        return None
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found = _key_twice(item, f"{path}[{index}]", seen_nodes)
            if found:
                return found
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            here = f"{path}.{key}" if path else str(key)
            if key is not None and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key in lines:
                    return (f"{here}: written twice in one mapping, on line {lines[key]} and line {line} (YAML would "
                            f"silently keep the second); keep one")
                lines[key] = line
            found = _key_twice(value_node, here, seen_nodes)
            if found:
                return found
    return None


def json_schema(placement: dict[str, type[BaseModel]] | None = None) -> dict:
    """JSON Schema of the task file, for editors (yaml-language-server). `placement`: the
    providers' models of the `placement` keys they own (PROVIDER_PLACEMENT), put in place of
    the bare mappings the task itself knows."""
    schema = Task.model_json_schema(by_alias=True)
    schema["title"] = "rlhf-tasks task file"
    # nodes, or groups that give them (never both: Task._groups_give_nodes)
    schema["required"] = [field for field in schema.get("required", []) if field != "nodes"]
    schema["oneOf"] = [{"required": ["nodes"], "not": {"required": ["groups"]}},
                       {"required": ["groups"], "not": {"anyOf": [{"required": ["nodes"]}, {"required": ["resources"]}]}}]
    defs = schema.setdefault("$defs", {})
    for key, model in (placement or {}).items():
        part = model.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
        defs.update(part.pop("$defs", {}))
        defs[model.__name__] = part
        properties = defs["Placement"]["properties"]
        properties[key] = {"$ref": f"#/$defs/{model.__name__}", "default": properties[key].get("default", {}),
                           "description": properties[key].get("description", "")}
    return schema
