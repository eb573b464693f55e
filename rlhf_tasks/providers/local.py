"""local: N nodes on this one machine, the default provider and the demo.

Each node is a node-agent process running the very same code path as on a rented
machine, with its own loopback address (127.A.B.1 for the head, 127.A.B.2, ...: Ray
rewrites 127.0.0.1 to the machine's public address, but not the rest of 127/8), its own
dashboard agent port, and a small object store. Each cluster has its own 127.A.B.0/24,
taken from its id, so two local clusters never share an address (a service's fixed port,
like the demo's reward server, would clash). Ray's ports are picked free when the plan
is made, below the kernel's ephemeral range (agent/protocol/ports.py), so a local cluster
never collides with another Ray or server on the machine, and the `start-nodes.sh` that
`render` prints is the very script `apply` runs. `down` stops exactly the processes it
started, by process group; it uses the agent's own process-group functions
(rlhf_tasks.agent.processes), the one implementation of them, rather than a copy: the
agent stops its children the same way, and this provider runs the agent on this very
machine.
"""

from __future__ import annotations

import os
import secrets as pysecrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from .. import state
from ..agent.processes import group_alive, pid_alive, signal_group
from ..agent.protocol import AGENT_ENTRY, parse_result
from ..agent.protocol.ports import free_ports
from ..errors import BadInput, StepFailed
from ..plan import TOKEN_ENV, Contract, Plan, env
from ..spec import Task
from .base import Cluster, Option, Provider, Sharing, write_files

#: This installation's agent, run by its path: `-m` would run an rlhf_tasks in the directory `launch` runs from.
AGENT_MAIN = str(Path(__file__).resolve().parents[2] / AGENT_ENTRY)
LOCAL_OBJECT_STORE_BYTES = 200 * 2**20
#: The local provider's environment contract: the launcher sets these per node.
RANK, NODES, HEAD, NODE_ADDR = "RLHF_TASKS_NODE_RANK", "RLHF_TASKS_NUM_NODES", "RLHF_TASKS_HEAD_ADDR", "RLHF_TASKS_NODE_ADDR"


def node_address(cluster_id: str, rank: int) -> str:
    """This cluster's loopback address for a rank: 127.A.B.(rank+1), A and B from the id."""
    a, b = int(cluster_id[0:2], 16) % 254 + 1, int(cluster_id[2:4], 16)
    return f"127.{a}.{b}.{rank + 1}"


def service_ports(plan: Plan) -> set[int]:
    """The ports the plan's services are said ready on (`ready: {tcp: PORT}`, or an http URL's port)."""
    ports = set()
    for service in plan.services:
        ready = service.ready
        try:
            port = getattr(ready, "tcp", None) or (urlsplit(ready.http).port if getattr(ready, "http", None) else None)
        except ValueError:  # no port in the URL that urllib reads
            continue
        if port:
            ports.add(port)
    return ports


def left_on_its_own(log: Path) -> bool:
    """Whether a worker's node agent ended by itself, as its last result line says: it left
    because its head went away (exit code 0), or it was stopped (a signal). A lost machine says
    nothing, and an agent that failed says why: those are replaced."""
    try:
        said = parse_result(log.read_text(errors="replace")) or {}
    except OSError:
        return False
    return said.get("exit_code") == 0 or str(said.get("error") or "").startswith(("stopped by signal", "interrupted"))


def groups_below(groups: set[int], pids: list[int]) -> set[int]:
    """The process groups of every process below the members of `groups` and the processes
    `pids` (from `ps`): Ray's workers, and a job's driver, run in sessions of their own, outside
    the groups the agents recorded; the driver would outlive them for a while (Ray kills it
    only a second or so after its supervisor dies). Never this process's own group."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,pgid="], capture_output=True, text=True).stdout
    rows = [tuple(int(f) for f in line.split()) for line in out.splitlines() if len(line.split()) == 3]
    children: dict[int, list[tuple[int, int]]] = {}
    for pid, ppid, pgid in rows:
        children.setdefault(ppid, []).append((pid, pgid))
    todo = [pid for pid, _, pgid in rows if pgid in groups] + list(pids)
    seen, found = set(todo), set()
    while todo:
        for child, pgid in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                found.add(pgid)
                todo.append(child)
    return found - {0, 1, os.getpgrp()}


class LocalProvider(Provider):
    name = "local"
    shares_filesystem = True  # every node is on this machine
    sharing = (Sharing("checkpoints.path", "this machine", "yes", "every node is a process on this machine"),)
    contract = Contract(rank=env(RANK), nodes=env(NODES), head=env(HEAD), node_addr=env(NODE_ADDR))
    ray_overrides = {"agent_listen_port": 0}  # every node its own dashboard agent port
    stop_after_job = True
    bills = False  # this machine: `check` says a cost only where the task gives a price or a cap
    renders_groups = True  # each node agent finds its group in the plan by its rank
    ignores = {"spot": "the nodes are processes on this machine", "retry": "the local provider's own `launch --retry N` "
               "relaunches a task whose head is lost", "fleets": "the nodes are processes on this machine",
               "backends": "the nodes are processes on this machine", "regions": "the nodes are processes on this machine"}
    working_dir_here = True
    options = (Option("--retry", "relaunch the whole task up to N times when the head is lost; it resumes from "
                      "the checkpoint", {"type": int, "default": 0, "metavar": "N"}),)

    def relaunches(self) -> int:
        return self.chosen["retry"] or 0

    def run_dir(self, name: str) -> Path:
        return state.run_dir(name)

    def default_checkpoint_dir(self, task: Task) -> str:
        return str(self.run_dir(task.name) / "checkpoints")

    def cache_dir(self, plan: Plan) -> str | None:
        """This machine's own caches (~/.cache, or the HF_HOME it sets): every node is a process here, and what
        was fetched here before is there already."""
        return None

    def check(self, task: Task) -> None:
        asking = [("resources.gpus", task.resources)] + [(f"groups[{index}].resources.gpus", group.resources)
                                                         for index, group in enumerate(task.groups)]
        for field, resources in asking:
            if resources.gpus_per_node:
                raise BadInput(f"{field}: the local provider runs CPU-only nodes on this machine; "
                               "run GPU tasks on a provider with GPUs (--provider dstack, sky, ...)")

    def plan(self, task: Task) -> Plan:
        """The plan with this cluster's id, free ports and its own temp dir."""
        plan = super().plan(task)
        cluster_id = pysecrets.token_hex(4)
        # free on every address, and none a service of the task is said ready on (the demo's reward server's
        # 23080 is in the range they are picked from): Ray's GCS listens on every address
        gcs, dashboard, client, ready, monitor = free_ports(5, host="", avoid=service_ports(plan))
        # Ray's autoscaler monitor serves its metrics on one fixed port (AUTOSCALER_METRIC_PORT, 44217:
        # ray/autoscaler/_private/constants.py): two local clusters at once collided there.
        env = {"AUTOSCALER_METRIC_PORT": str(monitor), **plan.env}
        # The head ends the cluster when its run is over (unless `launch --keep`), launcher or not.
        return plan.replace(cluster_id=cluster_id, env=env, ray={
            "port": gcs, "dashboard_port": dashboard, "client_server_port": client, "ready_port": ready,
            "temp_dir": f"/tmp/rlhf-{cluster_id}",  # short: Ray's socket paths must stay under 108 bytes
            # Ray's default, 30% of RAM, for each of N nodes here would not fit.
            "object_store_memory": plan.ray.object_store_memory or LOCAL_OBJECT_STORE_BYTES})

    def render(self, plan: Plan) -> dict[str, str]:
        run_dir = self.run_dir(plan.name)
        plan_path, logs, pids = run_dir / "plan.json", run_dir / "nodes", run_dir / "pids"
        lines = ["#!/usr/bin/env bash",
                 "# Rendered by rlhf-tasks: what `rlhf-tasks launch` runs for the local provider: one node agent per node, each in a",
                 f"# session of its own. Needs ${TOKEN_ENV} when token auth is on (the launcher makes one",
                 "# per cluster). Usage: start-nodes.sh [RANK ...] (default: every node); appends",
                 "# 'RANK PID' lines to pids. The launcher runs it again for one rank to replace a node",
                 "# agent that died, as a cloud provider replaces a machine. Every node shares this",
                 "# machine's environment, so the task's setup runs once, on the head (the others skip it).",
                 "set -euo pipefail",
                 f"mkdir -p {shlex.quote(str(logs))} {shlex.quote(plan.ray.temp_dir + '/tmp')}",
                 "start_node() {",
                 '  case "$1" in']
        for rank in range(plan.nodes):
            node_env = {RANK: rank, NODES: plan.nodes, HEAD: node_address(plan.cluster_id, 0),
                        NODE_ADDR: node_address(plan.cluster_id, rank),
                        "TMPDIR": shlex.quote(plan.ray.temp_dir + "/tmp")}  # removed with the cluster
            argv = ["setsid", sys.executable, AGENT_MAIN, "--plan", str(plan_path), "--log-dir", str(logs)]
            if rank:  # one environment for every node: setup runs once, on the head, before its beacon opens
                argv.append("--skip-setup")
            lines.append(f"    {rank}) " + " ".join(f"{k}={v}" for k, v in node_env.items()) + " " + shlex.join(argv)
                         + f" >> {shlex.quote(str(logs / f'node-{rank}.log'))} 2>&1 < /dev/null & ;;")
        lines += ['    *) echo "no node of rank $1" >&2; exit 2 ;;', "  esac",
                  f'  echo "$1 $!" >> {shlex.quote(str(pids))}', "}",
                  f'[ $# -gt 0 ] || set -- {" ".join(str(r) for r in range(plan.nodes))}',
                  'for rank in "$@"; do start_node "$rank"; done']
        return {"start-nodes.sh": "\n".join(lines) + "\n", "plan.json": plan.to_json()}

    @classmethod
    def live(cls, record: dict) -> bool:
        """A local cluster lives while one of its node agents does (it may have ended itself, with no
        launcher attached to record it)."""
        return not record.get("ended") and any(pid_alive(pid) for pid in record.get("pids", []))

    def _running(self, name: str) -> list[int]:
        record = state.load(name) or {}
        return [pid for pid in record.get("pids", []) if pid_alive(pid)]

    def _start(self, run_dir: Path, env: dict[str, str], ranks: list[int]) -> dict[int, int]:
        """Run the rendered start-nodes.sh for these ranks; rank -> agent PID."""
        out = subprocess.run(["bash", str(run_dir / "start-nodes.sh"), *map(str, ranks)], env=env,
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise StepFailed("starting the node agents", out.stderr.strip() or f"exit code {out.returncode}")
        started = {}
        for line in (run_dir / "pids").read_text().splitlines():
            rank, pid = map(int, line.split())
            started[rank] = pid  # the last line of a rank is its current agent
        return started

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        name = plan.name
        running = self._running(name)
        if running:
            raise BadInput(f"a local cluster named {name} is already running (PIDs {running}); "
                           f"`rlhf-tasks down {name}` first")
        run_dir = self.run_dir(name)
        logs = run_dir / "nodes"
        for old in [*logs.glob("*.log"), run_dir / "pids"]:
            old.unlink(missing_ok=True)
        write_files(run_dir, self.render(plan))
        token = state.new_token(name) if plan.token_env else None
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env.update(secrets)
        if token:
            env[TOKEN_ENV] = token
        agents = self._start(run_dir, env, list(range(plan.nodes)))
        dashboard = f"http://127.0.0.1:{plan.ray.dashboard_port}"
        record = {"provider": self.name, "cluster_id": plan.cluster_id, "pids": [agents[r] for r in sorted(agents)],
                  "temp_dir": plan.ray.temp_dir, "dashboard": dashboard, "run_dir": str(run_dir),
                  "gcs": f"{node_address(plan.cluster_id, 0)}:{plan.ray.port}"}  # reachable here: `rlhf-tasks env`
        state.save(name, record)

        def tend() -> list[str]:
            """Replace a worker's node agent that died (the head's loss ends the cluster), as a
            cloud provider replaces a lost machine; not one that left on its own."""
            if not pid_alive(agents[0]):
                return []
            dead = [rank for rank, pid in agents.items() if rank > 0 and not pid_alive(pid)
                    and not left_on_its_own(logs / f"node-{rank}.log")]
            if not dead:
                return []
            agents.update(self._start(run_dir, env, dead))
            state.update(name, pids=[agents[r] for r in sorted(agents)])
            return [f"the node agent of rank {rank} died; started it again (pid {agents[rank]}), as a cloud "
                    f"provider replaces a machine" for rank in dead]

        return Cluster(name=name, cluster_id=plan.cluster_id, dashboard=dashboard, token=token,
                       head_alive=lambda: pid_alive(agents[0]),
                       node_logs=[str(logs / f"node-{rank}.log") for rank in range(plan.nodes)], tend=tend)

    def status(self, name: str) -> str | None:
        """Its node agents on this machine, by the PIDs recorded at launch."""
        pids = (state.load(name) or {}).get("pids") or []
        running = [pid for pid in pids if pid_alive(pid)]
        return f"{name}: a local cluster; node agents: {len(running)} of {len(pids)} running on this machine" + \
            (f" (PIDs {', '.join(map(str, running))})" if running else "")

    def state_line(self, name: str) -> str | None:
        pids = (state.load(name) or {}).get("pids") or []
        running = [pid for pid in pids if pid_alive(pid)]
        return (f"running ({len(running)} of {len(pids)} node agents on this machine)" if running else
                "ended on its own (none of its node agents runs)")

    def forward(self, name: str, port: int | None = None) -> int:
        """Nothing to forward: a local cluster's dashboard is on this machine already."""
        dashboard = (state.load(name) or {}).get("dashboard") or "its recorded address (none is known here)"
        raise BadInput(f"forward: the local cluster {name} runs on this machine; its dashboard is at {dashboard} "
                       f"already (for Ray's CLI: eval \"$(rlhf-tasks env {name})\")")

    def down(self, name: str) -> str:
        """Stop the cluster now: its Ray and services first, without letting raylets drain
        (the whole cluster is going away), then the node agents, by process group."""
        record = state.load(name)
        if not record or record.get("ended"):
            return f"no local cluster named {name} is running"
        started = time.monotonic()
        pids = [pid for pid in record.get("pids", []) if pid_alive(pid)]
        groups = self._recorded_groups(record.get("temp_dir"))
        below = groups_below(groups, pids) - groups  # found before their parents die and they are reparented
        for pgid in groups | below:
            signal_group(pgid, signal.SIGKILL)
        for pid in pids:  # each agent then finds its children gone and exits at once
            signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
            time.sleep(0.1)
        leftovers = self._kill_leftovers(pids, record.get("temp_dir"))
        state.end(name)
        return (f"stopped local cluster {name}: {len(pids)} node agents, {len(groups)} Ray and service process "
                f"groups" + (f" and {len(below)} under them (Ray's workers, a job's driver)" if below else "")
                + f" in {time.monotonic() - started:.1f}s{leftovers}")

    @staticmethod
    def _recorded_groups(temp_dir: str | None) -> set[int]:
        """The process groups (Ray, services) the node agents recorded in the cluster's temp dir."""
        groups = set()
        for pgid_file in (Path(temp_dir or "/nonexistent") / "rlhf-tasks").glob("*.pgid"):
            try:
                groups.add(int(pgid_file.read_text().strip()))
            except (OSError, ValueError):
                pass
        return {g for g in groups if group_alive(g)}

    def _kill_leftovers(self, pids: list[int], temp_dir: str | None) -> str:
        """SIGKILL agents that ignored SIGTERM and any group they recorded that still runs."""
        killed = 0
        for pgid in set(pids) | self._recorded_groups(temp_dir):
            if group_alive(pgid):
                signal_group(pgid, signal.SIGKILL)
                killed += 1
        if temp_dir and temp_dir.startswith("/tmp/rlhf-"):
            subprocess.run(["rm", "-rf", temp_dir], check=False)
        return f"; killed {killed} leftover process groups" if killed else ""
