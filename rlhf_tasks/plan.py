"""The cluster plan: the resolved, provider-neutral description of what every node
does. Plain JSON data, because it travels to the nodes, where the node agent (standard
library only) reads it. Built from the task and the recipe; never edited by hand."""

from __future__ import annotations

import json
import re

from .errors import BadInput
from .recipes.base import Shape, parse_duration
from .spec import Task

PLAN_VERSION = 1
TOKEN_ENV = "RAY_AUTH_TOKEN"

#: Kept out of every uploaded working_dir: VCS data, run artifacts, weights, data.
DEFAULT_EXCLUDES = [
    ".git", ".venv", "runs/", "checkpoints/", "data/", "wandb/", "__pycache__",
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.parquet", "*.arrow",
]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def size_bytes(text: str) -> int:
    number, unit = re.match(r"^([\d.]+)\s*([A-Za-z]*)$", text.strip()).groups()
    return int(float(number) * _UNITS[unit.lower()])


def _service(raw: dict) -> dict:
    ready = raw.get("ready")
    if ready is not None and "http" in ready:
        ready = {"kind": "http", "url": ready["http"], "method": ready.get("method", "GET"), "json": ready.get("json")}
    elif ready is not None:
        ready = {"kind": "tcp", "host": ready.get("host", "{node_addr}"), "port": ready["tcp"]}
    return {"name": raw["name"], "where": raw.get("where", "head"), "command": raw["command"],
            "ready": ready, "timeout_s": parse_duration(raw.get("timeout", "10m")), "env": raw.get("env", {})}


def build_plan(task: Task, provider: str, checkpoint_dir: str | None, ray_overrides: dict | None = None) -> dict:
    """Task + recipe + the provider's choices -> the plan every node runs.

    `checkpoint_dir` is the task's path, or the provider's default when the task
    gives none. `ray_overrides` lets a provider move ports (local, SkyPilot).
    """
    checkpoint_dir = task.checkpoints.path or checkpoint_dir
    shape = Shape(nodes=task.nodes, gpus_per_node=task.resources.gpus_per_node, gpu_name=task.resources.gpu_name,
                  checkpoint_dir=checkpoint_dir, resume=task.checkpoints.resume == "auto")
    out = task.job.build(shape)

    services = [_service(s) for s in out.services]
    services += [_service(s.model_dump(by_alias=True, exclude_none=True)) for s in task.services]
    names = [s["name"] for s in services]
    if len(set(names)) != len(names):
        raise BadInput(f"services: a service name is also used by the {task.job.recipe} recipe: {names}")

    ray = {
        "port": task.ray.port,
        "dashboard_port": task.ray.dashboard_port,
        "dashboard_host": "{node_addr}" if task.ray.dashboard_public else "127.0.0.1",
        "client_server_port": task.ray.client_server_port,
        "ready_port": task.ray.ready_port,
        "agent_listen_port": 52365,
        "auth": task.ray.auth,
        "debug": task.ray.debug,
        "object_store_memory": size_bytes(task.ray.object_store_memory) if task.ray.object_store_memory else None,
        "num_cpus": task.resources.cpus,
        "num_gpus": task.resources.gpus_per_node if task.resources.gpus else None,
        "temp_dir": None,
    }
    ray.update(ray_overrides or {})
    job = task.job
    return {
        "version": PLAN_VERSION,
        "name": task.name,
        "provider": provider,
        "nodes": task.nodes,
        "gpus_per_node": task.resources.gpus_per_node,
        "env": {**out.env, **task.env},
        "secrets": list(task.secrets),
        "token_env": TOKEN_ENV if task.ray.auth == "token" else None,
        "setup": list(task.setup),
        "prepare": out.prepare + list(task.prepare),
        "services": services,
        "network": task.network,
        "ray": ray,
        "wait": {"head_s": parse_duration(task.wait.head), "nodes_s": parse_duration(task.wait.nodes)},
        "checkpoint_dir": checkpoint_dir,
        "job": {
            "recipe": job.recipe,
            "submit": job.submit,
            "entrypoint": out.entrypoint,
            "wandb_args": out.wandb_args,
            "working_dir": job.working_dir,
            "excludes": DEFAULT_EXCLUDES + out.excludes + list(job.excludes),
            "timeout_s": parse_duration(job.timeout) if job.timeout else None,
            "summary": out.summary,
        },
        # What the provider needs to place the nodes (render reads these; the agent does not).
        "placement": task.placement.model_dump(),
        "resources": task.resources.model_dump(exclude_none=True),
        "image": task.image,
        "checkpoint_volume": task.checkpoints.volume,
    }


def plan_json(plan: dict) -> str:
    return json.dumps(plan, indent=2, sort_keys=False) + "\n"
