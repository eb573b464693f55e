"""RunPod: pods with Global Networking (`network: runpod-global`, the OpenRLHF-M guide's
setup; also `auto` and `ethernet`) or one Instant Cluster (`network: runpod-cluster`),
through RunPod's REST API v2 (`api.py`, its client).

`render` (pure) writes the create requests as JSON, exactly the bodies `launch` sends but
with secret values as `${NAME}` placeholders (RunPod's v2 pod `env` holds values only: it has
no reference to a stored secret), and `NAME.start.sh`, which carries the node agent and the
plan inside itself (heredocs) and starts the agent; the requests pass it through the pod's
`args` (gzip and base64 in a `bash -c`, the way SkyPilot ships its start script to RunPod).

Pods: the head first, then the workers, all in one data center whose catalog entry says
`globalNetwork`; nodes find each other by the guide's variables (RAY_WORKER, HEAD_POD_ID,
EXPECTED_WORKERS) and reach each other as `<podId>.runpod.internal`. An Instant Cluster sets
NODE_RANK, NUM_NODES, PRIMARY_ADDR, NODE_ADDR, NUM_TRAINERS itself; the agent finds the
interface that holds NODE_ADDR (ens1 today) for NCCL and Gloo.

`launch` checks the GPU type and the data center against the catalog before it creates
anything, shows the price, asks (unless -y), creates, shows the pods' progress, and then
follows the job without exposing the dashboard: it streams the head pod's log, where the
head agent prints the job's log and its result line. With `submit: client` the head gets
SSH (`22/tcp`, `startSsh`) and the launcher reaches the dashboard through `ssh -L`, which
`rlhf-tasks forward NAME` opens again later. Pods are named `<task>-head`,
`<task>-worker-<k>` (the cluster `<task>`); `status` and `down` find them by those names and
touch nothing else in the account. The launcher terminates them after the job (they bill
by the hour) unless `launch --keep`.
"""

from __future__ import annotations

import atexit
import base64
import gzip
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from ... import state
from ...agent.protocol import RESULT_PREFIX, AgentError, parse_result, wait_for
from ...errors import BadInput, StepFailed
from ...launch import say
from ...models import StrictModel, did_you_mean, size_bytes
from ...plan import Contract, Plan, build_plan, env, template
from ...spec import Task
from ..base import Cluster, Option, Provider, write_files
from ..shipping import NODE_DIR, agent_command, node_path, shared_entry, shipped_files

#: RunPod GPU type ids for the short names a task writes (`resources.gpus: H100:8`); a name
#: not here is sent as written, and `launch` checks it against RunPod's catalog.
GPU_TYPES = {
    "h100": "NVIDIA H100 80GB HBM3", "h100sxm": "NVIDIA H100 80GB HBM3", "h100pcie": "NVIDIA H100 PCIe",
    "h100nvl": "NVIDIA H100 NVL", "h200": "NVIDIA H200", "b200": "NVIDIA B200",
    "a100": "NVIDIA A100-SXM4-80GB", "a10080gb": "NVIDIA A100-SXM4-80GB", "a100sxm": "NVIDIA A100-SXM4-80GB",
    "a100pcie": "NVIDIA A100 80GB PCIe", "l40s": "NVIDIA L40S", "l40": "NVIDIA L40", "a40": "NVIDIA A40",
    "rtx4090": "NVIDIA GeForce RTX 4090", "rtxa6000": "NVIDIA RTX A6000", "a6000": "NVIDIA RTX A6000",
    "mi300x": "AMD Instinct MI300X OAM",
}
#: Global Networking and Instant Clusters need a GPU on every pod: a task without one gets this.
DEFAULT_GPU = "NVIDIA A40"
#: A task without an image gets RunPod's PyTorch image (python3; the recipe's setup installs Ray where missing).
DEFAULT_IMAGE = "runpod/pytorch:1.0.2-cu1281-torch280-ubuntu2404"
MAX_ENV = 50                       # RunPod v2: at most 50 variables in a pod's env
MAX_ARGS = 120 * 1024              # one argument of `bash -c` stays below Linux's 128 KiB per argument
GLOBAL_LINK = "100 Mbit/s"         # between Global Networking pods (RunPod's docs)
ENDED = ("EXITED", "ERROR", "TERMINATED")

#: The guide's contract: RAY_WORKER unset/0 on the head, > 0 on workers; workers know
#: HEAD_POD_ID; every pod resolves `<podId>.runpod.internal`. The head has no HEAD_POD_ID and
#: uses its own address. The node count defaults to the plan's (EXPECTED_WORKERS is optional).
POD_CONTRACT = Contract(
    rank=env("RAY_WORKER", default="0"),
    nodes=env("EXPECTED_WORKERS", plus=1),
    head=template("{HEAD_POD_ID}.runpod.internal"),
    node_addr=template("{RUNPOD_POD_ID}.runpod.internal"),
    cluster_id=env("RUNPOD_POD_ID"),
)
#: What RunPod sets on every node of an Instant Cluster.
CLUSTER_CONTRACT = Contract(
    rank=env("NODE_RANK"),
    nodes=env("NUM_NODES"),
    head=env("PRIMARY_ADDR"),
    node_addr=env("NODE_ADDR"),
    cluster_id=env("RUNPOD_POD_ID"),
    gpus_per_node=env("NUM_TRAINERS"),
)
#: `{iface}` is the interface that holds the node's address, found on the node: the pod's
#: Global Networking interface, or an Instant Cluster's overlay (ens1 today, eth1 on older ones).
GLOBAL_PRESET = {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}", "NCCL_IB_DISABLE": "1",
                 "NCCL_SOCKET_FAMILY": "IPv4", "NCCL_LAUNCH_MODE": "GROUP", "NCCL_SOCKET_NTHREADS": "1",
                 "NCCL_NSOCKS_PERTHREAD": "1"}
CLUSTER_PRESET = {"NCCL_SOCKET_IFNAME": "{iface}", "GLOO_SOCKET_IFNAME": "{iface}"}


class RunPodShared(StrictModel):
    """`checkpoints.shared.runpod`: a network volume every pod mounts at checkpoints.path."""

    network_volume: str = Field(description="id of a RunPod network volume; it lives in one data center, "
                                "where the pods then go")


def is_cluster(plan_or_task) -> bool:
    return plan_or_task.network == "runpod-cluster"


def gpu_request(resources) -> tuple[str, int]:
    """(RunPod GPU type id, GPUs per pod) for the task's `resources.gpus`."""
    if not resources.gpus:
        return DEFAULT_GPU, 1
    name = resources.gpu_name
    key = re.sub(r"[^a-z0-9]", "", (name or "").lower())
    return GPU_TYPES.get(key, name), resources.gpus_per_node


def pod_names(name: str) -> re.Pattern:
    """The names this provider gives a task's pods, and nothing else of the account."""
    return re.compile(rf"^{re.escape(name)}-(head|worker-\d+)$")


def start_args(script: str) -> str:
    """The pod's `args`: the start script, compressed, in one `bash -c` word (quotes do not
    survive RunPod's splitting, base64 has none)."""
    encoded = base64.b64encode(gzip.compress(script.encode(), mtime=0)).decode()
    return (f"bash -c 'echo {encoded} | base64 -d | gzip -dc > /tmp/rlhf-tasks-start.sh; "
            f"exec bash /tmp/rlhf-tasks-start.sh'")


def _heredoc(path: str, text: str) -> str:
    delimiter = "RLHF_TASKS_EOF"
    while delimiter in text.splitlines():
        delimiter += "_"
    body = text if text.endswith("\n") else text + "\n"
    return f"mkdir -p {shlex.quote(os.path.dirname(path))}\ncat > {shlex.quote(path)} <<'{delimiter}'\n{body}{delimiter}\n"


def cross_node_traffic(plan: Plan) -> str:
    """What the recipe sends between nodes, in words (for the 100 Mbit/s warning)."""
    argv = plan.job.entrypoint

    def flag(*names: str) -> str | None:
        for index, arg in enumerate(argv[:-1]):
            if arg in names:
                return argv[index + 1]
        return None

    engines = flag("--vllm_num_engines", "--vllm.num_engines")
    if engines and engines != "0":
        backend = flag("--vllm_sync_backend", "--vllm.sync_backend") or "nccl"
        return (f"the recipe moves weights across pods: after every training step the actor sends its weights to "
                f"{engines} vLLM engines spread over the {plan.nodes} pods ({backend} weight sync)")
    if any(arg.startswith("trainer.nnodes=") and arg != "trainer.nnodes=1" for arg in argv):
        return ("the recipe moves weights across pods: verl shards the model over the pods (FSDP), so parameters "
                "and gradients cross the link on every step")
    return "training across pods sends its gradients over it"


class RunPodProvider(Provider):
    name = "runpod"
    contract = POD_CONTRACT
    networks = {"runpod-global": GLOBAL_PRESET, "runpod-cluster": CLUSTER_PRESET}
    options = (Option("-y", "create the pods without asking to confirm their price"),)
    stop_after_job = True  # pods bill by the hour: the launcher terminates them after the job unless --keep

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._tunnels: dict[str, SshTunnel] = {}
        self._log_stops: dict[str, threading.Event] = {}

    # ------------------------------------------------------------------ pure: check, plan, render

    def check(self, task: Task) -> None:
        shared_entry(RunPodShared, task.checkpoints.shared.get(self.name), self.name)
        if task.network == "infiniband":
            raise BadInput("network: infiniband: RunPod pods have no InfiniBand between them; use runpod-cluster "
                           "(an Instant Cluster, 1.6-3.2 Tbit/s between nodes) or runpod-global (pods, 100 Mbit/s)")
        if is_cluster(task) and task.nodes < 2:
            raise BadInput(f"nodes: an Instant Cluster has 2 to 8 nodes (self-serve), not {task.nodes}; use "
                           f"network: runpod-global for a single pod")
        placement = task.placement
        refusals = {
            "spot": (placement.spot != "off", "RunPod's v2 API creates on-demand pods only; write spot: off"),
            "retry": (placement.retry, "the RunPod provider does not relaunch lost pods; the head restarts the job "
                      "(job.max_restarts) while its pod lives"),
            "max_duration": (placement.max_duration is not None, "not offered on RunPod; job.timeout bounds the job, "
                             "and the launcher terminates the pods after it"),
            "fleets": (bool(placement.fleets), "RunPod has no fleets"),
            "backends": (bool(placement.backends), "RunPod is one backend"),
        }
        for field, (refused, why) in refusals.items():
            if refused:
                raise BadInput(f"placement.{field}: {why}")
        names = list(task.secrets) + (["RAY_AUTH_TOKEN"] if task.ray.auth == "token" else [])
        taken = 2 if is_cluster(task) else 3  # RAY_WORKER, EXPECTED_WORKERS, HEAD_POD_ID
        if len(names) + taken > MAX_ENV:
            raise BadInput(f"secrets: a RunPod pod's env holds at most {MAX_ENV} variables; these {len(names)} "
                           f"secrets and the {taken} the provider sets make {len(names) + taken}")

    def plan(self, task: Task) -> Plan:
        """The plan, with the contract of the task's network mode: Instant Cluster or pods."""
        try:
            self.check(task)
            contract = CLUSTER_CONTRACT if is_cluster(task) else POD_CONTRACT.model_copy(
                update={"nodes": env("EXPECTED_WORKERS", plus=1, default=str(task.nodes))})
            return build_plan(task, self.name, contract, self.networks, self.default_checkpoint_dir(task),
                              self.ray_overrides)
        except BadInput as exc:
            raise BadInput(f"{task.source}: {exc}") from None

    def shared_storage_warning(self, plan: Plan) -> str | None:
        if not plan.resume or not plan.checkpoint_dir or plan.checkpoint_shared:
            return None
        nodes = f"the {plan.nodes} pods do not share it, and " if plan.nodes > 1 else ""
        return (f"checkpoints {plan.checkpoint_dir} is on each RunPod pod's own disk: {nodes}resume works only on "
                f"the head, and only while its pod lives (the launcher terminates the pods after the job); add "
                f"checkpoints.shared.runpod: {{network_volume: ID}} (a RunPod network volume)")

    def start_script(self, plan: Plan) -> str:
        """What every pod runs: it writes the agent and the plan under /opt/rlhf-tasks and
        starts the agent (which runs the setup commands), then keeps the pod up, so that a
        container restart never runs the job twice."""
        cluster = is_cluster(plan)
        preset = " ".join(f"{k}={v}" for k, v in plan.network_env.items())
        lines = [
            "#!/usr/bin/env bash",
            f"# rlhf-tasks: one node of {plan.name} ({plan.nodes} nodes) on RunPod. Rendered by rlhf-tasks; it names",
            "# secrets only (safe to commit). It carries the node agent and the plan: the image needs python3 and",
            "# Ray, nothing else (the task's setup runs first on every node).",
        ]
        if cluster:
            lines += [
                "# Instant Cluster: RunPod sets NODE_RANK, NUM_NODES, PRIMARY_ADDR, NODE_ADDR and NUM_TRAINERS on",
                "# every node; give every node:",
            ]
        else:
            lines += [
                "# Pods with Global Networking (the OpenRLHF-M guide's variables), every pod:",
                "#   RAY_WORKER        unset or 0 on the head, 1 (or another rank > 0) on each worker",
                "#   HEAD_POD_ID       on the workers: the head pod's id (they reach it as <id>.runpod.internal)",
                f"#   EXPECTED_WORKERS  optional: how many workers the head waits for ({plan.nodes - 1} in this plan)",
            ]
        lines += [
            f"#   RAY_AUTH_TOKEN    the cluster's Ray token: rlhf-tasks token {plan.name}",
            "#   WANDB_API_KEY     optional: W&B logging when set",
            "#   DEBUG_RAY=1       optional: Ray's legacy debugger (`ray debug` on the head)",
            f"# Network preset {plan.network}: {preset or 'none'}",
            "#   ({iface}: the interface that holds this node's address, found on the node; the task's env",
            "#   overrides any of them).",
        ]
        if not cluster and plan.nodes > 1:
            lines.append(f"# Global Networking links the pods at {GLOBAL_LINK}.")
        lines += [
            "# As a pod's start command (RunPod's args replace the image's CMD), see the args of",
            f"# {plan.name}.runpod.json; or copy this file to each pod and run: bash start.sh",
            "set -u",
            'say() { echo "[$(date +%H:%M:%S)] start.sh: $*"; }',
            "",
        ]
        script = "\n".join(lines) + "\n"
        for local, text in shipped_files(plan).items():
            script += _heredoc(node_path(local), text)
        plan_path = f"{NODE_DIR}/{plan.name}.plan.json"
        # The agent runs the setup commands itself (no --skip-setup): its result line covers them.
        agent = agent_command(plan).replace(" --skip-setup", "")
        keep = (f'say "the pod stays up (and billed) until it is terminated: rlhf-tasks down {plan.name}, '
                f'or RunPod\'s console"')
        script += "\n".join([
            "",
            f"plan={shlex.quote(plan_path)}",
            'if [ "${DEBUG_RAY:-0}" = 1 ]; then',
            "  python3 -c 'import json, sys; p = json.load(open(sys.argv[1])); p[\"ray\"][\"debug\"] = \"legacy\"; "
            "json.dump(p, open(sys.argv[1], \"w\"), indent=2)' \"$plan\" && say \"DEBUG_RAY=1: Ray's legacy debugger is on\"",
            "fi",
            "# SSH (submit: client): RunPod puts the account's keys in PUBLIC_KEY when the pod has startSsh,",
            "# and the image's own start command, which would start sshd, is replaced by this script.",
            'if [ -n "${PUBLIC_KEY:-}" ]; then',
            '  mkdir -p ~/.ssh && chmod 700 ~/.ssh && printf "%s\\n" "$PUBLIC_KEY" >> ~/.ssh/authorized_keys',
            "  chmod 600 ~/.ssh/authorized_keys",
            "  sshd=$(command -v sshd || echo /usr/sbin/sshd)",
            '  if [ ! -x "$sshd" ] && command -v apt-get >/dev/null; then',
            '    say "installing openssh-server (the image has no sshd)"',
            "    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server; } >/dev/null 2>&1",
            "  fi",
            '  if [ -x "$sshd" ]; then',
            '    ssh-keygen -A >/dev/null 2>&1; mkdir -p /run/sshd; "$sshd" && say "sshd started" || say "sshd failed to start"',
            "  else",
            '    say "no sshd in the image: no SSH access"',
            "  fi",
            "fi",
            "export PYTHONUNBUFFERED=1",
            "# job.working_dir '.' is this empty directory: nothing of yours is uploaded from a pod",
            f"mkdir -p {NODE_DIR}/workdir && cd {NODE_DIR}/workdir",
            "if ! command -v python3 >/dev/null 2>&1; then",
            '  say "python3 is not in the image"',
            "  echo '" + RESULT_PREFIX + json.dumps({"error": "python3 is not in the image", "exit_code": 2,
                                                     "failed_step": "starting the node agent"}) + "'",
            f"  {keep}",
            "  exec sleep infinity",
            "fi",
            agent,
            'say "the node agent exited with code $?"',
            keep,
            "exec sleep infinity",
            "",
        ])
        return script

    def bodies(self, plan: Plan, args: str) -> dict:
        """The create requests, secrets as `${NAME}` placeholders that `launch` fills."""
        gpu_id, count = gpu_request(plan.resources)
        client = plan.job.submit == "client"
        secrets = {name: f"${{{name}}}" for name in plan.secrets + ([plan.token_env] if plan.token_env else [])}
        container: dict[str, Any] = {"image": plan.image or DEFAULT_IMAGE, "args": args}
        if plan.resources.disk:
            container["disk"] = max(1, size_bytes(plan.resources.disk) // 10**9)
        if client:  # the head's sshd, for the dashboard's SSH forward
            container["ports"] = ["22/tcp"]
        where: dict[str, Any] = {"dataCenterIds": list(plan.placement.regions)} if plan.placement.regions else {}
        shared = shared_entry(RunPodShared, plan.checkpoint_shared, self.name)
        mounts = {"mounts": {"network": [{"volumeId": shared.network_volume, "path": plan.checkpoint_dir}]}} \
            if shared and plan.checkpoint_dir else {}
        if is_cluster(plan):
            body = {"name": plan.name, "type": "TRAINING",
                    "compute": {"gpuTypeId": gpu_id, "gpuCountPerPod": count, "podCount": plan.nodes},
                    **container, "env": secrets, **where, **mounts, **({"startSsh": True} if client else {})}
            return {"cluster": body}

        def pod(role: str, rank: int) -> dict:
            contract = {"RAY_WORKER": str(rank), "EXPECTED_WORKERS": str(plan.nodes - 1)}
            if rank:
                contract["HEAD_POD_ID"] = "${HEAD_POD_ID}"
            body = {"name": f"{plan.name}-{role}", **container, "gpu": {"id": gpu_id, "count": count},
                    "cloud": "SECURE", "env": {**contract, **secrets}, **where, **mounts}
            if plan.nodes > 1:
                body["globalNetworking"] = True
            if rank == 0 and client:
                body["startSsh"] = True
            elif rank:
                body.pop("ports", None)
            return body

        return {"head": pod("head", 0), "workers": [pod(f"worker-{k}", k) for k in range(1, plan.nodes)]}

    def render(self, plan: Plan) -> dict[str, str]:
        script = self.start_script(plan)
        args = start_args(script)
        if len(args) > MAX_ARGS:
            raise BadInput(f"the start script is too large for a pod's args ({len(args) // 1024} KiB compressed, "
                           f"at most {MAX_ARGS // 1024} KiB): it carries the agent and job.args' shipped modules")
        if is_cluster(plan):
            what = ("POST https://api.runpod.io/v2/clusters. rlhf-tasks launch fills each ${NAME} in env from your "
                    f"environment (RAY_AUTH_TOKEN: rlhf-tasks token {plan.name}) and sets dataCenterIds to data "
                    "centers whose catalog offers the GPU type.")
        else:
            what = ("POST https://api.runpod.io/v2/pods, the head first, then the workers. rlhf-tasks launch fills "
                    f"each ${{NAME}} in env from your environment (RAY_AUTH_TOKEN: rlhf-tasks token {plan.name}; "
                    "HEAD_POD_ID: the head pod's id) and sets dataCenterIds to data centers whose catalog entry has "
                    "Global Networking and the GPU type (the workers: the head's).")
        notes = [f"The create requests for RunPod's REST API v2: {what} args runs {plan.name}.start.sh "
                 "(gzip, base64)."]
        if not plan.resources.gpus:
            why = "an Instant Cluster's pods have GPUs" if is_cluster(plan) else \
                "RunPod pods with Global Networking need an NVIDIA GPU"
            notes.append(f"resources.gpus is not set: every pod gets 1x {DEFAULT_GPU} ({why}); set resources.gpus "
                         f"to choose.")
        ignored = [f"resources.{key}" for key in ("shm_size", "memory") if getattr(plan.resources, key)]
        if ignored:
            notes.append(f"{' and '.join(ignored)} not applied: RunPod sizes a pod's memory and /dev/shm by its "
                         f"GPU type.")
        document = {"note": " ".join(notes), **self.bodies(plan, args)}
        return {f"{plan.name}.runpod.json": json.dumps(document, indent=2) + "\n", f"{plan.name}.start.sh": script}

    # ------------------------------------------------------------------ the API

    def _client(self):
        try:
            import httpx  # noqa: F401 - the client's transport, checked before anything is done
        except ImportError:
            raise BadInput("--provider runpod: the httpx package is not installed; "
                           "pip install 'rlhf-tasks[runpod]'") from None
        from .api import RunPodClient

        if not os.environ.get("RUNPOD_API_KEY"):
            raise BadInput("RUNPOD_API_KEY is not set: create an API key in RunPod's console (Settings, API Keys) "
                           "and export RUNPOD_API_KEY")
        return RunPodClient.from_env(progress=say)

    def _catalog(self, client, plan: Plan) -> dict:
        """The GPU type and the data centers that fit, from RunPod's catalog; BadInput naming the
        field that does not fit. Nothing is created here."""
        from .api import RunPodNotFound

        gpu_id, count = gpu_request(plan.resources)
        field = "resources.gpus"
        gpus = client.gpu_types()
        gpu = next((g for g in gpus if g["id"] == gpu_id), None)
        if gpu is None:
            raise BadInput(f"{field}: RunPod has no GPU type {gpu_id!r} "
                           f"{did_you_mean(gpu_id, [g['id'] for g in gpus], 'its GPU types')}")
        global_networking = not is_cluster(plan) and plan.nodes > 1
        if global_networking and gpu.get("manufacturer") != "NVIDIA":
            raise BadInput(f"{field}: Global Networking needs NVIDIA GPUs; {gpu_id} is {gpu.get('manufacturer')}'s "
                           f"(network: runpod-cluster for an Instant Cluster)")
        most = (gpu.get("maxCount") or {}).get("secure")
        if not gpu.get("secure") or not most:
            raise BadInput(f"{field}: RunPod does not offer {gpu_id} on Secure Cloud, where the provider creates pods")
        if count > most:
            raise BadInput(f"{field}: RunPod offers at most {most}x {gpu_id} per pod, not {count}")
        datacenters = client.datacenters(gpu_availability=True)
        known = {dc["id"]: dc for dc in datacenters}
        eligible = [dc["id"] for dc in datacenters if dc.get("globalNetwork") or not global_networking]
        regions = list(plan.placement.regions)
        for region in regions:
            if region not in known:
                raise BadInput(f"placement.regions: RunPod has no data center {region!r} "
                               f"{did_you_mean(region, list(known), 'its data centers')}")
            if region not in eligible:
                raise BadInput(f"placement.regions: {region} has no Global Networking (data centers with it: "
                               f"{', '.join(eligible) or 'none'})")
        candidates = regions or eligible
        shared = shared_entry(RunPodShared, plan.checkpoint_shared, self.name)
        if shared:
            where = "checkpoints.shared.runpod.network_volume"
            try:
                volume = client.network_volume(shared.network_volume)
            except RunPodNotFound:
                raise BadInput(f"{where}: RunPod has no network volume {shared.network_volume!r}") from None
            if volume["dataCenter"] not in candidates:
                why = "not in placement.regions" if regions else "without Global Networking"
                raise BadInput(f"{where}: volume {shared.network_volume} is in {volume['dataCenter']}, {why}; the "
                               f"pods must be where the volume is")
            candidates = [volume["dataCenter"]]
        rank = {"HIGH": 0, "MEDIUM": 1, "LOW": 2}

        def level(dc_id: str) -> str | None:
            offers = {g["id"]: g.get("availability") for g in known[dc_id].get("gpuAvailability") or []}
            return offers.get(gpu_id)

        offered = sorted((dc for dc in candidates if level(dc) is not None), key=lambda dc: rank.get(level(dc), 3))
        if not offered:
            gn = " with Global Networking" if global_networking else ""
            raise BadInput(f"{'placement.regions' if regions else field}: no data center{gn} offers {gpu_id} "
                           f"(looked in {', '.join(candidates) or 'none'})")
        price = (gpu.get("price") or {}).get("secure")
        return {"gpu": gpu_id, "count": count, "datacenters": offered, "price": price * count if price else None}

    def _find(self, client, name: str) -> tuple[list[dict], list[dict]]:
        """This task's pods (by the names this provider gives) and its Instant Cluster (by name)."""
        pattern = pod_names(name)
        pods = [p for p in client.list_pods(f"{name}-") if pattern.match(p.get("name", ""))]
        clusters = [c for c in client.list_clusters() if c.get("name") == name]
        return pods, clusters

    # ------------------------------------------------------------------ launch

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """Check against the catalog, confirm the price, create, follow. Whatever fails (or
        Ctrl-C) before the job runs terminates every pod this launch created."""
        from .api import RunPodAuthError, RunPodError

        started = time.monotonic()
        client = self._client()
        files = self.render(plan)
        requests = json.loads(files[f"{plan.name}.runpod.json"])
        try:
            fit = self._catalog(client, plan)
            pods, clusters = self._find(client, plan.name)
        except RunPodAuthError as exc:
            raise BadInput(str(exc)) from None
        except RunPodError as exc:
            raise StepFailed("checking RunPod's catalog", str(exc)) from None
        if pods or clusters:
            found = ", ".join(f"{p['name']} ({p['id']}, {p['status']})" for p in pods) or \
                ", ".join(f"cluster {c['name']} ({c['id']})" for c in clusters)
            raise BadInput(f"name: RunPod already has {found} for {plan.name}; `rlhf-tasks down {plan.name}` first")
        if plan.job.submit == "client" and shutil.which("ssh") is None:
            raise BadInput("job.submit: client on RunPod forwards the dashboard through ssh, and the `ssh` command "
                           "is not installed here")
        self._announce(plan, fit)
        self._confirm(plan)

        fresh = (state.load(plan.name) or {"ended": True}).get("ended") is not None
        directory = state.run_dir(plan.name) / self.name
        write_files(directory, files)
        token = state.new_token(plan.name) if plan.token_env else None
        values = {**secrets, **({plan.token_env: token} if token else {})}
        mode = "cluster" if is_cluster(plan) else "pods"
        state.save(plan.name, {"provider": self.name, "mode": mode, "cluster_id": None, "dashboard": None,
                               "dashboard_port": plan.ray.dashboard_port, "pods": []})
        step = "creating the pods"
        try:
            if is_cluster(plan):
                step = f"creating the Instant Cluster {plan.name}"
                body = self._filled(requests["cluster"], values, fit["datacenters"])
                cluster = client.create_cluster(body)
                state.update(plan.name, cluster_id=cluster["id"])
                say(f"created Instant Cluster {plan.name} ({cluster['id']}) in {cluster.get('dataCenterId')}")
                step = f"starting the Instant Cluster {plan.name}"
                members = self._wait_running(client, plan, cluster_id=cluster["id"])
            else:
                ids: list[str] = []
                head = requests["head"]
                step = f"creating pod {head['name']}"
                made = client.create_pod(self._filled(head, values, fit["datacenters"]))
                ids.append(made["id"])
                state.update(plan.name, cluster_id=made["id"], pods=ids)
                say(f"created pod {made['name']} ({made['id']}) in {made.get('dataCenterId')}")
                for worker in requests["workers"]:
                    step = f"creating pod {worker['name']}"
                    body = self._filled(worker, {**values, "HEAD_POD_ID": made["id"]}, [made["dataCenterId"]])
                    pod = client.create_pod(body)
                    ids.append(pod["id"])
                    state.update(plan.name, pods=ids)
                    say(f"created pod {pod['name']} ({pod['id']})")
                step = "starting the pods"
                members = self._wait_running(client, plan, pod_ids=ids)
            if plan.job.submit == "client":
                return self._client_cluster(client, plan, members, token, directory)
        except BaseException as exc:
            said = self._undo(client, plan.name, fresh)
            if isinstance(exc, RunPodError):
                raise StepFailed(step, f"{exc}; {said}") from None
            if isinstance(exc, KeyboardInterrupt):
                raise StepFailed(step, f"interrupted (Ctrl-C); {said}") from None
            if isinstance(exc, (StepFailed, AgentError)):
                raise StepFailed(step, f"{exc}; {said}") from None
            raise
        return self._follow(client, plan, members, token, started, fit)

    @staticmethod
    def _filled(body: dict, values: dict[str, str], datacenters: list[str]) -> dict:
        """A rendered request with its `${NAME}` env values filled (a secret not set here is left
        out, as the launcher says) and its data centers chosen."""
        out = json.loads(json.dumps(body))
        env = {}
        for key, value in out.get("env", {}).items():
            match = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", value)
            if match is None:
                env[key] = value
            elif values.get(match.group(1)):
                env[key] = values[match.group(1)]
        out["env"] = env
        out["dataCenterIds"] = list(datacenters)
        return out

    def _announce(self, plan: Plan, fit: dict) -> None:
        nodes, count = plan.nodes, fit["count"]
        where = fit["datacenters"][0] if len(fit["datacenters"]) == 1 else f"one of {', '.join(fit['datacenters'])}"
        what = "an Instant Cluster of" if is_cluster(plan) else ""
        price = fit["price"]
        hourly = f"${price * nodes:.2f}/h" if price else "price not in the catalog"
        say(f"RunPod: {what + ' ' if what else ''}{nodes} pod(s) x {count}x {fit['gpu']}, Secure Cloud, in {where}: "
            f"{hourly}" + (f" (${price:.2f}/h per pod)" if price and nodes > 1 else ""))
        timeout = plan.job.timeout_s
        if timeout:
            hours = timeout / 3600
            cost = f", at most ${price * nodes * hours:.2f} for the job" if price else ""
            length = f"{timeout / 60:.0f}m" if timeout < 3600 else f"{hours:.3g}h"
            say(f"job.timeout {length}: {nodes * count * hours:.2f} GPU-hours{cost} (plus start-up)")
        else:
            say(f"no job.timeout: the pods run (and bill) until the job ends or `rlhf-tasks down {plan.name}`")
        if not plan.resources.gpus:
            why = "an Instant Cluster's pods have GPUs" if is_cluster(plan) else "Global Networking needs an NVIDIA GPU"
            say(f"resources.gpus is not set: each pod gets 1x {DEFAULT_GPU} ({why})")
        if not is_cluster(plan) and nodes > 1:
            say(f"Global Networking links the pods at {GLOBAL_LINK}: {cross_node_traffic(plan)}")
        warning = self.shared_storage_warning(plan)
        if warning:
            say(f"warning: {warning}")

    def _confirm(self, plan: Plan) -> None:
        if self.chosen.get("y"):
            return
        if not sys.stdin.isatty():
            raise BadInput("-y: creating the pods needs your confirmation of the price, and stdin is not a terminal; "
                           "pass -y to create them without asking")
        try:
            answer = input("create them? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            raise StepFailed("confirming the price", "not confirmed: nothing was created")

    def _members(self, client, plan: Plan, pod_ids: list[str] | None, cluster_id: str | None) -> list[dict]:
        """The pods, head (rank 0) first."""
        if cluster_id is None:
            return [client.get_pod(pod_id) for pod_id in pod_ids]
        pods = client.cluster_pods(cluster_id)
        ranks = [(pod.get("cluster") or {}).get("rank") for pod in pods]
        return [pod for _, pod in sorted(zip(ranks, pods), key=lambda item: (item[0] is None, item[0] or 0))]

    def _wait_running(self, client, plan: Plan, pod_ids: list[str] | None = None,
                      cluster_id: str | None = None) -> list[dict]:
        """Show each pod's way PROVISIONING -> STARTING -> RUNNING; the pods once all run (the
        head's SSH endpoint known, for submit: client)."""
        shown: dict[str, str] = {}
        client_mode = plan.job.submit == "client"

        def check():
            pods = self._members(client, plan, pod_ids, cluster_id)
            for pod in pods:
                status = pod["status"]
                if shown.get(pod["id"]) != status:
                    extra = ""
                    if status == "RUNNING":
                        net = pod.get("globalNetworking") or {}
                        member = pod.get("cluster") or {}
                        if net.get("internalDns"):
                            extra = f", {net['internalDns']} ({net.get('ip')})"
                        elif member.get("ip"):
                            extra = f", rank {member.get('rank')}, overlay {member['ip']}"
                    say(f"pod {pod['name']} ({pod['id']}): {shown.get(pod['id'], 'created')} -> {status}{extra}")
                    shown[pod["id"]] = status
                if status in ENDED:
                    raise StepFailed(f"starting pod {pod['name']}", f"it is {status} before the job started")
            running = sum(1 for pod in pods if pod["status"] == "RUNNING")
            if cluster_id and len(pods) < plan.nodes:
                return False, f"{len(pods)}/{plan.nodes} cluster pods known"
            if running < len(pods):
                return False, f"{running}/{len(pods)} pods RUNNING"
            if client_mode and not (pods[0].get("ssh") or {}).get("direct"):
                return False, "the head pod's SSH endpoint is not published yet"
            return True, pods

        return wait_for(f"{plan.nodes} RunPod pods to run", check, plan.wait.head_s, interval=0.5, max_interval=3.0,
                        report=say)

    def _undo(self, client, name: str, fresh: bool) -> str:
        """Terminate every pod (and cluster) this launch created; forget its token and staged files."""
        try:
            said = self._terminate(client, name)
        except Exception as exc:  # noqa: BLE001 - say it; the user must look
            said = f"could not terminate its pods ({exc}): run `rlhf-tasks down {name}`"
        shutil.rmtree(state.run_dir(name) / self.name, ignore_errors=True)
        if fresh:
            state.forget(name)
        else:
            state.end(name)
        return said

    # ------------------------------------------------------------------ following the job

    def _save_logs(self, client, pod: dict, path: Path, stop: threading.Event) -> None:
        """Append a pod's log to a file until the pod ends or `stop` (a daemon thread)."""
        def run():
            try:
                with open(path, "a") as out:
                    for item in client.pod_logs(pod["id"], tail=5000, stop=stop):
                        out.write((item.line if item.source == "container" else
                                   f"[runpod {pod['name']}] {item.line}") + "\n")
                        out.flush()
            except Exception as exc:  # noqa: BLE001 - the file says why it ends
                with open(path, "a") as out:
                    out.write(f"[rlhf-tasks] the log stream ended: {exc}\n")
        threading.Thread(target=run, name=f"runpod-log-{pod['id']}", daemon=True).start()

    def _logs_dir(self, name: str, members: list[dict], skip_head: bool, client) -> tuple[Path, threading.Event]:
        logs = state.run_dir(name) / "nodes"
        logs.mkdir(parents=True, exist_ok=True)
        for old in logs.glob("node-*.log"):
            old.unlink()
        stop = self._log_stops[name] = threading.Event()
        for rank, pod in enumerate(members):
            if rank or not skip_head:
                self._save_logs(client, pod, logs / f"node-{rank}.log", stop)
        return logs, stop

    def _follow(self, client, plan: Plan, members: list[dict], token: str | None, started: float, fit: dict) -> Cluster:
        """Stream the head pod's log (the head agent prints the job's log) until its result line:
        the job's end. The dashboard is never exposed."""
        head = members[0]
        logs, stop = self._logs_dir(plan.name, members, skip_head=True, client=client)
        say(f"following the head pod {head['name']}'s log (Ctrl-C stops following; the pods keep running)")
        budget = plan.wait.head_s + plan.wait.nodes_s + (plan.job.timeout_s or 0) + 600
        timer = threading.Timer(budget, stop.set) if plan.job.timeout_s else None
        if timer:
            timer.daemon = True
            timer.start()
        result = None
        try:
            with open(logs / "node-0.log", "a") as out:
                for item in client.pod_logs(head["id"], tail=5000, stop=stop):
                    line = item.line if item.source == "container" else f"[runpod {head['name']}] {item.line}"
                    out.write(line + "\n")
                    out.flush()
                    if item.line.startswith(RESULT_PREFIX):  # for the launcher: the summary says it
                        result = parse_result(item.line)
                        break
                    if item.source == "container":
                        print(item.line, flush=True)
                    else:
                        say(f"runpod: {head['name']}: {item.line}")
        finally:
            if timer:
                timer.cancel()
        if result is None:
            why = (f"no result after {budget:.0f}s" if stop.is_set() else "the head pod's log ended without the "
                   "agent's result line")
            stop.set()
            raise StepFailed(f"following the head pod {head['name']}", f"{why} (its log: {logs / 'node-0.log'})")
        return self._finish(plan, members, token, started, fit, result, logs)

    def _finish(self, plan: Plan, members: list[dict], token, started: float, fit: dict, result: dict,
                logs: Path) -> Cluster:
        job = result.get("job") or {}
        status, sid = job.get("status"), job.get("submission_id")
        code = result.get("exit_code")
        if code is None:  # the head keeps the cluster (launch --keep): the job's status decides
            code = 0 if status == "SUCCEEDED" else 1
        state.update(plan.name, job={"submission_id": sid, "status": status})
        elapsed = time.monotonic() - started
        lines = [f"job {sid}: {status or 'not run'} in {elapsed:.0f}s wall time"]
        attempts = job.get("attempts") or []
        if len(attempts) > 1:
            lines.append(f"attempts: {len(attempts)} (" + "; ".join(
                f"{a['submission_id']} {a['status'] or 'stopped'}" + (f": {a['cause']}" if a.get("cause") else "")
                for a in attempts) + ")")
        if result.get("error"):
            lines.append(f"failed: {result['error']}")
        said = job_said(result.get("job_log_tail") or "")
        if said:
            lines.append(f"the job's last line: {said}")
        steps = ", ".join(f"{s['step']} {s['seconds']:.0f}s" for s in result.get("steps") or [])
        if steps:
            lines.append(f"head steps: {steps}")
        price = f", about ${fit['price'] * plan.nodes * elapsed / 3600:.2f} so far" if fit.get("price") else ""
        lines.append(f"pods: {len(members)} x {fit['count']}x {fit['gpu']} in {members[0].get('dataCenterId')}{price}")
        if plan.checkpoint_dir:
            lines.append(f"checkpoints: {plan.checkpoint_dir}" + ("" if plan.checkpoint_shared else
                                                                   " (on each pod's disk)"))
        lines.append(f"node logs: {logs}")
        print("\n== summary ==\n" + "\n".join("  " + line for line in lines), flush=True)
        if plan.keep_cluster:
            say(f"the pods keep running: `rlhf-tasks status {plan.name}`, `rlhf-tasks down {plan.name}` "
                f"terminates them")
        if code:
            print(f"failed: {result.get('error') or f'job {sid} ended {status}'}", file=sys.stderr, flush=True)
        return Cluster(name=plan.name, cluster_id=members[0]["id"], dashboard="", token=token,
                       head_alive=lambda: False, logs_dir=str(logs), finished=code)

    def _client_cluster(self, client, plan: Plan, members: list[dict], token, directory: Path) -> Cluster:
        """submit: client: the launcher reaches the head's 127.0.0.1 dashboard through `ssh -L` to the
        head pod's direct SSH endpoint; the pods' logs go to files the launcher echoes."""
        head = members[0]
        direct = head["ssh"]["direct"]
        tunnel = SshTunnel(direct, plan.ray.dashboard_port, directory / "ssh-tunnel.log")
        self._tunnels[plan.name] = tunnel
        tunnel.start()
        dashboard = f"http://127.0.0.1:{tunnel.local_port}"
        say(f"forwarding the head's dashboard to {dashboard} through ssh {direct['username']}@{direct['host']} "
            f"-p {direct['port']} (after this launch: rlhf-tasks forward {plan.name})")
        # Where `rlhf-tasks forward NAME` puts it, for `env`, `list --cluster` and `submit` later.
        state.update(plan.name, dashboard=f"http://127.0.0.1:{plan.ray.dashboard_port}")
        logs, _ = self._logs_dir(plan.name, members, skip_head=False, client=client)
        checked = {"at": 0.0, "alive": True}

        def head_alive() -> bool:
            if parse_result(_read(logs / "node-0.log")) is not None:
                return False  # the head agent has ended
            if time.monotonic() - checked["at"] > 3:
                checked["at"] = time.monotonic()
                try:
                    checked["alive"] = client.get_pod(head["id"])["status"] not in ENDED
                except Exception:  # noqa: BLE001 - unknown is not dead
                    pass
            return checked["alive"]

        return Cluster(name=plan.name, cluster_id=head["id"], dashboard=dashboard, token=token, head_alive=head_alive,
                       head_log=lambda: _read(logs / "node-0.log"), logs_dir=str(logs), tend=tunnel.tend)

    # ------------------------------------------------------------------ status, forward, down

    def status(self, name: str) -> str:
        client = self._client()
        pods, clusters = self._find(client, name)
        lines = [f"Instant Cluster {c['name']} ({c['id']}) in {c.get('dataCenterId')}: "
                 + ", ".join(f"{n} {s}" for s, n in (c.get("pods") or {}).get("byStatus", {}).items())
                 for c in clusters]
        for cluster in clusters:
            pods += client.cluster_pods(cluster["id"])
        for pod in pods:
            net = (pod.get("globalNetworking") or {}).get("internalDns") or (pod.get("cluster") or {}).get("ip") or ""
            lines.append(f"{pod['name']}\t{pod['id']}\t{pod['status']}\t{pod.get('dataCenterId')}\t"
                         f"${pod.get('cost') or 0:.2f}/h\t{net}".rstrip())
        return "\n".join(lines) or f"no RunPod pods or cluster named {name}"

    def forward(self, name: str, port: int | None = None) -> int:
        """Open the head's dashboard on 127.0.0.1:PORT through ssh, until Ctrl-C."""
        client = self._client()
        pods, clusters = self._find(client, name)
        for cluster in clusters:
            pods = [p for p in client.cluster_pods(cluster["id"]) if (p.get("cluster") or {}).get("rank") == 0]
        head = next((p for p in pods if p["name"] == f"{name}-head" or p.get("cluster")), None)
        if head is None:
            raise StepFailed(f"forwarding {name}'s dashboard", f"RunPod has no head pod of {name}")
        direct = (head.get("ssh") or {}).get("direct")
        if not direct:
            raise StepFailed(f"forwarding {name}'s dashboard", f"the head pod {head['id']} ({head['status']}) has no "
                             f"direct SSH endpoint: only a task with job.submit: client gets one (22/tcp, startSsh)")
        record = state.load(name) or {}
        remote = record.get("dashboard_port") or 8265
        local = port or remote
        dashboard = f"http://127.0.0.1:{local}"
        state.update(name, dashboard=dashboard)
        argv = ssh_argv(direct, local, remote)
        say(f"the dashboard of {name} is at {dashboard} (Ctrl-C closes the tunnel); in another shell: "
            f"eval \"$(rlhf-tasks env {name})\", rlhf-tasks submit TASK --address {dashboard}, "
            f"rlhf-tasks logs JOB --cluster {name}")
        try:
            return subprocess.run(argv, stdin=subprocess.DEVNULL).returncode
        except KeyboardInterrupt:
            return 0

    def _terminate(self, client, name: str, timeout: float = 300) -> str:
        """Terminate this task's pods and delete its cluster; wait until they are gone."""
        from .api import RunPodError, RunPodNotFound

        started = time.monotonic()
        pods, clusters = self._find(client, name)
        members = []
        for cluster in clusters:
            members += [p["id"] for p in client.cluster_pods(cluster["id"])]
            client.delete_cluster(cluster["id"])
        for pod in pods:
            if pod["status"] == "TERMINATED":
                continue
            try:
                client.pod_action(pod["id"], "terminate")
            except RunPodNotFound:
                pass
            except RunPodError as exc:
                if exc.status != 409:  # 409: it is already on its way out
                    raise
        waiting = [p["id"] for p in pods] + members

        def gone():
            left = []
            for pod_id in waiting:
                try:
                    if client.get_pod(pod_id)["status"] != "TERMINATED":
                        left.append(pod_id)
                except RunPodNotFound:
                    pass
            for cluster in clusters:
                try:
                    client.get_cluster(cluster["id"])
                    left.append(cluster["id"])
                except RunPodNotFound:
                    pass
            return not left, f"still there: {', '.join(left)}"

        wait_for(f"RunPod to terminate {name}'s pods", gone, timeout, interval=0.5, max_interval=5.0, report=say)
        what = []
        if pods:
            what.append(f"terminated {len(pods)} pod(s) ({', '.join(p['id'] for p in pods)})")
        if clusters:
            what.append(f"deleted Instant Cluster {', '.join(c['id'] for c in clusters)} ({len(members)} pods)")
        return (" and ".join(what) or f"no RunPod pods or cluster named {name} were left") + \
            f" in {time.monotonic() - started:.1f}s"

    def down(self, name: str) -> str:
        from .api import RunPodError

        client = self._client()
        tunnel = self._tunnels.pop(name, None)
        if tunnel is not None:
            tunnel.close()
        try:
            said = self._terminate(client, name)
        except (RunPodError, AgentError) as exc:
            raise StepFailed(f"terminating {name} on RunPod", str(exc)) from None
        finally:
            stop = self._log_stops.pop(name, None)
            if stop is not None:
                stop.set()
        state.end(name)
        return f"{name}: {said}"

    def abandon(self, name: str, fresh: bool) -> None:
        """A launch that failed before its job: terminate every pod it created, then forget it."""
        try:
            self._terminate(self._client(), name)
        except Exception as exc:  # noqa: BLE001 - say it; the user must look
            say(f"could not terminate {name}'s pods ({exc}): run `rlhf-tasks down {name}`")
        super().abandon(name, fresh)


def job_said(log: str) -> str | None:
    """The job's own last line: not Ray's log records nor its worker-prefixed lines."""
    for line in reversed(log.splitlines()):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if line and not line.startswith("(") and not re.match(r"^\d{4}-\d\d-\d\d \d", line):
            return line
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ssh_argv(direct: dict, local_port: int, remote_port: int) -> list[str]:
    """`ssh -N -L` to a pod's direct SSH endpoint. Pods are short-lived with new host keys, so
    they are not checked nor kept (RunPod's own advice); your keys come from your ssh setup."""
    return ["ssh", "-N", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ServerAliveInterval=15",
            "-o", "ConnectTimeout=10", "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}",
            "-p", str(direct["port"]), f"{direct['username']}@{direct['host']}"]


class SshTunnel:
    """`ssh -L` to the head pod, started again while it fails to connect (the pod's sshd may
    come up after the pod is RUNNING); a refused key is a failure at once."""

    def __init__(self, direct: dict, remote_port: int, log: Path):
        self.direct, self.remote_port, self.log = direct, remote_port, log
        self.local_port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.failures = 0
        self.reported = 0.0

    def start(self) -> None:
        self._spawn()
        threading.Thread(target=self._keep, name="runpod-ssh-tunnel", daemon=True).start()
        atexit.register(self.close)

    def _spawn(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(ssh_argv(self.direct, self.local_port, self.remote_port),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def _keep(self) -> None:
        while not self.closed.wait(1.0):
            with self.lock:
                if not self.closed.is_set() and self.proc is not None and self.proc.poll() is not None:
                    self.failures += 1
                    self._spawn()

    def tend(self) -> list[str]:
        """For the launcher's waits: a refused key ends the launch; other failures are reported."""
        said = _read(self.log)
        if "Permission denied" in said:
            raise StepFailed("forwarding the dashboard through ssh", f"ssh {self.direct['username']}@"
                             f"{self.direct['host']} -p {self.direct['port']}: Permission denied (publickey): the pod "
                             f"has your RunPod account's SSH keys (startSsh); use the matching private key "
                             f"(ssh-agent or ~/.ssh/config)")
        if self.failures and time.monotonic() - self.reported > 15:
            self.reported = time.monotonic()
            last = [line for line in said.splitlines() if line.strip()][-1:] or ["no message"]
            return [f"ssh tunnel to the head: {self.failures} attempt(s) failed so far (last: {last[0]}); retrying"]
        return []

    def close(self) -> None:
        with self.lock:
            self.closed.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
