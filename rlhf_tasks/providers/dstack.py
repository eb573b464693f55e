"""dstack: one `type: task` configuration with `nodes: N`, applied with `dstack apply`.

dstack starts the same commands on every node and sets DSTACK_NODE_RANK,
DSTACK_MASTER_NODE_IP and DSTACK_NODES_NUM; the node agent reads them. Only job 0's
ports are forwarded by `dstack apply`, which is the head: its dashboard port is the
one port we expose. Secrets and the Ray token are listed as bare names, which the
dstack CLI fills from the local environment at apply time.

Checkpoints go to a directory on each host (`instance_path`) unless the task names shared
storage in `checkpoints.shared.dstack`: a network volume, or a host directory the user
declares shared (an NFS mount on every fleet host).
"""

from __future__ import annotations

import re
import subprocess

from pydantic import Field, field_validator, model_validator

from .. import state
from ..models import StrictModel, require_absolute
from ..plan import Contract, Plan, env
from ..spec import Task
from .base import Cluster, Provider, require_cli, stop_with_cli
from .shipping import agent_command, dump_yaml, node_path, shared_entry, shipped_files

SPOT = {"off": "on-demand", "on": "spot", "auto": "auto"}

#: What we render when the task gives no disk. dstack's own default is `100GB..` (resources.DEFAULT_DISK),
#: which it compares to an offer's disk and, on an SSH fleet, to the host's free disk: a host with less is no
#: offer. 50GB holds the image with Ray and torch and a small model; a task that needs more says `disk:`.
DEFAULT_DISK = "50GB"

#: The fleet's `idle_duration` when the task does not set `placement.idle`: dstack's own default for a run's
#: instances (fleets.py: "Defaults to `5m` for runs and `3d` for fleets"), not the fleet's 3 days.
FLEET_IDLE_S = 300

#: A GPU name with its memory as a suffix (A100-80GB, V100-32G), which dstack's GPUSpec parser takes whole as a
#: name its catalog (gpuhunt's KNOWN_ACCELERATORS) does not know: dstack writes the memory as its own field.
_GPU_MEMORY_SUFFIX = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9._-]*?)[-_](?P<memory>\d+)\s*G(?:i?B)?$", re.IGNORECASE)


def dstack_gpu(gpus: str) -> str:
    """`resources.gpus` in dstack's words: `A100-80GB:8` -> `A100:80GB:8`; `H100:8` and `8` as given; a bare
    name is one GPU (`MI300X` -> `MI300X:1`: dstack reads a bare name as one GPU or more)."""
    if gpus.isdigit():
        return gpus
    name, _, count = gpus.partition(":")
    match = _GPU_MEMORY_SUFFIX.match(name)
    if match:
        name = f"{match.group('name')}:{match.group('memory')}GB"
    return f"{name}:{count or 1}"


def at_least(value) -> str:
    """A task's amount (`cpus: 28`, `disk: 500GB`) is a minimum: dstack reads a bare `cpu: 28` as exactly 28,
    and `28..` as 28 or more."""
    return f"{value}.."


def dstack_resources(res, keys: tuple[str, ...]) -> dict:
    """The resources block for a task or fleet: GPUs in dstack's catalog names, amounts as `N..` ranges."""
    resources: dict = {}
    if "shm_size" in keys and res.shm_size:
        resources["shm_size"] = res.shm_size  # a size dstack gives the container, not an offer filter
    if "memory" in keys and res.memory:
        resources["memory"] = at_least(res.memory)
    resources["disk"] = at_least(res.disk or DEFAULT_DISK)
    if res.gpus:
        resources["gpu"] = dstack_gpu(res.gpus)
    if "cpu" in keys and res.cpus:
        resources["cpu"] = at_least(res.cpus)
    return resources


class DstackShared(StrictModel):
    """`checkpoints.shared.dstack`: storage every node mounts at checkpoints.path."""

    volume: str | None = Field(None, description="a dstack network volume that every node can mount at once")
    host_path: str | None = Field(None, description="a directory on every fleet host that is the same storage "
                                  "on all of them (e.g. an NFS mount): you declare it shared")

    _absolute = field_validator("host_path")(classmethod(lambda cls, v: require_absolute(v, "it is a host path")))

    @model_validator(mode="after")
    def _one(self):
        if (self.volume is None) == (self.host_path is None):
            raise ValueError("give exactly one of volume: NAME or host_path: /PATH")
        return self


class DstackProvider(Provider):
    name = "dstack"
    shared_option = "checkpoints.shared.dstack: {volume: NAME} or {host_path: /PATH}"
    contract = Contract(
        rank=env("DSTACK_NODE_RANK"),
        nodes=env("DSTACK_NODES_NUM"),
        head=env("DSTACK_MASTER_NODE_IP"),
        node_addr=env("DSTACK_NODES_IPS", item="rank"),
        cluster_id=env("DSTACK_RUN_NAME"),
        gpus_per_node=env("DSTACK_GPUS_PER_NODE"),
    )

    def check(self, task: Task) -> None:
        shared_entry(DstackShared, task.checkpoints.shared.get(self.name), self.name)

    def shared_storage_warning(self, plan: Plan) -> str | None:
        """A line for `check` and `render` when a multi-node run resumes from per-host directories."""
        if plan.nodes < 2 or not plan.unshared_checkpoints:
            return None
        return (f"checkpoints {plan.checkpoint_dir} is a directory on each dstack host (instance_path): "
                f"the {plan.nodes} nodes do not share it, and a resumed run may land on other hosts; add "
                f"checkpoints.shared.dstack: {{volume: NAME}} or {{host_path: /PATH}} (a directory every fleet "
                f"host mounts, e.g. NFS)")

    def task_config(self, plan: Plan, files: dict[str, str]) -> dict:
        res, placement = plan.resources, plan.placement
        config: dict = {"type": "task", "name": plan.name, "nodes": plan.nodes}
        if plan.image:
            config["image"] = plan.image
            config["shell"] = "bash"
        env = [f"{k}={v}" for k, v in plan.env.items()] + list(plan.secrets)
        if plan.token_env:
            env.append(plan.token_env)
        if env:
            config["env"] = env
        config["files"] = [f"{local}:{node_path(local)}" for local in files]
        config["commands"] = list(plan.setup) + [agent_command(plan)]
        config["ports"] = [plan.ray.dashboard_port]
        config["resources"] = dstack_resources(res, ("shm_size", "memory", "cpu"))
        ckpt = plan.checkpoint_dir
        if ckpt:
            shared = shared_entry(DstackShared, plan.checkpoint_shared, self.name)
            if shared and shared.volume:
                config["volumes"] = [{"name": shared.volume, "path": ckpt}]
            else:
                config["volumes"] = [{"instance_path": shared.host_path if shared else ckpt, "path": ckpt}]
        config["startup_order"] = "master-first"
        config["stop_criteria"] = "master-done"
        config["spot_policy"] = SPOT[placement.spot]
        if placement.retry:
            config["retry"] = {"on_events": ["no-capacity", "interruption", "error"]}
        if placement.max_duration:
            config["max_duration"] = int(placement.max_duration)  # seconds
        for key in ("fleets", "backends", "regions"):
            if getattr(placement, key):
                config[key] = list(getattr(placement, key))
        return config

    def fleet_config(self, plan: Plan) -> dict:
        """A fleet with `placement: cluster` (nodes on one fast network) that fits the task.

        `nodes: {min: 0, max: N}`: the fleet starts empty, the run provisions its N instances in it, and an
        instance idle for `idle_duration` (placement.idle where the task sets it, `never` rendering `off`; else
        FLEET_IDLE_S) is terminated, since dstack terminates only instances above `nodes.min` (fleets.py,
        idle_duration): nothing is left billing.
        """
        placement = plan.placement
        idle = placement.idle if "idle" in placement.model_fields_set else FLEET_IDLE_S
        fleet: dict = {"type": "fleet", "name": f"{plan.name}-fleet", "nodes": {"min": 0, "max": plan.nodes},
                       "idle_duration": int(idle) if idle else "off", "placement": "cluster"}
        fleet["resources"] = dstack_resources(plan.resources, ())
        fleet["spot_policy"] = SPOT[plan.placement.spot]
        for key in ("backends", "regions"):
            if getattr(plan.placement, key):
                fleet[key] = list(getattr(plan.placement, key))
        return fleet

    def render(self, plan: Plan) -> dict[str, str]:
        files = shipped_files(plan)
        secrets = ", ".join(plan.secrets + ([plan.token_env] if plan.token_env else [])) or "none"
        header = (f"# Rendered by rlhf-tasks for dstack; apply with: dstack apply -f <this file>\n"
                  f"# Values filled from your environment at apply time: {secrets}\n")
        out = {f"{plan.name}.dstack.yml": dump_yaml(self.task_config(plan, files), header),
               f"{plan.name}-fleet.dstack.yml": dump_yaml(self.fleet_config(plan),
                                                         "# Apply once before the task: dstack apply -f <this file>\n")}
        out.update(files)
        return out

    def ready(self, plan: Plan) -> None:
        require_cli("dstack", "dstack")

    def refuses_missing_secrets(self, plan: Plan, missing: list[str]) -> str | None:
        return ("the rendered file names every secret in its env, and `dstack apply` fills each from your "
                "environment and refuses one that is not set (\"Environment variable NAME is not set\")")

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """`dstack apply` attaches and forwards job 0's ports (the head's dashboard) to localhost."""
        dstack = require_cli("dstack", "dstack")
        directory, token, env = self.stage(plan, secrets)
        path = directory / "dstack-apply.log"
        with open(path, "ab") as log:  # an earlier launch's part stays; this one's head log starts at `start`
            start = log.tell()
            proc = subprocess.Popen([dstack, "apply", "-f", str(directory / f"{plan.name}.dstack.yml"), "-y"],
                                    cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

        def head_log() -> str:
            with open(path, "rb") as handle:
                handle.seek(start)
                return handle.read().decode(errors="replace")
        dashboard = f"http://localhost:{plan.ray.dashboard_port}"
        state.save(plan.name, {"provider": self.name, "cluster_id": plan.name, "dashboard": dashboard})
        return Cluster(name=plan.name, cluster_id=plan.name, dashboard=dashboard, token=token,
                       head_alive=lambda: proc.poll() is None, head_log=head_log,
                       describe=lambda: [] if proc.poll() is None else [f"dstack apply exited with code {proc.poll()}"])

    def down(self, name: str) -> str:
        return stop_with_cli([require_cli("dstack", "dstack"), "stop", name, "-y"], name)
