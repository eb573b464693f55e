"""RunPod: pods with Global Networking (`network: runpod-global`, the OpenRLHF-M guide's
setup; also `auto` and `ethernet`) or one Instant Cluster (`network: runpod-cluster`),
through RunPod's REST API v2 (`api.py`, its client).

`render` (pure) writes the create requests as JSON, exactly the bodies `launch` sends but for
the head pod's id and the data center, each secret (the task's and the Ray token) a reference to
an account secret in RunPod's vault (`{{ RUNPOD_SECRET_rlhf-tasks.NAME.VARIABLE }}`, which RunPod
substitutes when a pod boots: `launch` creates them, `down` deletes them; vault.py), and `NAME.start.sh`, which carries the node agent and the
plan inside itself (heredocs) and starts the agent; the requests pass it through the pod's
`args` (xz, then gzip and base64 in a `bash -c`, the way SkyPilot ships its start script to RunPod).

Pods: the head first, then the workers, all in one data center whose catalog entry says
`globalNetwork`; nodes find each other by the guide's variables (RAY_WORKER, HEAD_POD_ID,
EXPECTED_WORKERS) and reach each other as `<podId>.runpod.internal`. An Instant Cluster sets
NODE_RANK, NUM_NODES, PRIMARY_ADDR, NODE_ADDR, NUM_TRAINERS itself; the agent finds the
interface that holds NODE_ADDR (ens1 today) for NCCL and Gloo.

`launch` checks the GPU type and the data center against the catalog before it creates
anything, shows the price, asks (unless -y), creates, shows the pods' progress, and then
streams every pod's log into a file the launcher follows (the head agent prints the job's
log and its result line in the head's), without exposing the dashboard. With `submit: client` the head gets
SSH (`22/tcp`, `startSsh`) and the launcher reaches the dashboard through `ssh -L`, which
`rlhf-tasks forward NAME` opens again later. Pods are named `<task>-head`,
`<task>-worker-<k>` (the cluster `<task>`); `status` and `down` find them by those names and
touch nothing else in the account. The launcher terminates them after the job (they bill
by the hour) unless `launch --keep`.

The package, by concern: `render` (pure: contracts, presets, the task's checks, the start
script and the create requests), `api` (the REST v2 client), `catalog` (GPU type, data
centers and price, before anything is created), `vault` (the secrets, as RunPod account
secrets the pods reference), `pods` (creating, waiting, finding,
status, terminating), `logs` (the pods' logs and following the job); this module wires
them into the provider. The ssh tunnel is shared by providers (`providers/ssh.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from typing import Any

from ... import state
from ...agent.protocol import AgentError
from ...console import say
from ...errors import BadInput, StepFailed
from ...plan import Plan, build_plan, env
from ...spec import Task
from ..base import Cluster, Option, Provider, write_files
from ..ssh import SshTunnel, ssh_argv
from . import catalog, logs, pods
from .api import RunPodAuthError, RunPodClient, RunPodError
from .render import (CLUSTER_CONTRACT, CLUSTER_PRESET, GLOBAL_PRESET, IGNORES, MACHINE_PRICE, NAME, NODE_DIR,
                     POD_CONTRACT, SELF_END, SHARING, MAX_ARGS, check, disk_note, is_cluster, pack, shm_warning,
                     start_args, start_script, too_big_to_ship, weight_sync_warning)
from .render import render as render_files


class RunPodProvider(Provider):
    name = NAME
    shared_option = "checkpoints.shared.runpod: {network_volume: ID}"
    sharing = SHARING
    contract = POD_CONTRACT
    networks = {"runpod-global": GLOBAL_PRESET, "runpod-cluster": CLUSTER_PRESET}
    renders_groups = True  # pods per group in one Global Networking group, ranks by group (render.bodies)
    options = (Option("-y", "create the pods without asking to confirm their price"),)
    stop_after_job = True  # pods bill by the hour: the launcher terminates them after the job unless --keep
    #: (MACHINE_PRICE: the head reads its pod's `cost`; pods.billed: the launcher sums the pods')
    price_source = ("RunPod's billed pod `cost` once the pods run, its catalog's list price where RunPod gives none "
                    "(the launcher shows the catalog's and asks before it creates anything)")
    ignores = IGNORES

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._tunnels: dict[str, SshTunnel] = {}
        self._log_stops: dict[str, threading.Event] = {}
        #: Task name -> job.working_dir as the task names it, when it ships one (build), and its packed archive.
        self._named_working_dir: dict[str, str] = {}
        self._archives: dict[str, bytes] = {}

    # ------------------------------------------------------------------ pure: check, plan, render

    def check(self, task: Task) -> None:
        check(task)

    def build(self, task: Task) -> Plan:
        """The plan, with the contract of the task's network mode: Instant Cluster or pods. A
        job.working_dir the task names, with `submit: head`, is shipped in the start command
        (measure_upload packs it): on the pods the head submits from where it is unpacked, `.`."""
        contract = CLUSTER_CONTRACT if is_cluster(task) else POD_CONTRACT.model_copy(
            update={"nodes": env("EXPECTED_WORKERS", plus=1, default=str(task.nodes))})
        plan = build_plan(task, self.name, contract, self.networks, self.default_checkpoint_dir(task),
                          self.ray_overrides, priced=True)
        # the catalog's at launch; the head counts its pod's billed `cost` where RunPod gives it (MACHINE_PRICE)
        plan = plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": None,
                                                                  "machine_price": MACHINE_PRICE}))
        self._named_working_dir.pop(task.name, None)
        if plan.job.submit == "head" and plan.job.working_dir and "working_dir" in task.job.model_fields_set:
            self._named_working_dir[task.name] = plan.job.working_dir
            plan = plan.replace(job=plan.job.model_copy(update={"working_dir": "."}))
        elif plan.job.submit == "head" and plan.job.working_dir:  # the default ".", not shipped: none on the pods
            plan = plan.replace(job=plan.job.model_copy(update={"working_dir": None}))
        return plan if is_cluster(task) else plan.replace(self_end=SELF_END)

    def measure_upload(self, plan: Plan) -> Plan:
        """`submit: client`: job.working_dir uploaded from here (measured as everywhere); `submit: head`:
        the one the task names packed for the start command, refused when it would not fit there."""
        plan = super().measure_upload(plan)
        self._archives.pop(plan.name, None)
        local = self._named_working_dir.get(plan.name)
        if local is not None:
            from ... import workdir

            workdir.check(local, plan.job.excludes)  # a directory, and under Ray's own limit
            archive = pack(local, plan.job.excludes)
            size = len(start_args(start_script(plan, archive)))
            if size > MAX_ARGS:  # refused here, at check, rather than at render or launch
                raise BadInput(too_big_to_ship(local, archive, size))
            self._archives[plan.name] = archive
        return plan

    def working_dir_words(self, plan: Plan) -> str | None:
        if plan.job.mode != "ray" or plan.job.submit != "head":
            return None
        local, archive = self._named_working_dir.get(plan.name), self._archives.get(plan.name)
        if local is not None and archive is not None:
            return (f"{local}, shipped in the pods' start command ({len(archive) // 1024 + 1} KiB tar.gz) and unpacked "
                    f"in {NODE_DIR}/workdir on each pod, where the head submits the job with it (Ray's working_dir)")
        return (f"none shipped: the job runs in an empty directory of the head pod ({NODE_DIR}/workdir); name "
                f"job.working_dir to ship a small one in the start command, or use job.submit: client")

    def notes(self, plan: Plan) -> list[str]:
        """Besides the shared-storage warning: what RunPod does not apply (shm_size), how it rounds the disk,
        and what Global Networking's 100 Mbit/s costs a recipe that syncs weights between pods."""
        return [*super().notes(plan), *filter(None, (shm_warning(plan), disk_note(plan), weight_sync_warning(plan)))]

    def shared_storage_warning(self, plan: Plan) -> str | None:
        if not plan.unshared_checkpoints:
            return None
        nodes = f"the {plan.nodes} pods do not share it, and " if plan.nodes > 1 else ""
        return (f"checkpoints {plan.checkpoint_dir} is on each RunPod pod's own disk: {nodes}resume works only on "
                f"the head, and only while its pod lives (the launcher terminates the pods after the job); add "
                f"checkpoints.shared.runpod: {{network_volume: ID}} (a RunPod network volume)")

    def render(self, plan: Plan) -> dict[str, str]:
        return render_files(plan, self._archives.get(plan.name))

    # ------------------------------------------------------------------ launch

    def _client(self) -> RunPodClient:
        try:
            import httpx  # noqa: F401 - the client's transport, checked before anything is done
        except ImportError:
            raise BadInput("--provider runpod: the httpx package is not installed; "
                           "pip install 'rlhf-tasks[runpod]'") from None
        if not os.environ.get("RUNPOD_API_KEY"):
            raise BadInput("RUNPOD_API_KEY is not set: create an API key in RunPod's console (Settings, API Keys) "
                           "and export RUNPOD_API_KEY")
        return RunPodClient.from_env(progress=say)

    def ready(self, plan: Plan) -> None:
        self._client()

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """Check against the catalog, confirm the price, create, and hand the launcher the pods'
        logs. Whatever fails (or Ctrl-C) before the pods run terminates every pod this launch created."""
        client = self._client()
        try:
            fit = catalog.fit_groups(client, plan) if plan.groups and not is_cluster(plan) else \
                catalog.fit(client, plan.for_group(plan.groups[0]) if plan.groups else plan)
            found_pods, found_clusters = pods.find(client, plan.name)
        except RunPodAuthError as exc:
            raise BadInput(str(exc)) from None
        except RunPodError as exc:
            raise StepFailed("checking RunPod's catalog", str(exc)) from None
        if fit.get("price"):  # the catalog's price, which the head counts where RunPod gives no `cost` of its pod
            plan = plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": fit["price"] * plan.nodes}))
        elif plan.budget.max_cost is not None:
            raise BadInput(f"placement.max_cost: RunPod's catalog gives no price for {fit['gpu']}, so the head agent "
                           f"could not count the cost; use placement.max_duration")
        if fit.get("groups"):  # the head reads only its own pod's cost: the groups' pods differ, so the catalog's sum
            plan = plan.replace(budget=plan.budget.model_copy(update={"machine_price": None}))
        files = render_files(plan, self._archives.get(plan.name), fit["gpu"], fit.get("gpus"))
        requests = json.loads(files[f"{plan.name}.runpod.json"])
        if found_pods or found_clusters:
            found = ", ".join(f"{p['name']} ({p['id']}, {p['status']})" for p in found_pods) or \
                ", ".join(f"cluster {c['name']} ({c['id']})" for c in found_clusters)
            raise BadInput(f"name: RunPod already has {found} for {plan.name}; `rlhf-tasks down {plan.name}` first")
        if plan.job.submit == "client" and shutil.which("ssh") is None:
            raise BadInput("job.submit: client on RunPod forwards the dashboard through ssh, and the `ssh` command "
                           "is not installed here")
        catalog.announce(plan, fit, self.shared_storage_warning(plan))
        catalog.confirm(bool(self.chosen.get("y")))

        before = self.before_launch(plan.name)
        directory = state.run_dir(plan.name) / self.name
        write_files(directory, files)
        token = state.new_token(plan.name) if plan.token_env else None
        values = {**secrets, **({plan.token_env: token} if token else {})}
        mode = "cluster" if is_cluster(plan) else "pods"
        state.save(plan.name, {"provider": self.name, "mode": mode, "cluster_id": None, "dashboard": None,
                               "dashboard_port": plan.ray.dashboard_port, "pods": []})
        with pods.Launching(client, plan.name, before) as launching:
            members = pods.create(client, plan, requests, values, fit["datacenters"], launching)
            price, said = pods.billed(members, fit["price"])
            say(said)
            differs = pods.head_counts(members, price)
            if differs:
                say(f"warning: {differs}")
            if price is not None:  # what the launcher counts (its progress line, `ps`); the head reads its own
                plan = plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": price}))
            return logs.cluster(client, plan, members, token, directory, fit, self._tunnels, self._log_stops)

    # ------------------------------------------------------------------ status, forward, down

    def status(self, name: str) -> str:
        return pods.status(self._client(), name)

    def forward(self, name: str, port: int | None = None) -> int:
        """Open the head's dashboard on 127.0.0.1:PORT through ssh, until Ctrl-C."""
        direct = pods.head_ssh(self._client(), name)
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

    def down(self, name: str) -> str:
        client = self._client()
        tunnel = self._tunnels.pop(name, None)
        if tunnel is not None:
            tunnel.close()
        try:
            said = pods.terminate(client, name)
        except (RunPodError, AgentError) as exc:
            raise StepFailed(f"terminating {name} on RunPod", str(exc)) from None
        finally:
            stop = self._log_stops.pop(name, None)
            if stop is not None:
                stop.set()
        state.end(name)
        return f"{name}: {said}"
