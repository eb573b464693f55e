"""local: N nodes on this one machine, the default provider and the demo.

Each node is a node-agent process running the very same code path as on a rented
machine, with its own loopback address (127.0.1.1, 127.0.1.2, ...: Ray rewrites
127.0.0.1 to the machine's public address, but not the rest of 127/8), its own
dashboard agent port, and a small object store. Ports are picked free at launch, so
a local cluster never collides with another Ray on the machine. `down` stops exactly
the processes it started, by process group.
"""

from __future__ import annotations

import os
import secrets as pysecrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .. import state
from ..errors import BadInput
from ..plan import TOKEN_ENV, plan_json
from ..spec import Task
from .base import Cluster, Provider


LOCAL_OBJECT_STORE_BYTES = 200 * 2**20


def node_address(rank: int) -> str:
    return f"127.0.1.{rank + 1}"


def _free_ports(count: int) -> list[int]:
    """Ports free on every address, outside Ray's worker range (10002-19999)."""
    held, ports = [], []
    while len(ports) < count:
        sock = socket.socket()
        sock.bind(("", 0))
        held.append(sock)
        port = sock.getsockname()[1]
        if not 10002 <= port <= 19999:
            ports.append(port)
    for sock in held:
        sock.close()
    return ports


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is not alive
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_has_live_members(pgid: int) -> bool:
    """True when a running (not zombie) process is in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class LocalProvider(Provider):
    name = "local"

    def run_dir(self, name: str) -> Path:
        return Path.cwd() / "runs" / name

    ray_overrides = {"agent_listen_port": 0}  # every node its own dashboard agent port

    def default_checkpoint_dir(self, task: Task) -> str:
        return str(self.run_dir(task.name) / "checkpoints")

    def plan(self, task: Task) -> dict:
        plan = super().plan(task)
        if plan["ray"]["object_store_memory"] is None:  # Ray's default, 30% of RAM, for each of N nodes here
            plan["ray"]["object_store_memory"] = LOCAL_OBJECT_STORE_BYTES
        return plan

    def node_env(self, plan: dict, rank: int, cluster_id: str) -> dict[str, str]:
        """The environment contract of the local provider (what node.py reads)."""
        return {
            "RLHF_TASKS_NODE_RANK": str(rank),
            "RLHF_TASKS_NUM_NODES": str(plan["nodes"]),
            "RLHF_TASKS_HEAD_ADDR": node_address(0),
            "RLHF_TASKS_NODE_ADDR": node_address(rank),
            "RLHF_TASKS_CLUSTER_ID": cluster_id,
        }

    def render(self, plan: dict) -> dict[str, str]:
        lines = ["#!/usr/bin/env bash", "# What `rlhf-tasks launch --provider local` runs: one node agent per node.",
                 f"# Needs ${TOKEN_ENV} in the environment (the launcher makes one per cluster).", "set -euo pipefail"]
        for rank in range(plan["nodes"]):
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.node_env(plan, rank, "CLUSTER_ID").items())
            lines.append(f"{env} python3 -m rlhf_tasks.node --plan plan.json > node-{rank}.log 2>&1 &")
        lines.append("wait")
        return {"plan.json": plan_json(plan), "start-nodes.sh": "\n".join(lines) + "\n"}

    def _running(self, name: str) -> list[int]:
        record = state.load(name) or {}
        return [pid for pid in record.get("pids", []) if _alive(pid)]

    def apply(self, task: Task, plan: dict, secrets: dict[str, str]) -> Cluster:
        name = plan["name"]
        if plan["gpus_per_node"]:
            raise BadInput("resources.gpus: the local provider runs CPU-only nodes on this machine; "
                           "launch GPU tasks with --provider dstack or --provider sky")
        running = self._running(name)
        if running:
            raise BadInput(f"a local cluster named {name} is already running (PIDs {running}); "
                           f"`rlhf-tasks down {name}` first")
        cluster_id = pysecrets.token_hex(4)
        gcs, dashboard, client, ready = _free_ports(4)
        temp_dir = f"/tmp/rlhf-{cluster_id}"  # short: Ray's socket paths must stay under 108 bytes
        plan = {**plan, "ray": {**plan["ray"], "port": gcs, "dashboard_port": dashboard,
                                "client_server_port": client, "ready_port": ready, "temp_dir": temp_dir}}
        run_dir = self.run_dir(name)
        logs = run_dir / "nodes"
        logs.mkdir(parents=True, exist_ok=True)
        for old in logs.glob("*.log"):
            old.unlink()
        plan_path = run_dir / "plan.json"
        plan_path.write_text(plan_json(plan))
        token = state.new_token(name) if plan["token_env"] else None

        base = dict(os.environ)
        base["PATH"] = os.path.dirname(sys.executable) + os.pathsep + base.get("PATH", "")
        base.update(secrets)
        if token:
            base[TOKEN_ENV] = token
        pids = []
        for rank in range(plan["nodes"]):
            env = {**base, **self.node_env(plan, rank, cluster_id)}
            with open(logs / f"node-{rank}.log", "ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "rlhf_tasks.node", "--plan", str(plan_path), "--log-dir", str(logs)],
                    env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            pids.append(proc.pid)
        head = pids[0]
        state.save(name, {"provider": self.name, "cluster_id": cluster_id, "pids": pids, "temp_dir": temp_dir,
                          "dashboard": f"http://127.0.0.1:{dashboard}", "run_dir": str(run_dir),
                          "submission_id": f"{name}-{cluster_id}"})
        return Cluster(name=name, cluster_id=cluster_id, dashboard=f"http://127.0.0.1:{dashboard}", token=token,
                       head_alive=lambda: _alive(head), logs_dir=str(logs),
                       head_log=lambda: (logs / "node-0.log").read_text(errors="replace"),
                       extra={"plan": plan, "run_dir": str(run_dir)})

    def down(self, name: str) -> str:
        record = state.load(name)
        if not record:
            return f"no local cluster named {name} is known"
        pids = [pid for pid in record.get("pids", []) if _alive(pid)]
        for pid in pids:  # each agent stops its own Ray and services on SIGTERM
            try:
                os.killpg(pid, signal.SIGTERM)
            except OSError:
                pass
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.2)
        leftovers = self._kill_leftovers(pids, record.get("temp_dir"))
        state.forget(name)
        return f"stopped local cluster {name} ({len(pids)} node agents{leftovers})"

    def _kill_leftovers(self, pids: list[int], temp_dir: str | None) -> str:
        """SIGKILL agents that ignored SIGTERM and the process groups they recorded."""
        groups = set(pids)
        state_dir = Path(temp_dir or "/nonexistent") / "rlhf-tasks"
        for pgid_file in state_dir.glob("*.pgid"):
            try:
                groups.add(int(pgid_file.read_text().strip()))
            except (OSError, ValueError):
                pass
        killed = 0
        for pgid in groups:
            if _group_has_live_members(pgid):
                os.killpg(pgid, signal.SIGKILL)
                killed += 1
        if temp_dir and temp_dir.startswith("/tmp/rlhf-"):
            subprocess.run(["rm", "-rf", temp_dir], check=False)
        return f"; killed {killed} leftover process groups" if killed else ""
