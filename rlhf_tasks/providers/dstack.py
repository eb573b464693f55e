"""dstack: one `type: task` configuration with `nodes: N`, applied with `dstack apply`.

dstack starts the same commands on every node and sets DSTACK_NODE_RANK,
DSTACK_MASTER_NODE_IP and DSTACK_NODES_NUM; the node agent reads them. Only job 0's
ports are forwarded by `dstack apply`, which is the head: its dashboard port is the
one port we expose. Secrets and the Ray token are dstack project secrets, one per cluster and
variable (`rlhf_tasks__<cluster>__<VARIABLE>`, secret_name), which the job's env references as
`${{ secrets.NAME }}`: dstack's server puts the values in when it hands each job to its runner
(server/services/jobs/__init__.py interpolate_job_spec_secrets, called by the jobs_submitted and
jobs_running pipelines), so neither the rendered file, nor the run spec the server stores, nor the
CLI's command line or environment holds a value. `launch` sets them through dstack's API
(dstack_api.py, the values on its stdin), `down` deletes them, as does the launcher once the run
it followed is over.

Checkpoints go to a directory on each host (`instance_path`) unless the task names shared
storage in `checkpoints.shared.dstack`: a network volume (for several nodes only on backends whose
volumes attach to several instances: SHARING), or a host directory the user declares shared (an NFS
mount on every fleet host).

What dstack's server does with the file, read in dstack 0.22.5's own code: it runs `commands` as
`<shell> -i -c "<items joined with ' && '>"` (jobs/configurators/base.py, _commands and
_join_shell_commands), so they are rendered as one item that starts with `set -e`; `files:` entries are
archived by the CLI (utils/files.py create_file_archive: .gitignore and .dstackignore respected, at most
DSTACK_SERVER_CODE_UPLOAD_LIMIT, 2 MiB by default, per archive: server/routers/files.py) and unpacked on
every node; with `image:` and no `user:` or CPU architecture the server reads the image's configuration
from its registry at submit time (_user, _requirements); a fleet terminates only instances above
`nodes.min` when they idle (fleets.py, idle_duration); an SSH fleet refuses the fields of a cloud fleet
(server/services/fleets.py, _validate_fleet_configuration_subtype_specific_fields); a run needs a fleet
(cli/utils/common.py NO_FLEETS_WARNING), and `dstack apply -d` submits a run no offer fits.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .. import state, workdir
from ..agent.protocol import RESULT_PREFIX
from ..errors import BadInput, StepFailed
from ..gpu_spec import gpu_memory_words, gpu_parts
from ..models import StrictModel, require_absolute, size_bytes, size_text
from ..plan import Contract, Plan, env
from ..spec import Task, provider_part
from .base import (Cluster, Provider, Retries, Sharing, end_process, hold_forward, require_cli, start_tunnel,
                   stop_with_cli, write_files)
from .shipping import LOCAL_DIR, NODE_DIR, WRITTEN_BY, agent_command, dump_yaml, shared_entry, shipped_files

SPOT = {"off": "on-demand", "on": "spot", "auto": "auto"}

#: What we render when the task gives no disk. dstack's own default is `100GB..` (resources.DEFAULT_DISK),
#: which it compares to an offer's disk and, on an SSH fleet, to the host's free disk: a host with less is no
#: offer. 50GB (dstack's, 50GiB) holds the image with Ray and torch and a small model; a task that needs more says
#: `disk:`. In dstack's words, as rendered.
DEFAULT_DISK = "50GB"

#: The fleet's `idle_duration` when the task does not set `placement.idle`: dstack's own default for a run's
#: instances (fleets.py: "Defaults to `5m` for runs and `3d` for fleets"), not the fleet's 3 days.
FLEET_IDLE_S = 300

#: Where the task's job.working_dir lands on every node (dstack's `files:`), and the directory the job's
#: commands run in (dstack's `working_dir`; without it, the image's, `/` in many). Not dstack's repo directory
#: (/workflow), nor below /opt/rlhf-tasks: dstack's runner replaces a `files:` target whole (executor/files.go,
#: as tests/dstack/agent.py plays it), so no image's directory and no other archive's may be it.
JOB_DIR = "/opt/rlhf-tasks-workdir"

#: dstack's server refuses a `files:` archive above this (DSTACK_SERVER_CODE_UPLOAD_LIMIT, 2 MiB by default:
#: server/settings.py); read from this environment too, for a server started here with another limit.
DEFAULT_UPLOAD_LIMIT = 2 * 2**20

#: A GPU name with its memory as a suffix (A100-80GB, V100-32G), which dstack's GPUSpec parser takes whole as a
#: name its catalog (gpuhunt's KNOWN_ACCELERATORS) does not know: dstack writes the memory as its own field.
_GPU_MEMORY_SUFFIX = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9._-]*?)[-_](?P<memory>\d+)\s*G(?:i?B)?$", re.IGNORECASE)


def max_price(plan: Plan) -> float | None:
    """placement.price_per_hour (the whole cluster's) as dstack's `max_price`, "The maximum instance price per
    hour" (core/models/profiles.py, Profile.max_price): an offer filter on every instance (gpuhunt's QueryFilter
    through backends/base/offers.py requirements_to_query_filter, and on a fleet's instances through
    server/services/instances.py instance_matches_constraints), so the cluster's price split over its nodes, rounded
    up to 1/10000 of a dollar (an offer at the bound stays). None without a price, or a free one (dstack wants > 0)."""
    price = plan.placement.price_per_hour
    return math.ceil(price / plan.nodes * 10000) / 10000 if price else None


def plan_price(answer: dict, task_price: float | None) -> float | None:
    """The cluster's price per hour as dstack's run plan gives it before anything is provisioned (dstack_api.py
    plan): for each job the dearest offer that fits it (JobPlan.max_price, over every matching offer, not only those
    listed: server/services/runs/plan.py _get_job_plan), summed. dstack tries the offers cheapest first and moves on
    to dearer ones when one fails, so this is never under what it provisions. Where a job's offers are unpriced
    (an SSH fleet's hosts, which dstack prices at $0: server/services/instances.py), the task's price."""
    prices = [job.get("max_price") for job in answer.get("jobs") or []]
    if not prices or not all(prices):
        return task_price
    return round(sum(prices), 4)


def dstack_gpu(gpus: str) -> str:
    """`resources.gpus` in dstack's words: `A100-80GB:8` -> `A100:80GB:8`; `H100:8` and `8` as given; a bare
    name is one GPU (`MI300X` -> `MI300X:1`: dstack reads a bare name as one GPU or more); a memory in GB
    (`80GB:8`, `24GB..:1`): dstack compares a GPU spec's memory with gpuhunt's figure for each GPU
    (KNOWN_ACCELERATORS' memory, the GB it is sold by: 80 for an A100 80GB), so the task's GB are that figure."""
    if gpus.isdigit():
        return gpus
    name, memory, count = gpu_parts(gpus)
    match = _GPU_MEMORY_SUFFIX.match(name or "")
    if match:
        name = f"{match.group('name')}:{match.group('memory')}GB"
    if memory:
        name = f"{name}:{gpu_memory_words(memory)}" if name else gpu_memory_words(memory)
    return f"{name}:{count}"


def _field_of(error: str) -> str:
    """The task's field for the location dstack's validation error names first (`task.resources.gpu`)."""
    for line in error.splitlines()[1:]:
        loc = line.strip().split(".")
        if loc and loc[0] in ("task", "fleet"):
            loc = loc[1:]
        if not loc or " " in line.strip():
            continue
        if loc[0] in ("backends", "regions"):
            return f"placement.{loc[0]}" + (f"[{loc[1]}]" if len(loc) > 1 and loc[1].isdigit() else "")
        if loc[:2] == ["resources", "gpu"]:
            return "resources.gpus"
        if loc[0] == "resources" and len(loc) > 1:
            return f"resources.{ {'cpu': 'cpus'}.get(loc[1], loc[1]) }"
        if loc[0] in ("image", "env", "user", "registry_auth", "ssh_config"):
            return {"image": "image", "env": "env"}.get(loc[0], f"placement.dstack.{loc[0]}")
        break
    return "the task"


#: dstack's size units (core/models/resources.py, Memory.parse): its GB is 2^30 bytes (the server gives a container
#: `shm_size * 1024**3` bytes: runner/client.py, _memory_to_bytes), TB 1024 of them, MB 1/1024; it has no GiB.
DSTACK_UNITS = (("TB", 2**40), ("GB", 2**30), ("MB", 2**20))


def dstack_size(size: str) -> str:
    """A task's size in dstack's units, the same bytes: `64GiB` -> `64GB`, `128GB` (10^9 bytes each) ->
    `122070.3125MB` (exact: dstack's Memory is a float, which holds any byte count / 2^20 exactly)."""
    return size_text(size_bytes(size), DSTACK_UNITS)


def amount(res, field: str) -> str:
    """A task's amount in dstack's words: `28..` (28 or more: dstack reads a bare `28` as exactly 28) unless the
    task lists the field under resources.exact, then `28` as given; a size in dstack's units."""
    value = getattr(res, field)
    value = dstack_size(value) if field in ("memory", "disk") else value
    return str(value) if res.is_exact(field) else f"{value}.."


def dstack_resources(res, keys: tuple[str, ...], cpu_arch: str | None = None) -> dict:
    """The resources block for a task or fleet: GPUs in dstack's catalog names, amounts as `N..` ranges (or
    exactly, as resources.exact says), the CPU architecture where the task gives it (`x86:28..`)."""
    resources: dict = {}
    if "shm_size" in keys and res.shm_size:
        resources["shm_size"] = dstack_size(res.shm_size)  # a size dstack gives the container, not an offer filter
    if "memory" in keys and res.memory:
        resources["memory"] = amount(res, "memory")
    resources["disk"] = amount(res, "disk") if res.disk else f"{DEFAULT_DISK}.."
    if res.gpus:
        resources["gpu"] = dstack_gpu(res.gpus)
    if "cpu" in keys and (res.cpus or cpu_arch):
        resources["cpu"] = ":".join(part for part in (cpu_arch, res.cpus and amount(res, "cpus")) if part)
    return resources


#: How many of dstack's latest runs `ps` looks through for a cluster's run.
PS_RUNS = 100


#: Which storage the nodes of one dstack run share, read in dstack 0.22.5. A network volume is one cloud disk that
#: dstack attaches to each job's instance (server/background/pipeline_tasks/jobs_submitted.py,
#: _process_volume_attachments: a failed attach ends the job VOLUME_ERROR, after its instance was provisioned), and
#: the run's offers are limited to the volume's backend and region (server/services/offers.py).
SHARING = (
    Sharing("volume", "runpod", "yes", "a RunPod network volume mounts in many pods of its data center at once; "
            "dstack's volume docs: mounting one volume in several runs and instances \"is currently supported only "
            "by the `runpod` backend\" (concepts/volumes.md, FAQ)"),
    Sharing("volume", "kubernetes", "if its PersistentVolumeClaim is ReadWriteMany",
            "a dstack Kubernetes volume is a PVC whose `access_modes` default to ReadWriteOnce "
            "(core/models/volumes.py, KubernetesVolumeConfiguration); a ReadWriteOnce claim mounts on one "
            "Kubernetes node, and dstack does not check it"),
    Sharing("volume", "aws", "no", "an EBS volume attaches to one instance: the second node's attach fails "
            "(aws/compute.py attach_volume, VolumeInUse) after its instance is billed, and its job ends VOLUME_ERROR"),
    Sharing("volume", "gcp", "no", "a persistent disk is attached read-write to one instance (gcp/compute.py "
            "attach_volume, READ_WRITE): the second node's attach fails as on aws"),
    Sharing("volume", "other backends, SSH fleets", "no", "no network volumes (only aws, gcp, kubernetes, runpod, "
            "daytona and lium implement ComputeWithVolumeSupport, core/backends/base/compute.py; daytona and lium run "
            "no multi-node task)"),
    Sharing("volume", "any, a name with `${{ dstack.node_rank }}`", "no", "one volume per node (dstack interpolates "
            "the name per job: server/services/jobs/configurators/base.py, interpolate_job_volumes): not shared"),
    Sharing("host_path", "any", "if it is one network filesystem mounted on every host",
            "you declare it (an NFS or Lustre mount on an SSH fleet's hosts): dstack mounts the host's directory "
            "(instance_path) and shares nothing itself; it mounts no shared filesystem on cloud instances"),
)


def volume_backends(sharing=SHARING) -> list[str]:
    """The backends on which one dstack network volume can be mounted by every node of a run (perhaps with a
    condition `check` cannot see), from the rules."""
    return [rule.backend for rule in sharing
            if rule.form == "volume" and rule.shared != "no" and "`" not in rule.backend]


def per_node_name(volume: str) -> bool:
    """A volume name dstack interpolates per job (`ckpt-${{ dstack.node_rank }}`): each node its own volume."""
    return bool(re.search(r"\$\{\{\s*dstack\.(node_rank|job_num)\s*\}\}", volume))


class DstackShared(StrictModel):
    """`checkpoints.shared.dstack`: storage every node mounts at checkpoints.path."""

    volume: str | None = Field(None, description=(
        "a dstack network volume; for several nodes only where every backend the run may land on mounts one in "
        "several instances (placement.backends: [runpod]; kubernetes with a ReadWriteMany claim)"))
    host_path: str | None = Field(None, description="a directory on every fleet host that is the same storage "
                                  "on all of them (e.g. an NFS mount): you declare it shared")

    _absolute = field_validator("host_path")(classmethod(lambda cls, v: require_absolute(v, "it is a host path")))

    @model_validator(mode="after")
    def _one(self):
        if (self.volume is None) == (self.host_path is None):
            raise ValueError("give exactly one of volume: NAME or host_path: /PATH")
        return self


_SECRET_NAME = r"^[A-Za-z0-9_-]+$"


class DstackSSH(StrictModel):
    """`placement.dstack.ssh`: the fleet is these hosts of yours (dstack's SSH fleet, `ssh_config`)."""

    hosts: list[str] = Field(min_length=1, description="the hosts' addresses or names, as SSH reaches them")
    user: str = Field(description="the user SSH logs in as on every host (root or one with passwordless sudo)")
    identity_file: str = Field(description="the private key file for that user (e.g. ~/.ssh/id_rsa), read by "
                               "`dstack apply` on this machine")
    port: int | None = Field(None, ge=1, le=65535, description="the SSH port, when not 22")
    network: str | None = Field(None, description="the hosts' private network (10.0.0.0/24): dstack takes the "
                                "nodes' addresses from it; without it, the first internal one found")


class DstackRegistryAuth(StrictModel):
    """`placement.dstack.registry_auth`: credentials for a private image, the password by a dstack secret's name."""

    username: str = Field(description="the registry user (e.g. oauth2accesstoken, AWS, your user name)")
    password_secret: str = Field(pattern=_SECRET_NAME, description=(
        "the name of a dstack secret holding the password or token (`dstack secret set NAME VALUE`): the "
        "rendered file names it as ${{ secrets.NAME }}, never the value"))


class DstackPlacement(StrictModel):
    """`placement.dstack`: dstack's own options."""

    ssh: DstackSSH | None = Field(None, description=(
        "the fleet is your own hosts over SSH (an on-prem or rented cluster): the rendered fleet has ssh_config "
        "with them instead of cloud instances, and the task runs on it"))
    user: str | None = Field(None, description=(
        "the user inside the image's containers (dstack's `user:`, e.g. root or 1000:1000); with cpu_arch, dstack "
        "needs no look-up of the image's configuration in its registry at submit time"))
    cpu_arch: Literal["x86", "arm"] | None = Field(None, description="the image's CPU architecture (x86 or arm)")
    registry_auth: DstackRegistryAuth | None = Field(None, description="credentials for a private registry")


def dstack_placement(placement) -> DstackPlacement:
    return provider_part(DstackPlacement, placement.dstack, "placement.dstack")


def fleet_name(plan: Plan) -> str:
    return f"{plan.name}-fleet"


def secret_name(cluster: str, variable: str) -> str:
    """The dstack project secret that holds `variable` for `cluster`: `rlhf_tasks__my_run__HF_TOKEN`.

    A project's secrets are one namespace for all its runs, so each cluster has its own (two clusters' Ray
    tokens differ; `down` of one leaves the other's). A reference's name may hold only letters, digits and
    `_` after `secrets.` (utils/interpolator.py Name: no `-`, though the server's own rule for a secret's name
    takes `-`: services/secrets.py _SECRET_NAME_REGEX), so the cluster's dashes become `_`; a cluster name has no
    `__` and ends in a letter or digit, so the first `__` after the prefix ends it: no two clusters' names meet."""
    return f"{SECRET_PREFIX}{cluster.replace('-', '_')}__{variable}"


#: What every project secret of ours begins with (secret_name).
SECRET_PREFIX = "rlhf_tasks__"
#: dstack's limits on a secret (server/services/secrets.py _SECRET_NAME_REGEX, _SECRET_VALUE_MAX_LENGTH).
SECRET_NAME_MAX, SECRET_VALUE_MAX = 200, 5000


def secret_variables(plan: Plan) -> list[str]:
    """The variables that go through dstack's project secrets: the task's secrets and the Ray token's."""
    return list(plan.secrets) + ([plan.token_env] if plan.token_env else [])


def secret_reference(cluster: str, variable: str) -> str:
    """What the job's env says for `variable`: dstack's server puts the project secret's value in."""
    return f"${{{{ secrets.{secret_name(cluster, variable)} }}}}"


def job_script(plan: Plan) -> str:
    """`commands` as one item: dstack runs `bash -i -c "<items joined with ' && '>"`, where a failing line inside a
    multi-line item does not stop the next (no `set -e`); one script under `set -e` stops at the first failure."""
    return "\n".join(["set -e", *plan.setup, agent_command(plan)]) + "\n"


# ------------------------------------------------------------------ what dstack's `files:` archive packs

def dstack_packs(path: str) -> workdir.Measure:
    """What `dstack apply` archives of a `files:` directory (utils/files.py create_file_archive: the `ignore`
    walk with .gitignore and .dstackignore, .git left out, hidden files kept), as bytes of its tar."""
    root = Path(path).absolute()
    out = workdir.Measure(str(path), how="dstack's own walk (the ignore package)")
    sizes: dict[str, int] = {}

    def add(p: Path) -> None:
        rel = p.relative_to(root)
        if not rel.parts:
            return
        size = 512 + (-(-p.stat().st_size // 512) * 512 if p.is_file() else 0)  # a tar header, the data padded
        sizes[rel.parts[0]] = sizes.get(rel.parts[0], 0) + size

    try:
        import ignore
        import ignore.overrides
    except ImportError:
        out.how = "rlhf-tasks' own walk (dstack is not installed here; it follows .gitignore and .dstackignore)"
        rules = [lambda p: p.name == ".git" and p.is_dir()]
        workdir._travel(root, rules, add, ignore_files=(".gitignore", ".dstackignore"))
    else:
        walk = (ignore.WalkBuilder(root).overrides(ignore.overrides.OverrideBuilder(root).add("!/.git/").build())
                .hidden(False).require_git(False).add_custom_ignore_filename(".dstackignore").build())
        for entry in walk:
            add(Path(entry.path()))
    out.size = sum(sizes.values()) + 1024  # the tar's two end blocks
    out.biggest = sorted(sizes.items(), key=lambda item: -item[1])
    return out


def upload_limit() -> int:
    return int(os.environ.get("DSTACK_SERVER_CODE_UPLOAD_LIMIT") or DEFAULT_UPLOAD_LIMIT)


class DstackProvider(Provider):
    name = "dstack"
    state_elsewhere = "dstack ps"
    shared_option = ("checkpoints.shared.dstack: {host_path: /PATH} (a directory every fleet host mounts) or {volume: "
                     "NAME} with placement.backends: [runpod]")
    sharing = SHARING
    placement_options = DstackPlacement
    contract = Contract(
        rank=env("DSTACK_NODE_RANK"),
        nodes=env("DSTACK_NODES_NUM"),
        head=env("DSTACK_MASTER_NODE_IP"),
        node_addr=env("DSTACK_NODES_IPS", item="rank"),
        cluster_id=env("DSTACK_RUN_NAME"),
        gpus_per_node=env("DSTACK_GPUS_PER_NODE"),
    )
    #: (plan_price: an SSH fleet's hosts, which dstack prices at $0, are counted at placement.price_per_hour)
    price_source = "dstack's run plan at launch (its dearest offer for each node)"
    price_bound = "dstack's max_price"
    #: `dstack apply`'s port forward ends with the launch (Ctrl-C detaches it): `forward` is `dstack attach`.
    forward_after_launch = True
    #: What the last plan's job.working_dir packs as dstack archives it (None: nothing shipped).
    packed: workdir.Measure | None = None
    #: The fleet this launch applied (and `abandon` deletes when the launch fails before its job).
    _made_fleet: str | None = None
    #: The project secrets this launch set (and `abandon` deletes when the launch fails before its job).
    _set_secrets: list[str] = []
    #: The environment this launch runs dstack's commands with: the launcher's, less the secrets' variables.
    _cli_env: dict[str, str] | None = None

    def check(self, task: Task) -> None:
        long = [variable for variable in task.secrets if len(secret_name(task.name, variable)) > SECRET_NAME_MAX]
        if long:
            raise BadInput(f"secrets.{long[0]}: its dstack project secret's name ({SECRET_PREFIX}<name>__<variable>) "
                           f"would be longer than dstack's {SECRET_NAME_MAX} characters; use a shorter variable name")
        options = dstack_placement(task.placement)
        self.check_volume(task, shared_entry(DstackShared, task.checkpoints.shared.get(self.name), self.name), options)
        if not task.image:
            for field in ("user", "cpu_arch", "registry_auth"):
                if getattr(options, field) is not None:
                    raise BadInput(f"placement.dstack.{field}: it is for a custom image, and the task gives no image "
                                   f"(dstack's default image runs as root on x86)")
        if options.ssh and task.placement.spot != "off":
            raise BadInput(f"placement.spot: {task.placement.spot}: an SSH fleet's hosts (placement.dstack.ssh) are "
                           f"no spot instances; leave placement.spot out")
        if options.ssh and (task.placement.backends or task.placement.regions):
            which = "backends" if task.placement.backends else "regions"
            raise BadInput(f"placement.{which}: the task runs on its SSH fleet (placement.dstack.ssh), which has "
                           f"no cloud {which}; leave placement.{which} out")

    def check_volume(self, task: Task, shared: DstackShared | None, options: DstackPlacement) -> None:
        """One network volume for every node only where the run can land on backends that mount it in several
        instances at once (SHARING): elsewhere the second node's attach fails once its instance is billed."""
        if not shared or not shared.volume:
            return
        where = "checkpoints.shared.dstack.volume"
        instead = ("checkpoints.shared.dstack: {host_path: /PATH} (a directory every fleet host mounts, e.g. an NFS "
                   "on an SSH fleet), or checkpoints.shared.sky: {bucket: ...} with --provider sky")
        if per_node_name(shared.volume):
            raise BadInput(f"{where}: {shared.volume} names one volume per node (dstack interpolates it per job), "
                           f"which no other node sees: it is not shared storage; use one volume on runpod "
                           f"(placement.backends: [runpod]) or {instead}")
        if options.ssh:
            raise BadInput(f"{where}: {shared.volume}: an SSH fleet (placement.dstack.ssh) has no dstack network "
                           f"volumes (only cloud backends implement them); use {instead}")
        if task.nodes < 2:
            return
        backends = list(task.placement.backends)
        allowed = volume_backends()
        outside = [b for b in backends if b.lower() not in allowed]
        if backends and not outside:
            return
        lands = f"placement.backends lists {', '.join(outside)}" if backends else \
            "placement.backends is empty, so the run may land on any backend"
        raise BadInput(
            f"{where}: {shared.volume}: one dstack network volume for {task.nodes} nodes is mounted by all of them "
            f"only on {' or '.join(allowed)} (a RunPod network volume; a ReadWriteMany claim), and {lands}: an "
            f"aws (EBS) or gcp volume attaches to one instance, and the second node's attach fails after its "
            f"instance is billed (the job ends VOLUME_ERROR, then dstack's retry starts over); set "
            f"placement.backends: [runpod] for a RunPod volume, or use {instead}. A volume per node "
            f"(NAME-${{{{ dstack.node_rank }}}}) is no shared storage, so not for checkpoints every node reads")

    def retries(self, plan: Plan) -> Retries | None:
        """dstack's `retry` (server/background/pipeline_tasks/runs/active.py, _should_retry_job): a job that ended
        with a termination reason whose retry event is in `on_events` is submitted again (core/models/runs.py,
        JobTerminationReason.to_retry_event: no capacity, an interruption, and every other FAILED reason is
        `error`, a non-zero exit CONTAINER_EXITED_WITH_ERROR among them); `retry.duration` (1 h by default)
        counts from the run's submission for no capacity, but from the last provisioned submission for an
        interruption or an error, so it never bounds how often a job that provisions and fails is relaunched.
        An exit 0 is DONE_BY_RUNNER, which is never retried (_job_is_done_or_finishing_done), and with
        `stop_criteria: master-done` ends the run: the head ends with it at a cap, and at the last failure
        placement.retry.errors allows, which the head counts in the spend record."""
        if not plan.placement.retry:
            return None
        errors = plan.placement.retry_errors
        return Retries(on="no capacity or an interruption" + (
            f", and after the job's own failure at most {errors} times (dstack counts none: the head does, in the "
            f"spend record, and ends the last one with exit 0, which dstack does not retry)" if errors else ""),
            unbounded="dstack's retry.duration counts from the last interruption or error, not the first",
            cites="dstack's server/background/pipeline_tasks/runs/active.py _should_retry_job",
            on_failure=bool(errors), cap_exit=0, error_retries=errors or None)

    # ------------------------------------------------------------------ job.working_dir

    def ships_working_dir(self, plan: Plan) -> bool:
        """job.working_dir travels in dstack's `files:` when the head submits the job (`submit: client`
        uploads it from here through Ray)."""
        return bool(plan.job.working_dir) and plan.job.submit == "head"

    def measure_upload(self, plan: Plan) -> Plan:
        """A shipped job.working_dir measured as `dstack apply` archives it, and refused (at check, render
        and launch) over the server's limit; `submit: client` uploads it through Ray (measured as everywhere)."""
        plan = super().measure_upload(plan)
        self.packed = dstack_packs(plan.job.working_dir) if self.ships_working_dir(plan) else None
        limit = self.over_limit(plan)
        if limit:
            raise BadInput(limit)
        return plan

    def files_path(self, plan: Plan) -> str:
        """job.working_dir as `dstack apply` resolves a `files:` path: relative to the rendered file's directory."""
        here = os.path.abspath(self.render_dir or ".")
        return os.path.relpath(os.path.abspath(os.path.expanduser(plan.job.working_dir)), here)

    def node_plan(self, plan: Plan) -> Plan:
        """The plan the nodes read: a shipped working_dir is JOB_DIR, where dstack unpacks it."""
        if not self.ships_working_dir(plan):
            return plan
        return plan.replace(job=plan.job.model_copy(update={"working_dir": JOB_DIR}))

    def working_dir_words(self, plan: Plan) -> str | None:
        if not self.ships_working_dir(plan):
            return None
        packed = self.packed
        size = f" ({workdir.human(packed.size)} as dstack packs it, its limit {workdir.human(upload_limit())})" \
            if packed else ""
        return (f"{plan.job.working_dir}{size}: `dstack apply` ships it (dstack's files:, leaving out what .gitignore "
                f"and .dstackignore name) to {JOB_DIR} on every node, where the job's commands run (dstack's "
                f"working_dir), and the head submits the job from there (leaving out job.excludes)")

    def over_limit(self, plan: Plan) -> str | None:
        """Why dstack's server would refuse the shipped working_dir, with what to leave out; None when it fits."""
        packed, limit = self.packed, upload_limit()
        if not self.ships_working_dir(plan) or packed is None or not limit or packed.size <= limit:
            return None
        top = [(name + ("/" if (Path(plan.job.working_dir) / name).is_dir() else ""), size)
               for name, size in packed.biggest[:5] if size * 100 >= packed.size]
        listed = ", ".join(f"{name} {workdir.human(size)}" for name, size in top)
        lines = ", ".join(f"/{name}" for name, _ in workdir.enough(top, packed.size - limit + 1))
        return (f"job.working_dir: {plan.job.working_dir} packs {workdir.human(packed.size)} as `dstack apply` archives "
                f"it (measured with {packed.how}), over the dstack server's limit of {workdir.human(limit)} "
                f"(DSTACK_SERVER_CODE_UPLOAD_LIMIT, set on the server: where yours is higher, set it here too); the "
                f"biggest entries: {listed}. dstack's files: "
                f"reads .gitignore and .dstackignore there, not job.excludes: list what the job does not need in "
                f"{Path(plan.job.working_dir) / '.dstackignore'} (one a line, e.g. {lines}), or set job.working_dir to the "
                f"directory of the job's code only (null: none)")

    # ------------------------------------------------------------------ what check and render say

    def shared_storage_warning(self, plan: Plan) -> str | None:
        """A line for `check` and `render` when a multi-node run resumes from per-host directories."""
        if plan.nodes < 2 or not plan.unshared_checkpoints:
            return None
        return (f"checkpoints {plan.checkpoint_dir} is a directory on each dstack host (instance_path): "
                f"the {plan.nodes} nodes do not share it, and a resumed run may land on other hosts; add "
                f"{self.shared_option}")

    def notes(self, plan: Plan) -> list[str]:
        out = super().notes(plan)
        options = dstack_placement(plan.placement)
        if plan.image and (options.user is None or options.cpu_arch is None):
            missing = " and ".join(f for f in ("user", "cpu_arch") if getattr(options, f) is None)
            out.append(f"image {plan.image}: without placement.dstack.{missing}, dstack's server reads the image's "
                       f"configuration from its registry when the run is submitted (a private registry needs "
                       f"placement.dstack.registry_auth; an image the registry cannot serve fails the run)")
        if plan.budget.max_cost is not None and plan.budget.price_per_hour is None:
            out.append("placement.max_cost: a `dstack apply` of the rendered file by hand counts no price, so its head "
                       "never stops the job at the cap (placement.max_duration still holds); `rlhf-tasks launch` counts "
                       "dstack's run plan's price (and refuses a plan that prices the offers at $0, an SSH fleet's); "
                       "give placement.price_per_hour for a hand apply")
        shared = shared_entry(DstackShared, plan.checkpoint_shared, self.name)
        if shared and shared.volume and plan.nodes > 1:
            for rule in SHARING:
                if rule.form == "volume" and rule.shared.startswith("if ") and \
                        rule.backend in [b.lower() for b in plan.placement.backends]:
                    out.append(f"checkpoints.shared.dstack.volume {shared.volume} on {rule.backend}: every node mounts "
                               f"it only {rule.shared} ({rule.why}): `check` cannot see it")
        return out

    # ------------------------------------------------------------------ dstack's own code

    def ask_own_code(self, plan: Plan) -> list[str]:
        """The render as dstack's own code takes it, where dstack is installed here (offline): its backend
        names (BackendType), its configuration models (parse_apply_configuration, what `dstack apply`
        parses), and the GPU names its offers can match: dstack compares an offer's GPU name with the
        spec's, ignoring case (core/backends/base/offers.py, gpu_matches_gpu_spec), and the names offers
        carry are gpuhunt's (gpuhunt's KNOWN_ACCELERATORS, with the memory sizes each comes in), so a name
        outside that table matches no offer."""
        try:
            import gpuhunt
            from dstack._internal.core.errors import ConfigurationError
            from dstack._internal.core.models.backends.base import BackendType
            from dstack._internal.core.models.configurations import parse_apply_configuration
            from dstack.version import __version__ as version
        except ImportError:
            return ["dstack's configuration models, backend names and GPU table (gpuhunt): not checked: dstack is "
                    "not installed here (pip install 'rlhf-tasks[dstack]')"]
        import yaml

        from ..models import did_you_mean

        parsed = {}
        for name, text in self.render(plan).items():
            if name.endswith(".dstack.yml"):
                try:
                    parsed[name] = parse_apply_configuration(yaml.safe_load(text))
                except ConfigurationError as exc:
                    field = _field_of(str(exc))
                    hint = ""
                    if field.startswith("placement.backends["):  # the backend names are BackendType's
                        wrong = plan.placement.backends[int(field.split("[")[1].rstrip("]"))]
                        hint = "\n  " + did_you_mean(wrong, [b.value for b in BackendType], "its backends")
                    raise BadInput(f"{field}: dstack {version} refuses {name}: "
                                   + str(exc).strip().replace("\n", "\n  ") + hint) from None
        gpu = plan.resources.gpus
        notes: list[str] = []
        if gpu and not gpu.isdigit():
            table: dict[str, set[int]] = {}
            for accelerator in gpuhunt.KNOWN_ACCELERATORS:
                table.setdefault(accelerator.name, set()).add(int(accelerator.memory))
            lower = {name.lower(): name for name in table}
            spec = next(iter(parsed.values())).resources.gpu
            memory = spec.memory
            if not spec.name and memory is not None:  # by memory alone: the GPUs gpuhunt has of that memory
                fits = sorted(n for n, sizes in table.items() if any(
                    (memory.min is None or memory.min <= size) and (memory.max is None or size <= memory.max)
                    for size in sizes))
                if not fits:
                    raise BadInput(f"resources.gpus: {gpu}: gpuhunt's GPU table has no GPU of {memory}, so no "
                                   f"dstack offer matches {dstack_gpu(gpu)} (its GPUs' memory: "
                                   f"{', '.join(f'{size}GB' for size in sorted({s for v in table.values() for s in v} - {0}))})")
                notes.append(f"resources.gpus {gpu}: dstack takes any GPU of gpuhunt's table with that memory: "
                             f"{', '.join(fits)}")
            for name in spec.name or []:
                if name.lower() not in lower:
                    raise BadInput(f"resources.gpus: {gpu}: dstack {version} renders GPU name {name!r}, which no "
                                   f"dstack offer carries: gpuhunt's GPU table has no such GPU "
                                   f"{did_you_mean(name, sorted(table), 'its GPUs')}")
                sizes = table[lower[name.lower()]]
                memory = spec.memory
                if memory is not None and memory.min is not None and not any(
                        memory.min <= size <= (memory.max if memory.max is not None else size) for size in sizes):
                    raise BadInput(f"resources.gpus: {gpu}: gpuhunt's GPU table has {lower[name.lower()]} with "
                                   f"{', '.join(f'{size}GB' for size in sorted(sizes))} only, so no dstack offer "
                                   f"matches {dstack_gpu(gpu)}")
        return [f"dstack {version}'s configuration models (parse_apply_configuration) take "
                f"{' and '.join(parsed)}; backends and GPU names are dstack's and gpuhunt's", *notes]

    # ------------------------------------------------------------------ the rendered files

    def task_config(self, plan: Plan, files: dict[str, str]) -> dict:
        res, placement = plan.resources, plan.placement
        options = dstack_placement(placement)
        config: dict = {"type": "task", "name": plan.name, "nodes": plan.nodes}
        if plan.image:
            config["image"] = plan.image
            config["shell"] = "bash"
            if options.user:
                config["user"] = options.user
            if options.registry_auth:
                config["registry_auth"] = {"username": options.registry_auth.username,
                                           "password": f"${{{{ secrets.{options.registry_auth.password_secret} }}}}"}
        env = [f"{k}={v}" for k, v in plan.env.items()]
        env += [f"{name}={secret_reference(plan.name, name)}" for name in secret_variables(plan)]
        if env:
            config["env"] = env
        config["files"] = [f"{LOCAL_DIR}:{NODE_DIR}"]  # one archive of the directory rendered beside
        if self.ships_working_dir(plan):
            config["files"].append(f"{self.files_path(plan)}:{JOB_DIR}")
            config["working_dir"] = JOB_DIR
        config["commands"] = [job_script(plan)]
        config["ports"] = [plan.ray.dashboard_port]
        config["resources"] = dstack_resources(res, ("shm_size", "memory", "cpu"), options.cpu_arch)
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
        if max_price(plan):
            config["max_price"] = max_price(plan)
        if placement.retry:  # the job's own failure only when asked: a bad flag fails every attempt alike
            config["retry"] = {"on_events": ["no-capacity", "interruption"] + (["error"] if placement.retry_errors
                                                                               else [])}
        if placement.max_duration:
            config["max_duration"] = int(placement.max_duration)  # seconds
        if placement.fleets or options.ssh:  # an SSH fleet's hosts are the task's own
            config["fleets"] = list(placement.fleets) or [fleet_name(plan)]
        for key in ("backends", "regions"):
            if getattr(placement, key):
                config[key] = list(getattr(placement, key))
        return config

    def fleet_config(self, plan: Plan) -> dict:
        """A fleet with `placement: cluster` (nodes on one fast network) that fits the task.

        On cloud backends, `nodes: {min: 0, max: N}`: the fleet starts empty, the run provisions its N instances
        in it, and an instance idle for `idle_duration` (placement.idle where the task sets it, `never` rendering
        `off`; else FLEET_IDLE_S) is terminated, since dstack terminates only instances above `nodes.min`
        (fleets.py, idle_duration): nothing is left billing. With placement.dstack.ssh, the user's hosts in
        `ssh_config`, and none of the cloud fleet's fields, which dstack refuses for an SSH fleet.
        """
        placement = plan.placement
        ssh = dstack_placement(placement).ssh
        fleet: dict = {"type": "fleet", "name": fleet_name(plan)}
        if ssh:
            fleet["placement"] = "cluster"
            fleet["ssh_config"] = {key: value for key, value in ssh.model_dump().items() if value is not None}
            return fleet
        idle = placement.idle if "idle" in placement.model_fields_set else FLEET_IDLE_S
        fleet.update({"nodes": {"min": 0, "max": plan.nodes}, "idle_duration": int(idle) if idle else "off",
                      "placement": "cluster"})
        fleet["resources"] = dstack_resources(plan.resources, ())
        fleet["spot_policy"] = SPOT[plan.placement.spot]
        if max_price(plan):  # a cloud fleet's field (dstack refuses it for an SSH fleet); the lower of the two counts
            fleet["max_price"] = max_price(plan)
        for key in ("backends", "regions"):
            if getattr(plan.placement, key):
                fleet[key] = list(getattr(plan.placement, key))
        return fleet

    def render(self, plan: Plan) -> dict[str, str]:
        files = shipped_files(self.node_plan(plan))
        header = f"# Rendered by rlhf-tasks for dstack; apply with: dstack apply -f <this file>\n"
        if secret_variables(plan):
            header += ("# Secrets: dstack project secrets, put into the job's env by dstack's server (`rlhf-tasks\n"
                       "# launch` sets them, `rlhf-tasks down` deletes them). To apply this file by hand, set each\n"
                       "# first (dstack's CLI takes the value as an argument) and delete each after the run\n"
                       "# (dstack secret delete NAME -y):\n")
            for name in secret_variables(plan):
                value = f"$(rlhf-tasks token {plan.name})" if name == plan.token_env else f"${name}"
                header += f"#   dstack secret set {secret_name(plan.name, name)} \"{value}\"\n"
        if self.ships_working_dir(plan):
            header += (f"# (dstack apply resolves files: against the directory this file is in: job.working_dir "
                       f"{plan.job.working_dir} is {self.files_path(plan)} from there)\n")
        out = {f"{plan.name}.dstack.yml": dump_yaml(self.task_config(plan, files), header),
               f"{fleet_name(plan)}.dstack.yml": dump_yaml(
                   self.fleet_config(plan), f"# {WRITTEN_BY} for dstack: the fleet {plan.name} runs on. "
                   "Apply once before the task: dstack apply -f <this file>\n")}
        out.update(files)
        return out

    # ------------------------------------------------------------------ launch and down

    def ready(self, plan: Plan) -> None:
        require_cli("dstack", "dstack")
        limit = self.over_limit(plan)
        if limit:
            raise BadInput(limit)

    def refuses_missing_secrets(self, plan: Plan, missing: list[str]) -> str | None:
        return ("`launch` sets each as a dstack project secret that the job's env references, and dstack's server "
                "fails a job whose secret is not there (\"Secrets interpolation error\")")

    def ask(self, what: str, args: list[str], directory: Path | None, env: dict[str, str],
            given: dict | None = None) -> dict:
        """dstack's server through dstack's own Python API (dstack_api.py, run by the `dstack` command's
        interpreter; `given` on its stdin, as JSON: never on its command line): the answer as data, or StepFailed
        with what dstack said."""
        script = str(Path(__file__).with_name("dstack_api.py"))
        out = subprocess.run([dstack_python(require_cli("dstack", "dstack")), "-I", script, *args], cwd=directory,
                             env=env, capture_output=True, text=True, timeout=300,
                             **({"input": json.dumps(given)} if given is not None else {"stdin": subprocess.DEVNULL}))
        if out.returncode != 0:
            raise StepFailed(what, (out.stderr.strip() or out.stdout.strip())[-2000:] or f"exit code {out.returncode}")
        return json.loads(out.stdout)

    def fleet_to_make(self, plan: Plan, fleets: list[str]) -> str | None:
        """The rendered fleet, when `launch` applies it: the task names no fleets of its own, no fleet of that
        name is there, and the run has no other fleet (dstack runs nothing without one) or the fleet is the
        task's own SSH hosts. A fleet already there is the user's, and stays."""
        name = fleet_name(plan)
        if plan.placement.fleets or name in fleets:
            return None
        return name if (dstack_placement(plan.placement).ssh or not fleets) else None

    def refuse_without_offers(self, plan: Plan, answer: dict, yml: str) -> None:
        """BadInput, before anything is submitted, when dstack's own plan has no offer for a job of the run
        (`dstack apply -d` would submit it, and the job would fail FAILED_TO_START_DUE_TO_NO_CAPACITY)."""
        empty = [job for job in answer.get("jobs", []) if not job.get("offers")]
        if not empty:
            return
        fleets = list(plan.placement.fleets) or answer.get("fleets") or []
        where = f"the fleets {', '.join(fleets)}" if fleets else "no fleet"
        raise BadInput(
            f"dstack's plan for {plan.name} has no offer for {len(empty)} of its {len(answer['jobs'])} jobs "
            f"({empty[0].get('requirements')}) on {where}: `dstack apply -f {yml}` would submit a run that fails "
            f"with no capacity. See what fits with `dstack offer` (its --gpu, --cpu, --disk options), then change "
            f"resources (amounts are minimums unless in resources.exact), placement.fleets, backends or regions, or "
            f"apply a fleet that has the hosts ({fleet_name(plan)}.dstack.yml is rendered beside the task)")

    def counted_plan(self, plan: Plan, answer: dict) -> Plan:
        """The plan with the price its head counts: dstack's plan's (plan_price), where it prices the offers; the
        task's otherwise. BadInput, before anything is submitted, for a cap no price can count."""
        price = plan_price(answer, plan.placement.price_per_hour)
        if price is None and plan.budget.max_cost is not None:
            raise BadInput(f"placement.max_cost: dstack's plan for {plan.name} prices its offers at $0 (an SSH fleet's "
                           f"hosts: dstack knows no price of them), so the head agent could not count the cost; give "
                           f"placement.price_per_hour (US dollars per hour for the whole cluster), or use "
                           f"placement.max_duration")
        return plan.replace(budget=plan.budget.model_copy(update={"price_per_hour": price}))

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """The fleet when the run has none (`dstack apply` of the rendered fleet), dstack's plan asked (no offer:
        refused before anything is submitted), then `dstack apply` of the task, which attaches and forwards
        job 0's ports (the head's dashboard) to localhost."""
        dstack = require_cli("dstack", "dstack")
        directory, token, env = self.stage(plan, secrets)
        values = {name: env[name] for name in secret_variables(plan) if env.get(name)}
        env = {k: v for k, v in env.items() if k not in values}  # dstack's CLI needs none of them: the server does
        self._cli_env = env
        yml = f"{plan.name}.dstack.yml"
        dashboard = f"http://localhost:{plan.ray.dashboard_port}"
        self._made_fleet = self.fleet_to_make(plan, self.ask("listing dstack's fleets", ["fleets"], directory, env)
                                              ["fleets"])
        record = {"provider": self.name, "cluster_id": plan.name, "dashboard": dashboard,
                  "dashboard_port": plan.ray.dashboard_port}  # the head's port, which `forward` forwards
        if self._made_fleet:
            record["fleet_made"] = self._made_fleet  # `down` deletes it
            state.save(plan.name, record)
            print(f"dstack: applying the fleet {self._made_fleet} (the run has none): dstack apply -f "
                  f"{self._made_fleet}.dstack.yml", flush=True)
            made = subprocess.run([dstack, "apply", "-f", f"{self._made_fleet}.dstack.yml", "-y"], cwd=directory,
                                  env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if made.returncode != 0:
                raise StepFailed(f"dstack apply -f {self._made_fleet}.dstack.yml",
                                 (made.stdout + made.stderr).strip()[-2000:])
        answer = self.ask("asking dstack for the run's plan", ["plan", yml], directory, env)
        self.refuse_without_offers(plan, answer, yml)
        counted = self.counted_plan(plan, answer)
        if counted.budget.price_per_hour != plan.budget.price_per_hour:  # the head reads its price from the files
            plan = counted
            write_files(directory, self.render(plan))
            print(f"dstack: the head counts ${plan.budget.price_per_hour:.2f}/h for the cluster (dstack's plan: the "
                  f"dearest offer that fits each of the {plan.nodes} nodes)", flush=True)
        self.set_secrets(plan, values, record, directory, env)
        path = directory / "dstack-apply.log"
        with open(path, "ab") as log:  # an earlier launch's part stays; this one's head log starts at `start`
            start = log.tell()
            # its own session: a terminal's Ctrl-C reaches the launcher only, whose close() then SIGINTs it once
            # (`-y`: detach). A second SIGINT while dstack's CLI handles the first stops the run: ABORTED_BY_USER
            proc = subprocess.Popen([dstack, "apply", "-f", str(directory / yml), "-y"],
                                    cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

        kept: list[str] = []  # the head's log as dstack's server kept it, once `dstack apply` ended without it

        def head_log() -> str:
            """`dstack apply`'s output; once it has ended without the head's result line, after a run that ended
            before it attached (a job of seconds, or a failed job, which ends a multi-node run at once), job 0's
            log from dstack's server too. Only once apply said `NAME provisioning completed` (its own run was
            running or over by then): before that, `dstack logs NAME` could be an earlier run's of the name."""
            with open(path, "rb") as handle:
                handle.seek(start)
                text = handle.read().decode(errors="replace")
            if proc.poll() is None or RESULT_PREFIX in text or f"{plan.name} provisioning completed" not in text:
                return text
            if not kept:
                kept.append(server_head_log(dstack, plan.name, directory, env))
            return text + kept[0]
        def gather_here(reason: str) -> tuple[str, str] | None:
            scrub = {**secrets, **({"RAY_AUTH_TOKEN": token} if token else {})}
            made = bundle_from_dstack_logs(dstack, plan.name, plan.nodes, directory, env, scrub,
                                           str(state.run_dir(plan.name)), reason)
            return (made, f"each node's log as dstack's server kept it (`dstack logs {plan.name} --job N`)") \
                if made else None
        def close() -> None:
            """End the attach; once the run is over (not after Ctrl-C, which leaves it to `down`), its secrets go."""
            over = proc.poll() is not None
            end_attach(proc)
            if over and not cluster.interrupted and self._set_secrets and run_over(dstack, plan.name):
                print(forget_secrets(self, plan.name, env), flush=True)
                self._set_secrets = []
        state.save(plan.name, record)
        cluster = Cluster(name=plan.name, cluster_id=plan.name, dashboard=dashboard, token=token,
                          head_alive=lambda: proc.poll() is None, head_log=head_log, gather_here=gather_here,
                          close=close, price_per_hour=plan.budget.price_per_hour,
                          describe=lambda: [] if proc.poll() is None else [
                              f"dstack apply exited with code {proc.poll()}", *run_words(dstack, plan.name)])
        return cluster

    def set_secrets(self, plan: Plan, values: dict[str, str], record: dict, directory: Path,
                    env: dict[str, str]) -> None:
        """The task's secrets and the Ray token as dstack project secrets (secret_name), their values on
        dstack_api.py's stdin; their names recorded first, so that `down` (and `abandon`) delete them."""
        if not values:
            return
        names = {secret_name(plan.name, variable): value for variable, value in values.items()}
        long = [variable for variable in values if len(values[variable]) > SECRET_VALUE_MAX]
        if long:
            raise BadInput(f"secrets: {', '.join(long)} holds more than {SECRET_VALUE_MAX} characters, the most a "
                           f"dstack secret may hold (server/services/secrets.py); nothing was submitted")
        record["dstack_secrets"] = sorted(names)
        state.save(plan.name, record)
        self._set_secrets = sorted(names)
        self.ask("setting the task's secrets as dstack project secrets", ["secrets-set"], directory, env, names)
        print(f"dstack: set {len(names)} project secret(s), which the job's env references: "
              f"{', '.join(sorted(names))}", flush=True)

    def abandon(self, before: state.Before) -> list[str]:
        gone = None
        if self._set_secrets:
            try:
                self.ask("deleting the dstack project secrets this launch set", ["secrets-delete", *self._set_secrets],
                         None, self._cli_env or dict(os.environ))
                gone = f"the dstack project secrets it set ({', '.join(self._set_secrets)})"
            except StepFailed as exc:
                gone = f"the dstack project secrets this launch set are left ({', '.join(self._set_secrets)}): {exc}"
            self._set_secrets = []
        undone = super().abandon(before) + ([gone] if gone else [])
        if self._made_fleet:
            try:
                delete_fleet(self._made_fleet, deadline_s=60)
                undone.append(f"the fleet {self._made_fleet} it applied (dstack fleet delete)")
            except StepFailed as exc:
                undone.append(f"the fleet {self._made_fleet} this launch applied is left: {exc}")
            self._made_fleet = None
        return undone

    def forward(self, name: str, port: int | None = None) -> int:
        """`dstack attach NAME -p LOCAL:PORT` (dstack's own SSH tunnel through the fleet host to the head's dashboard
        port) until Ctrl-C. The address is said and recorded once the dashboard answers through it. The attach is
        ended with SIGINT, as dstack's CLI expects: its tunnel is a background `ssh -f` it closes itself
        (`ssh -O exit`) on the way out, which a SIGTERM would leave holding the port."""
        record = state.load(name) or {}
        remote = record.get("dashboard_port") or 8265
        local = port or remote
        tunnel, said = start_tunnel([require_cli("dstack", "dstack"), "attach", name, "-p", f"{local}:{remote}"])
        return hold_forward(name, tunnel, "dstack attach", f"http://localhost:{local}", timeout=120, said=said,
                            recorded=bool(record), end=end_attach,
                            then=f"eval \"$(rlhf-tasks env {name})\", rlhf-tasks logs {name} --bundle, "
                                 f"rlhf-tasks list --cluster {name}")

    def state_line(self, name: str) -> str | None:
        """The run's status as `dstack ps --json` gives it (dstack's Run: status, status_message, cost)."""
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
        """`dstack stop` of the run, then `dstack fleet delete` of the fleet `launch` applied for it (none: the
        fleet is the user's, and stays)."""
        record = state.load(name) or {}
        said = stop_with_cli([require_cli("dstack", "dstack"), "stop", name, "-y"], name)
        if record.get("dstack_secrets"):
            said += "\n" + forget_secrets(self, name, dict(os.environ), record)
        if record.get("fleet_made"):
            said += "\n" + delete_fleet(record["fleet_made"])
        return said


def forget_secrets(provider: DstackProvider, name: str, env: dict[str, str], record: dict | None = None) -> str:
    """Delete the project secrets `launch` set for cluster `name` (its record names them), and the names from
    the record: what was done."""
    record = record if record is not None else (state.load(name) or {})
    names = record.get("dstack_secrets") or []
    answer = provider.ask(f"deleting {name}'s dstack project secrets", ["secrets-delete", *names], None, env)
    if state.load(name) is not None:
        state.update(name, dstack_secrets=[])
    deleted = answer.get("deleted") or []
    return (f"dstack: deleted {len(deleted)} project secret(s) of {name}: {', '.join(deleted)}" if deleted else
            f"dstack: no project secret of {name} was left")


#: dstack's run states of a run that is over (core/models/runs.py RunStatus.is_finished).
RUN_OVER = ("terminated", "failed", "done")


def runs_named(dstack: str, name: str) -> list[dict] | None:
    """The runs of that name as `dstack ps --json` gives them, newest first; None when dstack cannot be asked."""
    try:
        out = subprocess.run([dstack, "ps", "--json", "--last", str(PS_RUNS)], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        return [run for run in json.loads(out.stdout).get("runs") or []
                if (run.get("run_spec") or {}).get("run_name") == name]
    except (OSError, subprocess.TimeoutExpired, ValueError, AttributeError):
        return None


def run_over(dstack: str, name: str) -> bool:
    """Whether dstack says the run `name` is over (`dstack ps --json`); False when it cannot be asked."""
    runs = runs_named(dstack, name)
    return bool(runs) and str(runs[0].get("status")) in RUN_OVER


def run_words(dstack: str, name: str) -> list[str]:
    """dstack's word on the run and each of its jobs (`dstack ps --json`: the run's status and termination reason,
    each job's last submission with its host and why it ended), each job named as the summary names nodes (job N is
    rank N): e.g. a worker's machine lost mid-run, which dstack's server fails `instance_unreachable` once it has not
    answered for 2 minutes (jobs_running.py JOB_DISCONNECTED_RETRY_TIMEOUT) and which ends the run `job_failed`.
    Nothing when dstack does not say."""
    runs = runs_named(dstack, name)
    if not runs:
        return []
    run, jobs = runs[0], []

    def words(reason) -> str:
        return str(reason).replace("_", " ")
    for job in sorted(run.get("jobs") or [], key=lambda j: (j.get("job_spec") or {}).get("job_num") or 0):
        sub = (job.get("job_submissions") or [{}])[-1]
        host = (sub.get("job_provisioning_data") or {}).get("hostname") or "no host"
        why = [words(sub["termination_reason"])] if sub.get("termination_reason") else []
        if sub.get("termination_reason_message"):
            why.append(sub["termination_reason_message"])
        if sub.get("exit_status") is not None:
            why.append(f"exit status {sub['exit_status']}")
        jobs.append(f"node{(job.get('job_spec') or {}).get('job_num')} ({host}) {sub.get('status')}"
                    + (f": {', '.join(why)}" if why else ""))
    reason = f" ({words(run['termination_reason'])})" if run.get("termination_reason") else ""
    return [f"dstack: the run {name} {run.get('status')}{reason}" + (f"; {'; '.join(jobs)}" if jobs else "")]


def server_head_log(dstack: str, name: str, directory: Path, env: dict[str, str]) -> str:
    """Job 0's log as dstack's server kept it (`dstack logs NAME`: the head's, result line included), for a run
    that ended before `dstack apply` attached to it: apply then shows none of it (it attaches only to a run that
    is running or done, and a failed job ends a multi-node run at once, JOB_FAILED). "" when dstack has none."""
    try:
        out = subprocess.run([dstack, "logs", name], cwd=directory, env=env, capture_output=True, timeout=120,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = out.stdout.decode(errors="replace").replace("\r\n", "\n")
    if out.returncode != 0 or not text.strip():
        return ""
    return f"[dstack: `dstack apply` ended without the head's log; `dstack logs {name}` from dstack's server:]\n" \
        + text + ("" if text.endswith("\n") else "\n")


def bundle_from_dstack_logs(dstack: str, name: str, jobs: int, directory: Path, env: dict[str, str],
                            secrets: dict[str, str], out_dir: str, reason: str) -> str | None:
    """A failure bundle made here of each job's log as dstack's server kept it (`dstack logs NAME --job N`: what
    each node's agent printed, the head's with the job's log it relays), the errors found in each, secrets
    scrubbed: for a run that is over, whose dashboard can no longer give Ray's logs. Its path, or None when dstack
    gave no log."""
    from ..agent.protocol.bundle import find_errors, first_error, node_order, scrub, write_bundle

    nodes, files, problems = [], [], []
    for job in range(jobs):
        try:
            out = subprocess.run([dstack, "logs", name, "--job", str(job)], cwd=directory, env=env,
                                 capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"dstack logs {name} --job {job}: {exc}")
            continue
        if out.returncode != 0:
            problems.append(f"dstack logs {name} --job {job}: "
                            f"{out.stderr.decode(errors='replace').strip()[-300:] or f'exit code {out.returncode}'}")
            continue
        text = scrub(out.stdout.decode(errors="replace").replace("\r\n", "\n"), secrets)
        label, file = f"node{job}", f"dstack-logs-job{job}.log"
        found = find_errors(text, file)
        nodes.append({"label": label, "ip": "", "state": f"dstack job {job}", "head": job == 0, "rank": job,
                      "first_error": first_error(found), "findings": found})
        files.append({"node": label, "label": label, "name": file, "text": text, "truncated": False,
                      "found": [f"{f['kind']}: {f['error']}" for f in found][:20]})
    if not files:
        return None
    first = [{"label": n["label"], "ip": "", "error": n["first_error"]["error"], "kind": n["first_error"]["kind"],
              "at": n["first_error"]["at"], "file": n["first_error"]["file"]} for n in node_order(nodes)]
    gathered = {"reason": scrub(reason, secrets), "made_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "nodes": [{k: v for k, v in n.items() if k != "findings"} for n in nodes], "first_errors": first,
                "files": files, "problems": problems,
                "state": json.dumps({"run": name, "jobs": [n["state"] for n in nodes]}, indent=2)}
    try:
        return write_bundle(gathered, out_dir, name)
    except OSError:
        return None


def end_attach(proc: subprocess.Popen) -> None:
    """End a `dstack attach` (or `dstack apply`) this launcher started: SIGINT, so that it closes its SSH tunnel
    itself (`dstack apply -y` detaches on it and leaves the run as it is), then SIGTERM and SIGKILL if it does not
    end. A `dstack apply` left behind would hold the dashboard's port for the next launch ("port 8265 is already in
    use") while it waits up to 30 s for the finished run's final status."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        end_process(proc)


def delete_fleet(name: str, deadline_s: float = 300) -> str:
    """`dstack fleet delete NAME -y`, again while dstack says the fleet is in use (its run still ending), until
    `deadline_s`; StepFailed with dstack's words after it."""
    dstack = require_cli("dstack", "dstack")
    started = time.monotonic()
    while True:
        out = subprocess.run([dstack, "fleet", "delete", name, "-y"], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL)
        said = (out.stdout.strip() + "\n" + out.stderr.strip()).strip()
        if out.returncode == 0 or "does not exist" in said:
            return said or f"dstack fleet delete {name}: done"
        elapsed = time.monotonic() - started
        if elapsed > deadline_s or not re.search(r"in use|being processed", said):
            raise StepFailed(f"dstack fleet delete {name}", said or f"exit code {out.returncode}")
        print(f"dstack: the fleet {name} is still in use by its ending run; deleting again "
              f"({elapsed:.0f}s of {deadline_s:.0f}s)", flush=True)
        time.sleep(3)  # between tries of a command dstack refuses while the run ends


#: The interpreter that holds dstack's package, where the `dstack` command is no Python script of its own (a
#: pyenv or asdf shim, a wrapper): `launch` asks dstack's server through it.
PYTHON_ENV = "RLHF_TASKS_DSTACK_PYTHON"


def dstack_python(dstack: str) -> str:
    """The interpreter the `dstack` command runs on: $RLHF_TASKS_DSTACK_PYTHON, this one when the command is
    beside it, else the command's `#!` when that names a Python (else this one)."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    if Path(dstack).parent == Path(sys.executable).parent:
        return sys.executable
    try:
        with open(dstack, "rb") as handle:
            first = handle.readline().decode(errors="replace").strip()
    except OSError:
        return sys.executable
    if first.startswith("#!"):
        words = shlex.split(first[2:])
        if words and "python" in Path(words[0]).name:
            return words[0]
    return sys.executable
