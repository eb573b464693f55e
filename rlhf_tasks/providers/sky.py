"""SkyPilot: one task YAML with `num_nodes: N`, launched with `sky launch` (a cluster)
or `sky jobs launch` (a managed job that SkyPilot recovers).

SkyPilot runs its own Ray on every node (GCS 6380, dashboard 8266, dashboard agent
52365, object manager 8076, client server 10001 on its head, workers on 11002-19999 on its
head and Ray's default 10002-19999 on the others: sky/provision/instance_setup.py), so ours
takes other ports, its workers included, and is never stopped machine-wide. SkyPilot's
command runner exports OMP_NUM_THREADS=1 and PYTHONWARNINGS=ignore before its `ray start`,
and its job hands them on to the task over the task's own envs (log_lib.add_ray_env_vars):
`run` puts back the task's value or unsets them, so that our Ray gives each of its workers
Ray's own default. `setup` runs the task's setup commands; `run` starts the node agent,
which reads SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS and SKYPILOT_NUM_NODES. Secrets and the
Ray token are `secrets:` with null values, filled by `sky launch --secret NAME` from the
local environment.

`sky launch` resolves `file_mounts` sources and `workdir` against the directory it runs
from, which the header names: the directory of the rendered file, so both are written
relative to it. The task's job.working_dir (with `submit: head`) is SkyPilot's `workdir`,
synced to ~/sky_workdir on every node, where SkyPilot's run script starts `run`; the head
submits the job from there.

Checkpoints go to a directory on each node unless the task names shared storage in
`checkpoints.shared.sky`: a bucket mounted at the path, or a SkyPilot volume. The
shared-memory size reaches the container as `docker run --shm-size` when the task has an
image; a VM without one keeps its own /dev/shm (the rendered file says so).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .. import state, workdir
from ..agent.protocol import probe_tcp
from ..errors import BadInput, StepFailed
from ..models import StrictModel, size_bytes, size_text
from ..agent.protocol.ports import free_port
from ..plan import Contract, Plan, env
from ..gpu_spec import gpu_gb, gpu_parts
from ..spec import Task
from .base import (AMD_CONTAINER_OPTIONS, Cluster, Option, Provider, Retries, Sharing, docker_size, end_process,
                   hold_forward, require_cli, stop_with_cli, write_files)
from .shipping import LOCAL_DIR, NODE_DIR, agent_command, dump_yaml, shared_entry, shipped_files

#: Ports SkyPilot's own Ray uses on every node (sky/provision/instance_setup.py, and `ray start`'s
#: defaults for what it leaves out): ours must never collide.
RESERVED_PORTS = {6380: "SkyPilot's Ray GCS", 8266: "SkyPilot's Ray dashboard", 52365: "SkyPilot's dashboard agent",
                  8076: "SkyPilot's Ray object manager", 10001: "SkyPilot's Ray client server"}
#: SkyPilot's Ray workers: 11002-19999 on its head, Ray's default 10002-19999 on the other nodes.
SKYPILOT_WORKER_PORTS = (10002, 19999)
#: Our dashboard agent must not take SkyPilot's 52365.
AGENT_LISTEN_PORT = 52366
#: Ray's own layout moved up by 10000: our client server (unless the task names one) and our workers.
CLIENT_SERVER_PORT = 20001
WORKER_PORTS = (20002, 22999)
#: What SkyPilot's command runner exports before its `ray start`, which its job hands to the task.
LEAKED_ENV = ("OMP_NUM_THREADS", "PYTHONWARNINGS")
#: Where SkyPilot syncs the task's `workdir` on every node, and where its run script starts `run`.
SKY_WORKDIR = "~/sky_workdir"
#: Where `sky` starts its local API server by default.
API_SERVER_PORT = 46580
#: How long the dashboard's ssh forward may take to be up: SkyPilot's ssh config for a cluster may go
#: through its API server and the site (on Slurm: a websocket proxy, ssh to the login node, then
#: `srun --overlap ... sshd -i` in the cluster's job).
FORWARD_TIMEOUT_S = 120


#: A GPU name with its memory as a suffix, in any of the forms a task may write (A100-80G, A100-80GiB,
#: V100_32GB): SkyPilot's catalog spells it NAME-<N>GB (A100-80GB, V100-32GB: its common/accelerators.csv).
_GPU_MEMORY_SUFFIX = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9._-]*?)[-_](?P<memory>\d+)\s*G(?:i?B)?$", re.IGNORECASE)
#: Clouds whose accelerator names are the cluster's own (a Kubernetes node label, a Slurm gres), not the catalog's.
OWN_NAMES = {"kubernetes", "ssh", "slurm"}


def sky_gpu(gpus: str) -> str:
    """`resources.gpus` in SkyPilot's words: `A100-80G:8` -> `A100-80GB:8`; other names as given. By memory, as
    SkyPilot takes it (Resources._parse_accelerators_from_str: `80GB:8` any GPU of exactly 80GB, `24GB+:1` of at
    least 24GB, resolved to the names of its catalog's common/metadata.csv by
    accelerator_registry.get_devices_by_memory); `A100:80GB:8` -> `A100-80GB:8`, the catalog's spelling of a
    memory variant. sky_gpu_refusal says what SkyPilot has no words for."""
    if gpus.isdigit():
        return gpus
    name, memory, count = gpu_parts(gpus)
    if memory:
        low, high = memory
        size = f"{math.ceil((low or 0) / 10**9)}GB"  # whole GB: sky_gpu_refusal refuses others
        return f"{name}-{size}:{count}" if name else f"{size}{'' if low == high else '+'}:{count}"
    match = _GPU_MEMORY_SUFFIX.match(name)
    if match:
        name = f"{match.group('name')}-{match.group('memory')}GB"
    return f"{name}:{count}" if ":" in gpus else name


def sky_gpu_refusal(gpus: str | None) -> str | None:
    """Why SkyPilot cannot be asked for `resources.gpus` as the task gives it, or None: its accelerators
    take a memory in whole GB (its pattern `^[0-9]+[GgMmTt][Bb]\\+?$`; its catalog's figures are whole, so
    at least 25.8GB is at least 26GB), exactly or at least, never at most (Resources._parse_accelerators_from_str),
    and with a GPU's name only as the catalog's NAME-<N>GB."""
    if not gpus or gpus.isdigit():
        return None
    name, memory, _ = gpu_parts(gpus)
    if not memory:
        return None
    low, high = memory
    if high is not None and low != high:
        return (f"SkyPilot takes a GPU memory exactly (80GB:8) or at least (24GB..:1 -> 24GB+:1), not at most "
                f"(Resources._parse_accelerators_from_str): write {gpu_gb(low) + '..' if low else 'a lower bound'}, "
                f"or name the GPU")
    if low % 10**9 and low == high:
        return (f"SkyPilot takes a GPU memory in whole GB (its catalog lists each GPU's, 80 for an A100 80GB): "
                f"{gpu_gb(low)} is not; write {math.ceil(low / 10**9)}GB")
    if name and low != high:
        return f"SkyPilot names a GPU's memory variant exactly (A100-80GB), not by a range: write {name}:{gpu_gb(low)}"
    if name and _GPU_MEMORY_SUFFIX.match(name):
        return f"the memory given twice, in the name {name} and as {gpu_gb(low)}: give one"
    return None


def _catalog_path(name: str) -> Path:
    """Where SkyPilot keeps its catalog's `name` (sky/catalog/common.py get_catalog_path), read at call time
    (SkyPilot reads SKY_RUNTIME_DIR at import)."""
    from sky.skylet import constants, runtime_utils

    return Path(runtime_utils.get_runtime_dir_path(
        os.path.join(".sky/catalogs", constants.CATALOG_SCHEMA_VERSION, name)))


def _catalog_memory() -> dict[str, float]:
    """SkyPilot's common/metadata.csv as GPU -> MemoryGB, where it is on this machine (else empty)."""
    import csv

    path = _catalog_path("common/metadata.csv")
    if not path.is_file():
        return {}
    with path.open(newline="") as handle:
        return {row["GPU"]: float(row["MemoryGB"]) for row in csv.DictReader(handle)}


def devices_by_memory(gpus: str) -> list[str] | None:
    """The GPUs SkyPilot takes for a memory-only `resources.gpus` (`80GB:8`, `24GB..:1`), in the order of its
    catalog: what accelerator_registry.get_devices_by_memory selects from common/metadata.csv (MemoryGB equal,
    or at least with `+`), read here as a file where SkyPilot has put it (None where not: its reader would
    fetch it)."""
    table = _catalog_memory()
    if not table:
        return None
    memory = sky_gpu(gpus).partition(":")[0]
    plus, size = memory.endswith("+"), int(memory.rstrip("+").removesuffix("GB"))
    return [gpu for gpu, listed in table.items() if (listed >= size if plus else listed == size)]


def _catalog_accelerators() -> dict[str, list[str]] | None:
    """SkyPilot's accelerator catalog (common/accelerators.csv: name -> clouds) where it is on this
    machine; None where it is not. SkyPilot ships no catalog: read_catalog (sky/catalog/common.py)
    fetches it from GitHub on first use into ~/.sky/catalogs/<schema>/, so it is read here as a file,
    never through SkyPilot's reader, which would fetch it."""
    import ast
    import csv

    path = _catalog_path("common/accelerators.csv")
    if not path.is_file():
        return None
    with path.open(newline="") as handle:
        return {row["AcceleratorName"]: [c.lower() for c in ast.literal_eval(row["Clouds"])]
                for row in csv.DictReader(handle)}


def optimizer_price(config: dict) -> tuple[float | None, str]:
    """The cluster's price per hour as SkyPilot's optimizer prices what `sky launch` may provision for the rendered
    task, read with SkyPilot's own code as its optimizer fills in the candidates (sky/optimizer.py
    _fill_in_launchable_resources): for each of the task's resources (any_of), on its cloud or else each cloud
    `sky check` enabled (global_user_state.get_cached_enabled_clouds, the cache read without a refresh), the
    cheapest feasible instance that fits (Cloud.get_feasible_launchable_resources, a filter of the cloud's catalog
    by accelerators, spot and max_hourly_cost), in each region that offers it
    (resources_utils.make_launchables_for_valid_region_zones), priced by Resources.get_cost (the catalog's
    instance_type_to_hourly_cost), times num_nodes. The optimizer takes the cheapest of them; on a failed provision
    the backend blocks it and optimizes again (backends/cloud_vm_ray_backend.py provision_with_retries), and a
    managed job's recovery may move region (EAGER_NEXT_REGION): the dearest is counted, never under what it
    provisions. None where SkyPilot prices nothing (Kubernetes, SSH, Slurm: the cluster's own machines), knows no
    enabled cloud, or its catalog cannot be read; with the words that say it."""
    import copy

    import sky
    from sky.utils import resources_utils

    try:
        task = sky.Task.from_yaml_config(copy.deepcopy(config))  # it consumes the dict
        enabled = None
        offers = []  # (cost per node per hour, what)
        for resources in task.resources:
            if resources.cloud is not None:
                clouds = [resources.cloud]
            else:
                if enabled is None:
                    from sky import global_user_state, skypilot_config
                    from sky.clouds import cloud as sky_cloud

                    enabled = global_user_state.get_cached_enabled_clouds(
                        sky_cloud.CloudCapability.COMPUTE, skypilot_config.get_active_workspace())
                clouds = enabled
            if not clouds:
                return None, "SkyPilot knows no enabled cloud here (`sky check` enables them), so it prices nothing"
            own = sorted(str(c) for c in clouds if str(c).lower() in OWN_NAMES)
            if own:
                return None, (f"SkyPilot prices nothing on {', '.join(own)} (the cluster's own machines: its "
                              f"optimizer counts them at $0)")
            for cloud in clouds:
                feasible = cloud.get_feasible_launchable_resources(resources, task.num_nodes)
                if not feasible.resources_list:
                    continue
                for launchable in resources_utils.make_launchables_for_valid_region_zones(
                        feasible.resources_list[0]):
                    offers.append((launchable.get_cost(3600), f"{launchable.instance_type} on {cloud} in "
                                                              f"{launchable.region}"))
    except Exception as exc:  # noqa: BLE001 - its catalog unreadable (no network), a cloud's own error: said
        return None, f"SkyPilot's optimizer could not price it ({type(exc).__name__}: {str(exc).strip()[:300]})"
    if not offers:
        return None, ("SkyPilot's catalog has no instance that fits the task (`sky launch` will say so; "
                      "max_hourly_cost, the task's price per node, filters it too)")
    nodes = task.num_nodes
    (low, cheapest), (high, dearest) = min(offers), max(offers)
    words = f"SkyPilot's optimizer prices {nodes} x {cheapest} at ${low * nodes:.2f}/h"
    if high > low:
        words += f", up to ${high * nodes:.2f}/h ({dearest}, the dearest of the {len(offers)} it may fail over to)"
    return round(high * nodes, 4), words


#: Which storage the nodes of one SkyPilot cluster share, read in SkyPilot 0.14.1. A volume (`sky volumes apply`)
#: pins the task to its cloud, and SkyPilot refuses a task whose resources name another (task.py,
#: Task.resolve_and_validate_volumes: VolumeTopologyConflictError, "even if user specifies 'any_of'").
SHARING = (
    Sharing("bucket", "any", "yes", "MOUNT and MOUNT_CACHED are close-to-open: a file is in the bucket for every "
            "node once closed (SkyPilot's storage docs, storage modes); MOUNT_CACHED uploads it in the background "
            "after the close and rereads listings every 10 s (data/mounting_utils.py get_mount_cached_cmd: rclone "
            "--vfs-cache-mode full --dir-cache-time 10s); each node writes its own files, two writers of one file: "
            "the last close wins"),
    Sharing("volume", "kubernetes (k8s-pvc)", "if its access mode is ReadWriteMany", "SkyPilot itself refuses a "
            "ReadWriteOnce or ReadWriteOncePod volume for a multi-node task at `sky launch`, before anything is "
            "provisioned (task.py Task.resolve_and_validate_volumes)"),
    Sharing("volume", "kubernetes (k8s-hostpath)", "if its host_path is one network filesystem on every node",
            "a directory on each Kubernetes node: \"Data is local to each node\" (volumes/volume.py HostPathVolume)"),
    Sharing("volume", "runpod (runpod-network-volume)", "yes", "a RunPod network volume, mounted by every pod of "
            "its data center (volumes/volume.py RunpodNetworkVolume: the zone is its DataCenterId)"),
    Sharing("volume", "other clouds", "no", "SkyPilot has volumes on kubernetes and runpod only "
            "(volumes/volume.py VOLUME_TYPE_TO_CLOUD)"),
)

#: The clouds a SkyPilot volume can be on (the SHARING rows of a volume that are not "no").
VOLUME_CLOUDS = ("kubernetes", "runpod")


#: SkyPilot's size units (skylet/constants.py MEMORY_SIZE_UNITS, read by utils/resources_utils.py
#: parse_memory_resource): its GB is 2^30 bytes, and a bare number is its GB.
SKY_UNITS = (("TB", 2**40), ("GB", 2**30), ("MB", 2**20))
#: SkyPilot's own disk_size, which Resources._from_yaml_config_single reads as none given (no ephemeral-storage
#: request on Kubernetes): sky/resources.py DEFAULT_DISK_SIZE_GB.
SKY_DEFAULT_DISK = 256
#: The clouds of SkyPilot's whose nodes are Kubernetes pods: Kubernetes (`k8s` its alias: clouds/kubernetes.py), and
#: its SSH node pools (clouds/ssh.py: class SSH(kubernetes.Kubernetes)).
KUBERNETES_CLOUDS = ("kubernetes", "k8s", "ssh")


def sky_memory(size: str) -> str:
    """`resources.memory` in SkyPilot's units, the same bytes (a fraction is allowed: Resources._set_memory reads
    a float): `64GiB` -> `64` (a bare number is its GB), `200GB` -> `190734.86328125MB`."""
    text = size_text(size_bytes(size), SKY_UNITS)
    return text.removesuffix("GB") if text.endswith("GB") and text[:-2].isdigit() else text


def disk_size(size: str) -> int:
    """SkyPilot's `disk_size`: a whole number of its GB (Resources.__init__ takes an int), rounded up so that the
    disk is at least what the task asks."""
    return -(-size_bytes(size) // 2**30)


class SkyShared(StrictModel):
    """`checkpoints.shared.sky`: storage every node mounts at checkpoints.path."""

    bucket: str | None = Field(None, description="an existing bucket (s3://BUCKET/PREFIX, gs://, r2://...) "
                               "mounted there")
    mode: Literal["MOUNT_CACHED", "MOUNT"] = Field(
        "MOUNT_CACHED", description="MOUNT_CACHED: writes go to a local cache and upload in the background (any "
        "write pattern); MOUNT: written through to the bucket (no appends or random writes)")
    volume: str | None = Field(None, description="a SkyPilot volume (sky volumes apply), on kubernetes or runpod: "
                               "every node shares a RunPod one or a ReadWriteMany claim")

    @field_validator("bucket")
    @classmethod
    def _url(cls, value):
        if value is not None and not re.match(r"^[a-z0-9]+://[^/\s]+(/\S*)?$", value):
            raise ValueError(f"{value!r} is not a bucket URL (s3://BUCKET/PREFIX, gs://BUCKET, r2://BUCKET...)")
        return value

    @model_validator(mode="after")
    def _one(self):
        if (self.bucket is None) == (self.volume is None):
            raise ValueError("give exactly one of bucket: URL or volume: NAME")
        if self.volume is not None and "mode" in self.model_fields_set:
            raise ValueError("mode is for a bucket")
        return self


class SkyProvider(Provider):
    name = "sky"
    state_elsewhere = "sky status {name}"  # asking starts SkyPilot's API server: `ps` leaves it to the user
    shared_option = "checkpoints.shared.sky: {bucket: s3://BUCKET/PATH} or {volume: NAME}"
    sharing = SHARING
    contract = Contract(
        rank=env("SKYPILOT_NODE_RANK"),
        nodes=env("SKYPILOT_NUM_NODES"),
        head=env("SKYPILOT_NODE_IPS", item=0),
        node_addr=env("SKYPILOT_NODE_IPS", item="rank"),
        cluster_id=env("SKYPILOT_TASK_ID"),
        gpus_per_node=env("SKYPILOT_NUM_GPUS_PER_NODE"),
    )
    ray_overrides = {"agent_listen_port": AGENT_LISTEN_PORT, "min_worker_port": WORKER_PORTS[0],
                     "max_worker_port": WORKER_PORTS[1]}
    options = (Option("--managed", "run as a SkyPilot managed job (recovered on preemption)"),)
    #: The launch's dashboard is its own `ssh -L`, gone with the launcher: `rlhf-tasks forward NAME` opens another.
    forward_after_launch = True
    price_bound = "SkyPilot's resources.max_hourly_cost"
    #: (optimizer_price: none on Kubernetes, SSH, Slurm, or without an enabled cloud; launch says which)
    launch_price = ("SkyPilot's optimizer's price at launch (the dearest region it may fail over to, which "
                    "max_hourly_cost does not bound)")
    ignores = {"fleets": "SkyPilot has no fleets; placement.backends and regions choose its clouds"}
    _started_api_server = False
    #: `sky launch` made the cluster (its job runs detached): a later failure here leaves it to `down`.
    _launched = False

    def check(self, task: Task) -> None:
        for field in ("port", "dashboard_port", "client_server_port", "ready_port"):
            if field == "client_server_port" and field not in task.ray.model_fields_set:
                continue  # moved to CLIENT_SERVER_PORT by build()
            port = getattr(task.ray, field)
            if port in RESERVED_PORTS:
                raise BadInput(f"ray.{field}: {port} is used by {RESERVED_PORTS[port]} on every SkyPilot node; "
                               f"choose another")
            for (low, high), whose in ((SKYPILOT_WORKER_PORTS, "SkyPilot's Ray workers"),
                                       ((CLIENT_SERVER_PORT, WORKER_PORTS[1]), "our Ray's client server and workers")):
                if low <= port <= high:
                    raise BadInput(f"ray.{field}: {port} is inside {low}-{high}, the ports of {whose} on a "
                                   f"SkyPilot node; choose another")
        shared = shared_entry(SkyShared, task.checkpoints.shared.get(self.name), self.name)
        outside = [b for b in task.placement.backends if b.lower() not in VOLUME_CLOUDS]
        if shared and shared.volume and outside:
            raise BadInput(f"checkpoints.shared.sky.volume: {shared.volume}: SkyPilot volumes are on "
                           f"{' or '.join(VOLUME_CLOUDS)} only, and a volume pins the task to its cloud, but "
                           f"placement.backends lists {', '.join(outside)} (`sky launch` would refuse the task: "
                           f"VolumeTopologyConflictError); use checkpoints.shared.sky: {{bucket: s3://BUCKET/PATH}}, "
                           f"which every cloud's nodes mount, or leave {', '.join(outside)} out")
        refusal = sky_gpu_refusal(task.resources.gpus)
        if refusal:
            raise BadInput(f"resources.gpus: {task.resources.gpus}: {refusal}")
        if self.chosen["managed"] and task.job.submit != "head":
            raise BadInput("--managed: a managed job must submit from the head (job.submit: head), "
                           "since SkyPilot relaunches the whole task on recovery")

    def build(self, task: Task) -> Plan:
        plan = super().build(task)
        if "client_server_port" not in task.ray.model_fields_set:  # 10001 is SkyPilot's Ray's
            plan = plan.replace(ray=plan.ray.model_copy(update={"client_server_port": CLIENT_SERVER_PORT}))
        return plan

    def cache_dir(self, plan: Plan) -> str | None:
        """On a SkyPilot volume, as elsewhere; not on a bucket: MOUNT_CACHED is rclone's `--vfs-cache-mode full`
        (sky/data/mounting_utils.py, get_mount_cached_cmd), which uploads from each node's own cache in the
        background, so a model the head fetched is not yet there for the others, and MOUNT (goofys) makes no
        symlinks, which the hub's cache is made of: each node keeps its own cache."""
        shared = shared_entry(SkyShared, plan.checkpoint_shared, self.name)
        return None if shared and shared.bucket else super().cache_dir(plan)

    def retries(self, plan: Plan) -> Retries | None:
        """A managed job (`--managed`) is recovered by SkyPilot's jobs controller (sky/jobs/controller.py,
        _run_one_task): a cluster found not UP (preempted, failed) is relaunched with no count, whatever
        job_recovery says; a job that failed on an UP cluster (its user code: FAILED, FAILED_SETUP,
        FAILED_DRIVER) is restarted only while recovery_strategy.py should_restart_on_failure allows
        (max_restarts_on_errors, 0 by default); a SUCCEEDED job (exit 0) ends it. `sky launch` relaunches
        nothing."""
        if not self.chosen.get("managed"):
            return None
        errors = plan.placement.retry_errors
        return Retries(on="a preemption" + (f", and after the job's own failure at most {errors} times "
                                             f"(max_restarts_on_errors)" if errors else ""),
                       unbounded="a preempted cluster is recovered with no count: max_restarts_on_errors counts "
                                 "only the job's own failures",
                       cites="SkyPilot's sky/jobs/controller.py and recovery_strategy.py should_restart_on_failure",
                       on_failure=bool(errors), cap_exit=0)

    def notes(self, plan: Plan) -> list[str]:
        """`check` and `render` do not know whether `launch --managed` will run it: what that would refuse;
        whether a volume is of a type every node shares, which only `sky volumes ls` knows; and what SkyPilot
        does to the sizes (size_notes)."""
        out = super().notes(plan)
        if not self.chosen.get("managed"):
            try:
                SkyProvider(managed=True).retry_rules(plan)
            except BadInput as exc:
                out.append(f"with `launch --managed`: {exc} (`launch --managed` refuses it)")
        shared = shared_entry(SkyShared, plan.checkpoint_shared, self.name)
        if shared and shared.volume and plan.nodes > 1:
            out.append(f"checkpoints.shared.sky.volume {shared.volume}: every node shares it only if it is a RunPod "
                       f"network volume, a ReadWriteMany k8s-pvc (`sky launch` refuses a ReadWriteOnce one for "
                       f"{plan.nodes} nodes) or a k8s-hostpath that is one network filesystem on every Kubernetes "
                       f"node (else each node's own directory): `check` cannot see its type (`sky volumes ls`)")
        return out + self.size_notes(plan)

    def uploads_working_dir(self, plan: Plan) -> bool:
        """`submit: head` too: `sky launch` rsyncs job.working_dir to every node and the head's Ray uploads
        that copy to the job, so what it packs is measured here, before anything is rented."""
        return super().uploads_working_dir(plan) or (bool(plan.job.working_dir) and plan.job.submit == "head")

    def upload_excluded(self, plan: Plan) -> list:
        """What SkyPilot's rsync leaves out: with a .skyignore at the top, what every .skyignore names
        (it then reads no .gitignore; the head's Ray still does); else .gitignore, which Ray reads too
        (sky/utils/command_runner.py SSHCommandRunner.rsync, RSYNC_FILTER_SKYIGNORE / _GITIGNORE)."""
        if plan.job.submit != "head" or not os.path.isfile(os.path.join(plan.job.working_dir, ".skyignore")):
            return []
        return [workdir.ignore_files(plan.job.working_dir, ".skyignore")]

    def upload_words(self, plan: Plan) -> str:
        if plan.job.submit != "head":
            return super().upload_words(plan)
        return (f"`sky launch` syncs it to {SKY_WORKDIR} on every node (SkyPilot's workdir; what .skyignore, else "
                f".gitignore, names is left out), and the head uploads it from there to the job (Ray's "
                f"working_dir, leaving out job.excludes)")

    def workdir(self, plan: Plan) -> str | None:
        """SkyPilot's `workdir`: job.working_dir as seen from where `sky launch` runs (the rendered
        files' directory: render_dir, or the current directory, where render writes them)."""
        if not plan.job.working_dir or plan.job.submit != "head":
            return None
        here = os.path.abspath(self.render_dir or ".")
        return os.path.relpath(os.path.abspath(os.path.expanduser(plan.job.working_dir)), here)

    @staticmethod
    def node_plan(plan: Plan) -> Plan:
        """The plan the nodes read: with a workdir, the job's working_dir is SkyPilot's copy of it,
        the directory `run` starts in."""
        if not plan.job.working_dir or plan.job.submit != "head":
            return plan
        return plan.replace(job=plan.job.model_copy(update={"working_dir": "."}))

    def shared_storage_warning(self, plan: Plan) -> str | None:
        """A line for `check` and `render` when a multi-node run resumes from per-node directories."""
        if plan.nodes < 2 or not plan.unshared_checkpoints:
            return None
        return (f"checkpoints {plan.checkpoint_dir} is a directory on each SkyPilot node: the "
                f"{plan.nodes} nodes do not share it, and a relaunched cluster starts without it; add "
                f"checkpoints.shared.sky: {{bucket: s3://BUCKET/PATH}} or {{volume: NAME}}")

    @staticmethod
    def size_notes(plan: Plan) -> list[str]:
        """What SkyPilot does to the task's sizes that its render cannot show: a disk rounded up to its whole GB,
        and where the task can land on Kubernetes, the shm size dropped and the disk made an ephemeral-storage
        request (sky/clouds/kubernetes.py, Kubernetes.make_deploy_resources_variables)."""
        res, out = plan.resources, []
        backends = [b.lower() for b in plan.placement.backends]
        kube = any(b in KUBERNETES_CLOUDS for b in backends) or not backends
        who = "on Kubernetes SkyPilot" if backends else \
            "if SkyPilot places the task on Kubernetes (placement.backends does not rule it out), it"
        disk = disk_size(res.disk) if res.disk else None
        if disk is not None and disk * 2**30 != size_bytes(res.disk):
            out.append(f"resources.disk {res.disk}: SkyPilot's disk_size is a whole number of its GB (2^30 bytes), so "
                       f"it asks {disk} ({disk * 2**30 / 10**9:.1f}GB), rounded up")
        if kube and res.shm_size:
            shm = f"--shm-size={docker_size(res.shm_size)} does not reach the pod" if plan.image else \
                "nothing sizes it"
            out.append(f"resources.shm_size {res.shm_size}: {who} ignores docker.run_options, so {shm}: "
                       f"its pod's /dev/shm is a memory emptyDir with no size limit, bounded by the pod's memory "
                       f"(sky/resources.py Resources.make_deploy_variables; templates/kubernetes-ray.yml.j2, dshm)")
        if kube and disk == SKY_DEFAULT_DISK:
            out.append(f"resources.disk {res.disk}: {who} requests no ephemeral storage for disk_size "
                       f"{disk}, its default, which it reads as none given (Resources._from_yaml_config_single)")
        elif kube and disk is not None:
            less = f", less than the {res.disk} asked" if disk * 10**9 < size_bytes(res.disk) else ""
            out.append(f"resources.disk {res.disk}: {who} makes disk_size {disk} each pod's "
                       f"ephemeral-storage request, {disk}G ({disk}GB: Kubernetes' G is 10^9 bytes{less}), and a "
                       f"pod whose node has less allocatable ephemeral storage is not scheduled (a node's is its "
                       f"kubelet's disk, often far less than a VM's: `kubectl describe node`); SkyPilot offers only "
                       f"contexts whose nodes fit it (kubernetes_utils.check_instance_fits). Leave resources.disk out "
                       f"for Kubernetes, or set placement.backends to the clouds you mean")
        return out

    def autostop(self, plan: Plan) -> dict | None:
        """SkyPilot's own autostop, run by the cluster (its skylet on the head), so that the VMs end
        once the run is over with no launcher attached: a minute after the task's job ends, or for a
        kept cluster (`launch --keep`) after placement.idle (`never`: none). A managed job's cluster
        is SkyPilot's to end already."""
        if self.chosen.get("managed"):
            return None
        if plan.keep_cluster and plan.budget.idle_s is None:
            return None
        minutes = max(1, -(-int(plan.budget.idle_s) // 60)) if plan.keep_cluster else 1
        return {"idle_minutes": minutes, "down": True}

    def task_config(self, plan: Plan) -> dict:
        res, placement = plan.resources, plan.placement
        resources: dict = {}
        if res.gpus:
            resources["accelerators"] = sky_gpu(res.gpus)
        if res.cpus:  # at least, unless resources.exact says exactly
            resources["cpus"] = f"{res.cpus}" + ("" if res.is_exact("cpus") else "+")
        if res.memory:
            resources["memory"] = sky_memory(res.memory) + ("" if res.is_exact("memory") else "+")
        if res.disk:
            resources["disk_size"] = disk_size(res.disk)
        if plan.image:
            resources["image_id"] = f"docker:{plan.image}"
        if placement.spot != "off":
            resources["use_spot"] = True
        if placement.price_per_hour:  # "the maximum hourly cost (in USD) for instances" (sky/resources.py Resources)
            resources["max_hourly_cost"] = math.ceil(placement.price_per_hour / plan.nodes * 10000) / 10000
        if placement.retry:  # the job's own failure only when asked (placement.retry.errors)
            resources["job_recovery"] = {"strategy": "EAGER_NEXT_REGION",
                                         "max_restarts_on_errors": placement.retry_errors}
        if plan.ray.dashboard_host != "127.0.0.1":
            resources["ports"] = [plan.ray.dashboard_port]
        if placement.backends:
            resources["any_of"] = [{"cloud": cloud} for cloud in placement.backends]
        if len(placement.regions) == 1:
            resources["region"] = placement.regions[0]
        autostop = self.autostop(plan)
        if autostop:
            resources["autostop"] = autostop
        config: dict = {"name": plan.name, "num_nodes": plan.nodes, "resources": resources}
        if plan.env:
            config["envs"] = dict(plan.env)
        secrets = list(plan.secrets) + ([plan.token_env] if plan.token_env else [])
        if secrets:
            config["secrets"] = {name: None for name in secrets}
        workdir = self.workdir(plan)
        if workdir:
            config["workdir"] = workdir
        config["file_mounts"] = {NODE_DIR: LOCAL_DIR}
        setup = ["set -e"] + list(plan.setup)
        shared = shared_entry(SkyShared, plan.checkpoint_shared, self.name)
        if plan.checkpoint_dir and shared and shared.bucket:
            config["file_mounts"][plan.checkpoint_dir] = {"source": shared.bucket, "mode": shared.mode}
        elif plan.checkpoint_dir and shared:
            config["volumes"] = {plan.checkpoint_dir: shared.volume}
        elif plan.checkpoint_dir:  # SkyPilot's VMs run as a user that needs sudo outside its home
            ckpt = shlex.quote(plan.checkpoint_dir)
            setup.append(f"mkdir -p {ckpt} 2>/dev/null || "
                         f"{{ sudo mkdir -p {ckpt} && sudo chown \"$(id -u):$(id -g)\" {ckpt}; }}")
        # SkyPilot's own --shm-size guess is skipped when one is given; its docker run gives a container NVIDIA's
        # GPUs only (sky/provision/docker_utils.py, DockerInitializer._configure_runtime): AMD's are ours to pass
        run_options = ([f"--shm-size={docker_size(res.shm_size)}"] if res.shm_size else []) + (
            list(AMD_CONTAINER_OPTIONS) if plan.gpu_vendor == "amd" else [])
        if run_options and plan.image:
            config["config"] = {"docker": {"run_options": run_options}}
        config["setup"] = "\n".join(setup) + "\n"
        leaked = [f"export {k}={shlex.quote(plan.env[k])}" if k in plan.env else f"unset {k}" for k in LEAKED_ENV]
        config["run"] = (f"# SkyPilot's runner exports {' '.join(LEAKED_ENV)} for its own Ray, and its job passes them "
                         f"on: the task's, or Ray's defaults\n" + "; ".join(leaked) + "\n" + agent_command(plan) + "\n")
        return config

    def counted_plan(self, plan: Plan) -> tuple[Plan, str]:
        """The plan with the price its head counts: SkyPilot's optimizer's for the rendered task (optimizer_price),
        where it prices it; the task's otherwise. With the words `launch` says."""
        try:
            import sky  # noqa: F401
        except ImportError:
            return plan, "SkyPilot's optimizer: not asked (skypilot is not installed here)"
        price, words = optimizer_price(self.task_config(plan))
        given = plan.budget.price_per_hour
        if price is None:
            return plan, f"{words}: the head counts " + (f"placement.price_per_hour, ${given:.2f}/h" if given is not None
                                                         else "no price")
        if given is not None:
            words += f" (placement.price_per_hour: ${given:.2f}/h)"
        return plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": price})), \
            f"{words}: the head counts ${price:.2f}/h"

    def ask_own_code(self, plan: Plan) -> list[str]:
        """The render as SkyPilot's own code takes it, where SkyPilot is installed here, offline: its task
        schema and `Task.from_yaml_config` (what `sky launch` parses: cloud names included), then the
        accelerator name against SkyPilot's catalog where that is on this machine (SkyPilot's
        canonicalize_accelerator_name, sky/utils/accelerator_registry.py: a name the catalog lacks is kept
        as written, and no cloud's offer carries it)."""
        import copy

        try:
            import sky
            from sky.utils import common_utils, schemas
        except ImportError:
            return ["SkyPilot's task schema, cloud names and accelerator catalog: not checked: skypilot is not "
                    "installed here (pip install 'rlhf-tasks[sky]')"]
        import yaml

        from ..models import did_you_mean

        name = f"{plan.name}.sky.yaml"
        config = yaml.safe_load(self.render(plan)[name])
        gpus = plan.resources.gpus
        by_memory = None
        if gpus and plan.resources.gpu_memory and not plan.resources.gpu_name:
            # SkyPilot's own parse of `80GB:8` reads common/metadata.csv, fetching it where it is not here:
            # it parses the names that file gives instead, or none where it is not on this machine
            by_memory = devices_by_memory(gpus)
            if by_memory == []:
                raise BadInput(f"resources.gpus: {gpus}: no GPU of SkyPilot's catalog (common/metadata.csv) has "
                               f"{sky_gpu(gpus).partition(':')[0]} of memory, so SkyPilot would launch no GPU "
                               f"(Resources._parse_accelerators_from_str, get_devices_by_memory)")
            accelerators = {device: plan.gpus_per_node for device in by_memory or []}
            config["resources"]["accelerators"] = accelerators
            if not accelerators:
                del config["resources"]["accelerators"]
        try:
            common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
            sky.Task.from_yaml_config(copy.deepcopy(config))  # it consumes the dict
        except Exception as exc:  # SkyPilot raises ValueError and its own errors, each with its words
            words = str(exc).strip()
            found = re.search(r"any_of\[(\d+)\]\.cloud", words)
            field = f"placement.backends[{found.group(1)}]" if found else \
                "resources.gpus" if "ccelerator" in words else "the task"
            hint = ""
            if found:
                from sky.utils import registry

                wrong = plan.placement.backends[int(found.group(1))]
                hint = "\n  " + did_you_mean(wrong, sorted(registry.CLOUD_REGISTRY), "its clouds")
            raise BadInput(f"{field}: SkyPilot {sky.__version__} refuses {name}: {words}{hint}") from None
        asked = f"SkyPilot {sky.__version__}'s task schema and Task.from_yaml_config take {name}"
        if by_memory is not None:
            return [asked, f"resources.gpus {gpus}: SkyPilot takes any of {', '.join(by_memory)} (its "
                           f"common/metadata.csv; Task.from_yaml_config reads {sky_gpu(gpus)} as that set)"]
        if gpus and plan.resources.gpu_memory and not plan.resources.gpu_name:
            return [asked, f"resources.gpus {gpus}: not checked against SkyPilot's catalog: its common/metadata.csv "
                           f"(each GPU's memory) is not on this machine (SkyPilot fetches it the first time it reads "
                           f"a GPU given by memory, as `sky launch` of this task does); at launch SkyPilot takes any GPU it lists with "
                           f"{sky_gpu(gpus).partition(':')[0]}"]
        if not gpus or gpus.isdigit():
            return [asked]
        accelerator = sky_gpu(gpus).partition(":")[0]
        backends = {b.lower() for b in plan.placement.backends}
        if accelerator.lower().startswith("tpu-"):
            return [asked, f"resources.gpus {accelerator}: not checked against SkyPilot's catalog: a TPU"]
        if backends & OWN_NAMES:  # their GPU names are the cluster's (a node label, a gres), not the catalog's
            return [asked, f"resources.gpus {accelerator}: not checked against SkyPilot's catalog: on "
                           f"{', '.join(sorted(backends & OWN_NAMES))} the cluster names its GPUs itself"]
        catalog = _catalog_accelerators()
        if catalog is None:
            return [asked, "resources.gpus: not checked against SkyPilot's accelerator catalog: it is not on this "
                           "machine (SkyPilot fetches it on first use into ~/.sky/catalogs; any `sky` command that "
                           "reads it, e.g. `sky show-gpus`, puts it here)"]
        known = {n.lower(): n for n in catalog}
        name = plan.resources.gpu_name
        if plan.resources.gpu_memory and accelerator.lower() not in known and name and name.lower() in known:
            listed = _catalog_memory().get(known[name.lower()])
            size = f" (its common/metadata.csv gives {known[name.lower()]} {listed:g}GB)" if listed else ""
            raise BadInput(f"resources.gpus: {gpus}: SkyPilot's accelerator catalog (common/accelerators.csv) has "
                           f"{known[name.lower()]} but no {accelerator}, the name it gives a GPU's memory variant "
                           f"(A100-80GB){size}: write {known[name.lower()]}:{plan.gpus_per_node}, or the memory "
                           f"alone ({sky_gpu(gpus).rpartition('-')[2]})")
        if accelerator.lower() not in known:
            raise BadInput(f"resources.gpus: {gpus}: SkyPilot's accelerator catalog (common/accelerators.csv) has "
                           f"no {accelerator!r}, so no cloud offers it "
                           f"{did_you_mean(accelerator, sorted(catalog), 'its accelerators')}")
        canonical = known[accelerator.lower()]
        clouds = catalog[canonical]
        if backends and not backends & set(clouds):
            raise BadInput(f"placement.backends: SkyPilot's accelerator catalog offers {canonical} on "
                           f"{', '.join(clouds)} only, none of {', '.join(plan.placement.backends)}")
        return [asked, f"resources.gpus {canonical} is in SkyPilot's accelerator catalog ({', '.join(clouds)})"]

    def render(self, plan: Plan) -> dict[str, str]:
        names = " ".join(f"--secret {n}" for n in plan.secrets + ([plan.token_env] if plan.token_env else []))
        header = (f"# Rendered by rlhf-tasks for SkyPilot. From this directory (the one this file is in):\n"
                  f"#   sky launch -c {plan.name} {plan.name}.sky.yaml {names}\n"
                  f"# or as a managed job: sky jobs launch {plan.name}.sky.yaml {names}\n")
        if plan.resources.shm_size and not plan.image:
            header += (f"# resources.shm_size {plan.resources.shm_size} is not applied: without an image SkyPilot runs "
                       f"on the VM, whose /dev/shm SkyPilot does not size (give the task an image to get a container "
                       f"with --shm-size)\n")
        header += ("# (sky launch resolves file_mounts and workdir against the directory it runs from)\n")
        return {f"{plan.name}.sky.yaml": dump_yaml(self.task_config(plan), header),
                **shipped_files(self.node_plan(plan))}

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """`sky launch` (then the dashboard through `ssh -L` to the head, which SkyPilot
        names in ~/.ssh/config), or `sky jobs launch` for a managed job."""
        sky = require_cli("sky", "sky")
        managed = bool(self.chosen["managed"])
        # `sky launch` starts SkyPilot's API server when none runs; a failed launch stops it again.
        self._started_api_server = probe_tcp("127.0.0.1", API_SERVER_PORT, timeout=1.0) is not None
        directory, token, env = self.stage(plan, secrets)
        counted, said = self.counted_plan(plan)
        from ..console import say
        say(f"sky: {said}")
        if counted.budget.price_per_hour != plan.budget.price_per_hour:  # the head reads its price from the files
            plan = counted
            write_files(directory, self.render(plan))
        names = list(secrets) + ([plan.token_env] if token else [])
        secret_args = [arg for name in names for arg in ("--secret", name)]
        yaml_file = f"{plan.name}.sky.yaml"
        if managed:
            argv = [sky, "jobs", "launch", "-n", plan.name, yaml_file, *secret_args, "-y"]
        else:
            argv = [sky, "launch", "-c", plan.name, yaml_file, *secret_args, "-y", "--detach-run"]
        if managed:  # `sky jobs launch` streams the job's log (the head agent's among it) until the job ends
            log = directory / "sky-jobs-launch.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(argv, cwd=directory, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
            state.save(plan.name, {"provider": self.name, "cluster_id": plan.name, "managed": True})
            return Cluster(name=plan.name, cluster_id=plan.name, token=token, head_alive=lambda: proc.poll() is None,
                           node_logs=[str(log)], close=lambda: end_process(proc),
                           price_per_hour=plan.budget.price_per_hour,
                           describe=lambda: [] if proc.poll() is None else
                           [f"sky jobs launch exited with code {proc.returncode}"])
        self._launched = False
        proc = subprocess.Popen(argv, cwd=directory, env=env)
        try:
            returncode = proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C ends the `sky` client only: SkyPilot's API server goes on with the launch ("Request will
            # continue running asynchronously", sky/client/cli/command.py). The record makes the launcher's
            # Ctrl-C handling `down` the cluster (`sky down` kills the cluster's other requests first).
            from ..console import say
            try:
                proc.wait(30)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                end_process(proc)
            state.save(plan.name, {"provider": self.name, "cluster_id": plan.name})
            say(f"SkyPilot's API server goes on with the launch of {plan.name} after Ctrl-C (`sky api status` shows "
                f"it, `sky api cancel` cancels it); if `sky down {plan.name}` below finds no cluster yet, run it "
                f"again once `sky status` shows {plan.name}")
            raise
        if returncode != 0:
            raise StepFailed("sky launch", f"exit code {returncode}")
        self._launched = True
        port = plan.ray.dashboard_port
        local = port if not _listening(port) else free_port()
        state.save(plan.name, {"provider": self.name, "cluster_id": plan.name, "dashboard_port": port})
        # SkyPilot's own record of the job: `sky logs NAME` follows the cluster's last job (every node's
        # output, prefixed by SkyPilot) and exits when it ends, with its status as exit code. Kept here: the
        # render's autostop takes the cluster, its logs with it, a minute after the job ends.
        job_log = directory / "sky-job.log"
        with open(job_log, "wb") as out:
            follower = subprocess.Popen([sky, "logs", plan.name], cwd=directory, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            tunnel = open_forward(plan.name, local, port, directory / "ssh-forward.log")
        except BaseException:
            end_process(follower)
            raise
        dashboard = f"http://localhost:{local}"
        state.update(plan.name, dashboard=dashboard, job_log=str(job_log))
        scrubbed = {**secrets, **({plan.token_env: token} if token else {})}

        def describe() -> list[str]:
            lines = []
            if follower.poll() is not None:
                lines += skypilots_word(plan.name, follower.returncode, job_log.read_text(errors="replace"))
            if tunnel.poll() is not None:
                lines.append(f"the ssh forward of the dashboard (ssh -L {local}:127.0.0.1:{port} {plan.name}) exited "
                             f"with code {tunnel.returncode}: {_tail(directory / 'ssh-forward.log') or 'no output'}")
            return lines

        def head_log() -> str:
            """The head's lines of SkyPilot's job log (its prefix taken off), then, once the job is over,
            what SkyPilot says of it and each node's first error."""
            text = job_log.read_text(errors="replace") if job_log.exists() else ""
            lines = by_node(text).get(0, [])
            if follower.poll() is not None:
                lines += skypilots_word(plan.name, follower.returncode, text)
            return "".join(line + "\n" for line in lines)

        def gather_here(reason: str) -> tuple[str, str] | None:
            made = bundle_from_job_log(plan.name, job_log, scrubbed, str(state.run_dir(plan.name)), reason)
            return (made, f"each node's output in SkyPilot's job log (`sky logs {plan.name}`), kept here as it ran") \
                if made else None

        def close() -> None:
            end_process(tunnel)
            end_process(follower)
        def job_ended() -> str | None:
            """SkyPilot's word once `sky logs` ended with the job not SUCCEEDED (a node's failure ends them all)."""
            code = follower.poll()
            return None if code in (None, 0) else skypilots_word(plan.name, code, "")[0]
        return Cluster(name=plan.name, cluster_id=plan.name, dashboard=dashboard, token=token,
                       head_alive=lambda: tunnel.poll() is None and follower.poll() is None, head_log=head_log,
                       close=close, describe=describe, gather_here=gather_here, job_ended=job_ended,
                       price_per_hour=plan.budget.price_per_hour)

    def bundle_here(self, name: str, secrets: dict[str, str]) -> str | None:
        """`logs NAME --bundle` once the dashboard is gone (the job over, autostop may have taken the
        cluster): the bundle of the job log the launch kept here."""
        job_log = (state.load(name) or {}).get("job_log")
        if not job_log:
            return None
        return bundle_from_job_log(name, Path(job_log), secrets, str(state.run_dir(name)),
                                   "asked for with `rlhf-tasks logs --bundle`, from SkyPilot's job log kept here")

    def forward(self, name: str, port: int | None = None) -> int:
        """`ssh -N -L LOCAL:127.0.0.1:PORT NAME` through the ssh config SkyPilot writes for the cluster
        (~/.sky/generated/ssh/NAME, included from ~/.ssh/config), until Ctrl-C."""
        record = state.load(name) or {}
        remote = record.get("dashboard_port") or 8265
        local = port or remote
        log = state.run_dir(name) / self.name / "ssh-forward.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        tunnel = open_forward(name, local, remote, log)
        return hold_forward(name, tunnel, "ssh -L", f"http://localhost:{local}", timeout=FORWARD_TIMEOUT_S,
                            said=lambda: _tail(log), recorded=bool(record),
                            silent_head=f" (the forward is up, the head's Ray dashboard does not answer: is the "
                                        f"cluster's Ray still running? sky status {name})",
                            then=f"eval \"$(rlhf-tasks env {name})\", rlhf-tasks logs {name} --bundle, "
                                 f"rlhf-tasks list --cluster {name}")

    def status(self, name: str) -> str | None:
        """`sky status NAME` (asks SkyPilot's API server, which it starts when none runs)."""
        out = subprocess.run([require_cli("sky", "sky"), "status", name], capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)
        said = _ANSI.sub("", out.stdout + out.stderr).strip()
        if out.returncode != 0:
            raise StepFailed(f"sky status {name}", said or f"exit code {out.returncode}")
        row = next((line.split() for line in said.splitlines() if line.split()[:1] == [name]), None)
        if row is None:
            return f"{name}: SkyPilot has no such cluster (sky status {name}: {' '.join(said.split())[-300:]})"
        return f"{name}: SkyPilot says: " + "\n  ".join(line.rstrip() for line in said.splitlines() if line.strip())

    def state_line(self, name: str) -> str | None:
        return None  # asking `sky status` starts SkyPilot's API server: `ps` leaves it to the user

    def down(self, name: str) -> str:
        record = state.load(name) or {}
        sky = require_cli("sky", "sky")
        return stop_with_cli([sky, "jobs", "cancel", "-n", name, "-y"] if record.get("managed") else
                             [sky, "down", name, "-y"], name)

    def ready(self, plan: Plan) -> None:
        require_cli("sky", "sky")

    def refuses_missing_secrets(self, plan: Plan, missing: list[str]) -> str | None:
        return ("the rendered file names every secret with no value, and `sky launch` refuses one that no "
                "--secret gives (\"No value available for secret(s)\") unless a managed secrets provider has it")

    def abandon(self, before: state.Before) -> list[str]:
        """Also stop SkyPilot's local API server when this launch is what started it. Once `sky launch`
        made the cluster (its job runs detached), nothing is undone: its record stays, for `down`."""
        if self._launched:
            return []
        undone = super().abandon(before)
        if self._started_api_server:
            subprocess.run([require_cli("sky", "sky"), "api", "stop"], capture_output=True, text=True)
            undone.append("the SkyPilot API server it started")
        return undone


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _listening(port: int) -> bool:
    """Whether something on this machine already listens on 127.0.0.1:port (ssh -L could not bind it)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _tail(path: Path, chars: int = 600) -> str:
    try:
        return " ".join(path.read_text(errors="replace").split())[-chars:]
    except FileNotFoundError:
        return ""


def open_forward(name: str, local: int, remote: int, log: Path, timeout: float = FORWARD_TIMEOUT_S) -> subprocess.Popen:
    """`ssh -N -L LOCAL:127.0.0.1:REMOTE NAME`, SkyPilot's host entry for the cluster's head (on Slurm its
    ProxyCommand is SkyPilot's websocket proxy through its API server, which runs `srun --overlap ...
    sshd -i` on the head node in the cluster's job), returned once ssh holds the local port. A forward
    that fails (ssh exits, or holds no port within `timeout`) is a StepFailed saying what ssh said."""
    argv = ["ssh", "-N", "-o", "ExitOnForwardFailure=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
            "-o", "ServerAliveInterval=15", "-o", "ConnectTimeout=30", "-L", f"{local}:127.0.0.1:{remote}", name]
    what = f"forwarding the dashboard of {name} ({' '.join(argv)})"
    if _listening(local):
        raise StepFailed(what, f"127.0.0.1:{local} is taken on this machine (`rlhf-tasks forward {name} --port N` "
                               f"picks another)")
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while not _listening(local):
        if proc.poll() is not None:
            raise StepFailed(what, f"ssh exited with code {proc.returncode}: {_tail(log) or 'no output'} (SkyPilot's "
                                   f"ssh config for the cluster: ~/.sky/generated/ssh/{name}; `ssh {name}` tries it)")
        if time.monotonic() > deadline:
            end_process(proc)
            raise StepFailed(what, f"no forward after {timeout:.0f}s: {_tail(log) or 'ssh said nothing'}")
        time.sleep(0.2)
    return proc


#: SkyPilot's prefix of a node's line in its job log: `(head, rank=0, pid=7) `, `(worker1, rank=1, pid=8, ip=...) `;
#: on a one-node cluster the task's name and no rank, `(NAME, pid=7) ` (skylet/executor/slurm.py, RayCodeGen's
#: name_str). Setup's `(setup pid=7)` is no node's.
_NODE_LINE = re.compile(r"^\((?:(?:head|worker\d+), rank=(\d+)|[^\s,()]+), pid=\d+(?:, ip=[^)]*)?\) ?(.*)$")
#: `sky logs`'s exit codes (sky.exceptions.JobExitCode in SkyPilot 0.14.1).
JOB_EXIT = {0: "SUCCEEDED", 100: "FAILED", 101: "NOT_FINISHED", 102: "NOT_FOUND", 103: "CANCELLED"}


def by_node(text: str) -> dict[int, list[str]]:
    """SkyPilot's job log split by node rank (setup's and SkyPilot's own lines left out)."""
    nodes: dict[int, list[str]] = {}
    for line in _ANSI.sub("", text).splitlines():
        match = _NODE_LINE.match(line)
        if match:
            nodes.setdefault(int(match.group(1) or 0), []).append(match.group(2))
    return nodes


def _nodes(text: str) -> list[dict]:
    """Each node of SkyPilot's job log: its lines, the errors found in them and the first."""
    from ..agent.protocol.bundle import find_errors, first_error

    nodes = []
    for rank, lines in sorted(by_node(text).items()):
        node_text = "\n".join(lines) + "\n"
        found = find_errors(node_text, f"node{rank}.log")
        nodes.append({"label": f"node{rank}", "ip": "", "rank": rank, "head": rank == 0, "text": node_text,
                      "first_error": first_error(found), "findings": found})
    return nodes


def _first_errors(nodes: list[dict]) -> list[dict]:
    from ..agent.protocol.bundle import node_order

    return [{"label": n["label"], "ip": "", **{k: n["first_error"][k] for k in ("error", "kind", "at", "file")}}
            for n in node_order(nodes)]


def skypilots_word(name: str, code: int | None, text: str) -> list[str]:
    """What SkyPilot says of the job once `sky logs` ended: its status, and each node's first error."""
    from ..agent.protocol.bundle import describe

    lines = [f"SkyPilot: the job on {name} ended {JOB_EXIT.get(code, f'(sky logs exit code {code})')} "
             f"(sky queue {name})"]
    errors = _first_errors(_nodes(text)) if code != 0 else []
    if errors:
        lines.append("first error on each node, by SkyPilot's job log: " + "; ".join(describe(e) for e in errors))
    return lines


def bundle_from_job_log(name: str, job_log: Path, secrets: dict[str, str], out_dir: str, reason: str) -> str | None:
    """A failure bundle of SkyPilot's job log kept here: each node's lines, the errors found in them, secrets
    scrubbed. Its path, or None without a log."""
    import json

    from ..agent.protocol.bundle import scrub, write_bundle

    try:
        text = scrub(job_log.read_text(errors="replace"), secrets)
    except FileNotFoundError:
        return None
    nodes = _nodes(text)
    files = [{"node": "sky", "label": "skypilot", "name": "sky-logs.log", "text": text, "truncated": False, "found": []}]
    files += [{"node": n["label"], "label": n["label"], "name": f"{n['label']}.log", "text": n["text"],
               "truncated": False, "found": [f"{f['kind']}: {f['error']}" for f in n["findings"]][:20]} for n in nodes]
    first = _first_errors(nodes)
    gathered = {"reason": scrub(reason, secrets), "made_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "nodes": [{**{k: v for k, v in n.items() if k not in ("findings", "text")}, "state": "SkyPilot job log"}
                          for n in nodes], "first_errors": first,
                "files": files, "problems": [], "state": json.dumps({"cluster": name, "nodes": len(nodes)})}
    try:
        return write_bundle(gathered, out_dir, name)
    except OSError:
        return None
