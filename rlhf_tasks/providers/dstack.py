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

import json
import subprocess

from pydantic import Field, field_validator, model_validator

from .. import state
from ..models import StrictModel, require_absolute
from ..plan import Contract, Plan, env
from ..spec import Task
from .base import Cluster, Provider, require_cli, stop_with_cli
from .shipping import WRITTEN_BY, agent_command, dump_yaml, node_path, shared_entry, shipped_files

SPOT = {"off": "on-demand", "on": "spot", "auto": "auto"}


#: How many of dstack's latest runs `ps` looks through for a cluster's run.
PS_RUNS = 100


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
    state_elsewhere = "dstack ps"
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
        resources = {key: getattr(res, key) for key in ("shm_size", "disk", "memory") if getattr(res, key)}
        if res.gpus:
            resources["gpu"] = res.gpus
        if res.cpus:
            resources["cpu"] = res.cpus
        config["resources"] = resources
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
        """A fleet with `placement: cluster` (nodes on one fast network) that fits the task."""
        res = plan.resources
        fleet: dict = {"type": "fleet", "name": f"{plan.name}-fleet", "nodes": plan.nodes, "placement": "cluster"}
        resources = {"disk": res.disk} if res.disk else {}
        if res.gpus:
            resources["gpu"] = res.gpus
        if resources:
            fleet["resources"] = resources
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
                                                         f"# {WRITTEN_BY} for dstack: the fleet {plan.name} runs on. "
                                                         "Apply once before the task: dstack apply -f <this file>\n")}
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

    def state_line(self, name: str) -> str | None:
        """The run's status as `dstack ps --json` gives it (dstack's Run: status, status_message, cost)."""
        from ..errors import StepFailed

        out = subprocess.run([require_cli("dstack", "dstack"), "ps", "--json", "--last", str(PS_RUNS)],
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise StepFailed("asking dstack for its runs (dstack ps)", (out.stderr or out.stdout).strip()[-300:]
                             or f"exit code {out.returncode}")
        runs = [run for run in json.loads(out.stdout).get("runs") or []
                if (run.get("run_spec") or {}).get("run_name") == name]
        if not runs:
            return f"no run named {name} among dstack's last {PS_RUNS} runs"
        run = runs[0]
        message = f" ({run['status_message']})" if run.get("status_message") and \
            run["status_message"] != run.get("status") else ""
        return f"dstack run {name}: {run.get('status')}{message}, ${float(run.get('cost') or 0):.2f} so far (dstack's)"

    def down(self, name: str) -> str:
        return stop_with_cli([require_cli("dstack", "dstack"), "stop", name, "-y"], name)
