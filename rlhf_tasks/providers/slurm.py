"""Slurm: one self-contained batch script, submitted with `sbatch`.

The script carries the node agent and its plan (heredocs it writes to a directory of
the job beside its output, on the shared filesystem), and runs one step,
`srun --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=1`, with the agent on
every node: rank from SLURM_NODEID, the head the first host of `scontrol show hostnames
"$SLURM_JOB_NODELIST"` resolved to its IPv4 address (never 127.0.1.1: the agent then
takes its address on the route to the second host). The head agent submits the job
when the cluster is ready and exits with its result; the workers leave when the head
goes away; the script exits with the step's code, so Slurm's record of the job is the
job's. No sleeps: the agents wait for conditions. Secrets and the Ray token reach the
job from the submitting environment (`--export=ALL`), never through the script.

An `image` runs with pyxis (`srun --container-image`, the default) or, as verl's AMD
script does, with `docker run`/`podman run` on every node (`placement.slurm.container`).
Inside a container there is no `scontrol`, so the script expands the host list once
(RLHF_TASKS_HOSTS) and the contract reads it from there. A docker/podman container is not
the Slurm step's: the engine runs it (podman's conmon, docker's containerd-shim) outside
the step, so Slurm's signals and its final SIGKILL reach only the engine's client. Each
node's task therefore runs the client under a small wrapper (`container.sh`, beside the
agent) that stops and removes the container by its name, `<task name>-<job id>`, however
the task ends (its end, or Slurm's SIGTERM on scancel or the time limit); and after the
agents' step, one more step stops and removes every node's container by name, for a task
Slurm killed before it could (`--kill-on-bad-exit` sends SIGKILL KillWait after SIGTERM).

`launch` submits with `sbatch --parsable` and hands the launcher a handle: the agents'
output files on the shared filesystem (`rlhf-tasks-<id>/node<N>.out`; the head's holds the
Ray job's log) and Slurm's record of the job (its state and reason while it waits, its exit
code at the end); the launcher never needs to reach the cluster's dashboard. `status` asks Slurm for
the job and, through a second step beside the first (`srun --overlap`), Ray for the job;
`down` is `scancel`, waiting until every step is gone. For docker/podman, `down` first asks
(`scancel --signal=TERM`: a signal, not the kill): the wrappers stop their containers, a
clean-up step after the agents' removes any a killed task left on every node, and the job
ends by itself; only if it has not within a deadline is it cancelled. (After scancel's kill
the wrappers would have only Slurm's KillWait to stop them.)
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from .. import state
from ..agent.protocol import AGENT_ENTRY, AgentError, parse_result, wait_for
from ..console import say
from ..errors import BadInput, StepFailed
from ..models import StrictModel, size_bytes, size_text
from ..plan import Contract, Plan, check_contract_env, command, env, gpu_vendor
from ..spec import Placement, Task, provider_part
from .base import AMD_CONTAINER_OPTIONS, Cluster, Provider, Sharing, docker_size
from .shipping import AGENT, heredoc, module_files

HOSTS_ENV = "RLHF_TASKS_HOSTS"
NODELIST = ["scontrol", "show", "hostnames", "{SLURM_JOB_NODELIST}"]
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
MODULE_EOF, PLAN_EOF = "RLHF_TASKS_MODULE_PY", "RLHF_TASKS_PLAN_JSON"
#: The Slurm variables a container needs to be given by name (docker/podman start clean).
CONTRACT_VARS = ("SLURM_NODEID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_ID", HOSTS_ENV)
#: The GPUs Slurm gave the job, by vendor: passed on, since the container sees every device.
GPU_SELECTION_VAR = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "ROCR_VISIBLE_DEVICES"}
#: The container engines whose containers live outside the Slurm step (pyxis runs in it).
ENGINES = ("docker", "podman")
#: Every node's container is called this (one per node: each node has its own engine).
CONTAINER_NAME = "{name}-{job_id}"
#: Seconds a stopped container's agent gets (it stops Ray and the services) before the engine kills it.
CONTAINER_STOP_S = 20
CONTAINER_EOF = "RLHF_TASKS_CONTAINER_SH"
#: The per-node wrapper around `docker run`/`podman run`: the container goes when the task goes.
CONTAINER_SH = f"""\
#!/bin/bash
# rlhf-tasks: one node's container, stopped and removed by its name however this task ends.
# The engine runs the container outside the Slurm step, so Slurm's signals (and its SIGKILL,
# KillWait seconds after scancel or the time limit) reach only the engine's client.
#   container.sh NAME ENGINE run ...   runs `ENGINE run ... --name=NAME ...`, then removes NAME
#   container.sh NAME ENGINE stop      stops and removes NAME (the script's clean-up step)
name=$1 engine=$2
shift
stop() {{
    "$engine" stop --time={CONTAINER_STOP_S} "$name" >/dev/null 2>&1
}}
remove() {{
    stop
    "$engine" rm --force "$name" >/dev/null 2>&1
}}
if [ "$2" = stop ]; then
    remove
    if "$engine" container inspect "$name" >/dev/null 2>&1; then
        echo "rlhf-tasks: container $name is still there on $(hostname)" >&2
        exit 1
    fi
    exit 0
fi
trap 'trap "" TERM INT HUP; echo "rlhf-tasks: signalled: stopping container $name" >&2; stop' TERM INT HUP
"$@" &
client=$!
while :; do  # a signal ends a wait early: wait again, for the client to pass on the agent's last lines
    wait "$client"
    status=$?
    kill -0 "$client" 2>/dev/null || break
done
remove
exit "$status"
"""


def run_dir_of(directory: Path, job_id: str) -> Path:
    """Where the script puts the agent, the plan and each node's output."""
    return directory / f"rlhf-tasks-{job_id}"


_SBATCH_VALUE = re.compile(r"^[^\s'\"\\#]+$")
_MOUNT = re.compile(r"^/[^:,\s]*:/[^:,\s]*(?::(?:ro|rw))?$")


# The task's `placement.slurm`: spec.py keeps it as a mapping, this provider reads it with this model.
class SlurmPlacement(StrictModel):
    """Slurm's own placement options (sbatch) and how a task's image runs there."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = Field(None, description="node features, e.g. a100&ib")
    reservation: str | None = None
    gres: str | None = Field(None, description="--gres instead of --gpus-per-node, in the site's GPU type names "
                                               "(e.g. gpu:h100:8)")
    gpu_type: str | None = Field(None, description=(
        "this cluster's name for resources.gpus' type, as its gres.conf and `sinfo -o %G` say it (e.g. h100 for "
        "gpu:h100:8): the script asks for --gpus-per-node=TYPE:N; without it, for N GPUs of any type"))
    container: Literal["pyxis", "docker", "podman"] = Field(
        "pyxis", description="how `image` runs: pyxis (srun --container-image), or docker/podman run on every node")
    mounts: list[str] = Field([], description="extra SRC:DST[:ro] mounts into the container (data, caches)")
    privileged: bool = Field(False, description=(
        "docker/podman: run each node's container with --privileged (every device and capability of the host), "
        "as verl's AMD script does, for a site whose GPUs or network need it"))

    @field_validator("partition", "account", "qos", "constraint", "reservation", "gres", "gpu_type")
    @classmethod
    def _one_word(cls, value):
        if value is not None and not _SBATCH_VALUE.match(value):
            raise ValueError(f"{value!r}: one word, no spaces, quotes, backslashes or #")
        return value

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, value):
        for mount in value:
            if not _MOUNT.match(mount):
                raise ValueError(f"{mount!r} is not SRC:DST[:ro] with absolute paths (no commas)")
        return value


def slurm_placement(placement: Placement) -> SlurmPlacement:
    """A task's or plan's `placement.slurm`, read with this provider's model (BadInput naming the field)."""
    return provider_part(SlurmPlacement, placement.slurm, "placement.slurm")


def _cli(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BadInput(f"--provider slurm: the `{name}` command is not on PATH; run rlhf-tasks on a Slurm login node")
    return path


def _slurm_time(seconds: float) -> str:
    """Seconds -> D-HH:MM:SS (Slurm counts minutes: rounded up)."""
    minutes = math.ceil(seconds / 60)
    return f"{minutes // 1440}-{minutes // 60 % 24:02d}:{minutes % 60:02d}:00"


#: Slurm's --mem units: M, G, T are powers of 1024, and Slurm keeps memory in whole M (str_to_mbytes).
SLURM_UNITS = (("T", 2**40), ("G", 2**30), ("M", 2**20))


def slurm_mem(size: str) -> str:
    """--mem: whole MiB, rounded up (Slurm keeps no less), in the biggest of its units that is exact: `512GiB` ->
    `512G`, `200GB` -> `190735M`. Never 0, which Slurm reads as all of the node's memory."""
    return size_text(-(-size_bytes(size) // 2**20) * 2**20, SLURM_UNITS)


def job_info(job_id: str) -> dict[str, str]:
    """Slurm's record of a job: `scontrol show job` while slurmctld keeps it (MinJobAge),
    else sacct (where there is an accounting database); {} when neither knows it."""
    out = subprocess.run([_cli("scontrol"), "-o", "show", "job", str(job_id)], capture_output=True, text=True)
    if out.returncode == 0 and f"JobId={job_id} " in out.stdout:
        fields = {}
        for word in out.stdout.split():
            key, sep, value = word.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields
    sacct = shutil.which("sacct")
    if sacct:
        out = subprocess.run([sacct, "-j", str(job_id), "-X", "-n", "-P", "-o", "State,ExitCode,Reason,NodeList"],
                             capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        if line:
            state_, code, reason, nodes = (line.split("|") + ["", "", "", ""])[:4]
            return {"JobState": state_.split()[0], "ExitCode": code, "Reason": reason, "NodeList": nodes}
    return {}


def exit_code_of(info: dict[str, str]) -> int | None:
    code = info.get("ExitCode", "")
    return int(code.split(":")[0]) if code[:1].isdigit() else None


def exit_text(info: dict[str, str]) -> str:
    """Slurm's ExitCode (code:signal) in words."""
    code, _, signal = info.get("ExitCode", "?").partition(":")
    return f"exit code {code}" + (f" (signal {signal})" if signal not in ("", "0") else "")


class SlurmJob:
    """Slurm's record of one job, asked at most once a second: whether it still runs (the
    head's agent runs inside it), its state as it changes (with Slurm's reason while it
    waits), and how it ended."""

    #: A job Slurm does not know for this long (not yet visible, or forgotten) has ended.
    UNKNOWN_S = 60.0

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.info: dict[str, str] = {}
        self.asked = 0.0
        self.unknown_since: float | None = None
        self.shown: tuple | None = None

    def _refresh(self) -> dict[str, str]:
        now = time.monotonic()
        if now - self.asked >= 1.0:
            self.asked, info = now, job_info(self.job_id)
            if info:
                self.info, self.unknown_since = info, None
            else:
                self.unknown_since = self.unknown_since or now
        return self.info

    def running(self) -> bool:
        info = self._refresh()
        if self.unknown_since is not None and time.monotonic() - self.unknown_since > self.UNKNOWN_S:
            return False
        return info.get("JobState") not in FINAL_STATES

    def changes(self) -> list[str]:
        info = self._refresh()
        current = (info.get("JobState"), info.get("Reason"))
        if not info or current == self.shown:
            return []
        self.shown = current
        reason = f" ({current[1]})" if current[1] and current[1] != "None" else ""
        where = f" on {info['NodeList']}" if current[0] == "RUNNING" and info.get("NodeList") else ""
        return [f"Slurm job {self.job_id}: {current[0]}{reason}{where}"]

    def describe(self) -> list[str]:
        self.asked = 0.0  # the summary wants the latest word
        info = self._refresh()
        if not info:
            return [f"Slurm job {self.job_id}: unknown to Slurm"]
        if info.get("JobState") in FINAL_STATES:
            return [f"Slurm job {self.job_id} {info['JobState']} with {exit_text(info)}"]
        return [f"Slurm job {self.job_id}: {info.get('JobState')}"]


class SlurmProvider(Provider):
    name = "slurm"
    shares_filesystem = True  # the submission directory and checkpoints must be on the shared filesystem
    sharing = (Sharing("checkpoints.path", "a Slurm cluster", "if it is on the cluster's shared filesystem",
                       "Slurm mounts no storage of its own: every node sees what the site mounts on all of them "
                       "(NFS, Lustre, GPFS); `check` warns for a path under /checkpoints, which may be each "
                       "node's own disk"),)
    contract = Contract(
        rank=env("SLURM_NODEID"),
        nodes=env("SLURM_JOB_NUM_NODES"),
        head=command(NODELIST, item=0),
        peer=command(NODELIST, item=1),
        cluster_id=env("SLURM_JOB_ID"),
        gpus_per_node=env("SLURM_GPUS_ON_NODE", default="0"),
    )
    #: In a container: the host list the script expanded (no scontrol in the image).
    container_contract = contract.model_copy(update={"head": env(HOSTS_ENV, item=0), "peer": env(HOSTS_ENV, item=1)})
    placement_options = SlurmPlacement
    ignores = {"spot": "Slurm allocates the cluster's own nodes (placement.slurm.partition, qos)",
               "fleets": "the cluster's nodes are chosen by placement.slurm (partition, constraint, reservation)",
               "backends": "Slurm is the cluster's own scheduler",
               "regions": "the cluster's nodes are chosen by placement.slurm (partition, constraint, reservation)"}

    def __init__(self, **options):
        super().__init__(**options)
        #: Task name -> whether its checkpoints.path was the task's own (plan() notes it; the warning says it).
        self._given_checkpoints: dict[str, bool] = {}

    def check(self, task: Task) -> None:
        slurm = slurm_placement(task.placement)
        if not task.image and slurm.container != "pyxis":
            raise BadInput(f"placement.slurm.container: {slurm.container} runs the task's image; the task has no image")
        if slurm.privileged and (not task.image or slurm.container not in ENGINES):
            raise BadInput(f"placement.slurm.privileged: docker and podman run a container privileged "
                           f"(placement.slurm.container: docker or podman, with the task's image); "
                           f"{'the task has no image' if not task.image else 'pyxis runs the image in the Slurm step'}")
        if not task.image and slurm.mounts:
            raise BadInput("placement.slurm.mounts: mounts go into the task's image; the task has no image")
        if slurm.gpu_type and slurm.gres:
            raise BadInput(f"placement.slurm.gpu_type: placement.slurm.gres says the GPUs ({slurm.gres}) with their "
                           f"type already; give one of them")
        if slurm.gpu_type and ":" in slurm.gpu_type:
            raise BadInput(f"placement.slurm.gpu_type: {slurm.gpu_type!r}: the type's name alone (h100 of "
                           f"gpu:h100:8); the count comes from resources.gpus")
        if slurm.gpu_type and not task.resources.gpus_per_node:
            raise BadInput("placement.slurm.gpu_type: the task asks for no GPUs (resources.gpus); give "
                           "resources.gpus, or remove gpu_type")

    def notes(self, plan: Plan) -> list[str]:
        """Besides the shared-storage warning: what the script leaves to Slurm without a word in it,
        the GPU type (Slurm names types per cluster) and the time limit."""
        out, slurm, res = super().notes(plan), slurm_placement(plan.placement), plan.resources
        if res.gpu_name and not slurm.gpu_type and not slurm.gres:
            out.append(f"resources.gpus: the script asks Slurm for {plan.gpus_per_node} GPU(s) of any type per node "
                       f"(--gpus-per-node={plan.gpus_per_node}): {res.gpu_name} is not passed, since each Slurm "
                       f"cluster names its GPU types itself (gres.conf); give placement.slurm.gpu_type with your "
                       f"cluster's name for it (`sinfo -o %G` lists them: gpu:h100:8 -> h100), or "
                       f"placement.slurm.gres")
        if self.time_limit(plan) is None:
            out.append("placement.max_duration: none (nor job.timeout), so the script has no --time: Slurm gives the "
                       "job the partition's default time limit (its DefaultTime, else its MaxTime; `sinfo -o %l` "
                       "shows it), which may end the run early or let a stuck one hold the nodes that long; set "
                       "placement.max_duration")
        return out

    def shared_storage_warning(self, plan: Plan) -> str | None:
        """A line for `check` and `render` when checkpoints go under /checkpoints (the default,
        /checkpoints/NAME, or a path the task gave there), which the script makes with `mkdir -p`
        under `set -e` before the nodes start."""
        if not plan.checkpoint_dir or not plan.checkpoint_dir.startswith("/checkpoints/"):
            return None
        given = self._given_checkpoints.get(plan.name, plan.checkpoint_dir != f"/checkpoints/{plan.name}")
        what = "the task's checkpoints.path" if given else "the default path (the task names no checkpoints.path)"
        nodes = f"; the {plan.nodes} nodes must all see it (a shared filesystem) to resume" if plan.nodes > 1 else ""
        fix = ("make sure /checkpoints is on the cluster's shared filesystem and writable there, or point "
               "checkpoints.path at a directory that is" if given else
               "set checkpoints.path to a directory on the cluster's shared filesystem")
        return (f"checkpoints {plan.checkpoint_dir} is {what}: the script makes it with mkdir -p before the nodes "
                f"start, and the job fails at once where you may not write /checkpoints{nodes}; {fix}")

    def plan(self, task: Task) -> Plan:
        plan = super().plan(task)
        self._given_checkpoints[task.name] = bool(task.checkpoints.path)  # for the warning's words
        slurm = slurm_placement(plan.placement).model_dump()  # every option, defaults too: the plan says them
        plan = plan.replace(placement=plan.placement.model_copy(update={"slurm": slurm}))
        if plan.image:
            try:
                check_contract_env(task, self.container_contract, self.name)
            except BadInput as exc:
                raise BadInput(f"{task.source}: {exc}") from None
        return plan.replace(contract=self.container_contract) if plan.image else plan

    # ------------------------------------------------------------------ render

    def sbatch_options(self, plan: Plan) -> list[str]:
        res, slurm = plan.resources, slurm_placement(plan.placement)
        options = [f"--job-name={plan.name}", f"--nodes={plan.nodes}", "--ntasks-per-node=1"]
        if res.cpus:
            options.append(f"--cpus-per-task={res.cpus}")
        if slurm.gres:
            options.append(f"--gres={slurm.gres}")
        elif plan.gpus_per_node:
            typed = f"{slurm.gpu_type}:" if slurm.gpu_type else ""
            options.append(f"--gpus-per-node={typed}{plan.gpus_per_node}")
        if res.memory:
            options.append(f"--mem={slurm_mem(res.memory)}")
        options.append("--exclusive")  # Ray's fixed ports and the GPUs are the job's alone
        limit = self.time_limit(plan)
        if limit:
            options.append(f"--time={_slurm_time(limit)}")
        options += ["--output=%x-%j.out", "--export=ALL", "--requeue" if plan.placement.retry else "--no-requeue"]
        for key in ("partition", "account", "qos", "constraint", "reservation"):
            if getattr(slurm, key):
                options.append(f"--{key}={getattr(slurm, key)}")
        return options

    @staticmethod
    def time_limit(plan: Plan) -> float | None:
        """--time in seconds: placement.max_duration, else the job's timeout and the waits before it; None: none."""
        return plan.placement.max_duration or (
            plan.job.timeout_s + plan.wait.head_s + plan.wait.nodes_s if plan.job.timeout_s else None)

    def container_lines(self, plan: Plan) -> list[list[str]]:
        """Shell words (quoted), a line of them per option, that run the agent in the image."""
        slurm, q = slurm_placement(plan.placement), shlex.quote
        workdir = '"$job_dir"' if plan.job.working_dir else '"$run_dir"'
        mounts = (['"$job_dir":"$job_dir"'] if plan.job.working_dir else []) + ['"$run_dir":"$run_dir"'] + (
            [q(f"{plan.checkpoint_dir}:{plan.checkpoint_dir}")] if plan.checkpoint_dir else []) + [
            q(m) for m in slurm.mounts]
        if slurm.container == "pyxis":
            return [[f"--container-image={q(plan.image)}"], ["--container-mounts=" + ",".join(mounts)],
                    [f"--container-workdir={workdir}"]]
        engine = slurm.container
        lines = [["bash", '"$run_dir/container.sh"', '"$container"'],  # stops the container when the task ends
                 [engine, "run", "--rm", "--init", '--name="$container"'], ["--network=host"]]
        # The task's /dev/shm in a namespace of the container's own, as verl's AMD script sizes it; else the host's.
        # Not both: podman refuses --shm-size with --ipc=host (libpod: "cannot set shmsize when running in the
        # host IPC Namespace"), and docker ignores the size there.
        if plan.resources.shm_size:
            lines[-1].append(f"--shm-size={docker_size(plan.resources.shm_size)}")
        else:
            lines[-1].append("--ipc=host")
        vendor = gpu_vendor(plan.resources.gpu_name) if plan.gpus_per_node else None
        if vendor == "amd":  # as verl's AMD script and ROCm's container guide run them
            lines += [list(AMD_CONTAINER_OPTIONS[:3]), list(AMD_CONTAINER_OPTIONS[3:])]
        elif vendor == "nvidia":
            lines.append(["--gpus=all" if engine == "docker" else "--device=nvidia.com/gpu=all"])
        if plan.network == "infiniband":
            lines.append(["--device=/dev/infiniband", "--ulimit=memlock=-1:-1"])
        if slurm.privileged:
            lines.append(["--privileged"])
        names = [*CONTRACT_VARS, *([GPU_SELECTION_VAR[vendor]] if vendor else []), *plan.secrets,
                 *([plan.token_env] if plan.token_env else []), *plan.env]
        lines += [[f"--env={name}"] for name in dict.fromkeys(names)]
        # No PYTHONPATH of ours: the image's own stays, the agent runs by its path and puts lib/ before
        # the image's entries for everything it starts (raynode.node_env).
        lines += [[f"--volume={mount}"] for mount in mounts]
        lines += [[f"--workdir={workdir}"], [q(plan.image)]]
        return lines

    def script(self, plan: Plan) -> str:
        q = shlex.quote
        container = slurm_placement(plan.placement).container
        engine = container if plan.image and container in ENGINES else None
        names = plan.secrets + ([plan.token_env] if plan.token_env else [])
        token_hint = f"export {plan.token_env}=$(rlhf-tasks token {plan.name}); " if plan.token_env else ""
        lines = [
            "#!/bin/bash",
            "# Rendered by rlhf-tasks for Slurm. Submit it with:",
            f"#   {token_hint}sbatch {plan.name}.sbatch",
            "# or submit and follow it: rlhf-tasks launch TASK --provider slurm",
            f"# From the submitting environment (--export=ALL), never written here: {', '.join(names) or 'nothing'}",
            "# Output: <name>-<job id>.out (this script), rlhf-tasks-<job id>/node<N>.out (the node agents)",
            *(f"#SBATCH {option}" for option in self.sbatch_options(plan)),
            "set -euo pipefail",
            "",
            "# The node agent and its plan, beside the job's output (a filesystem every node sees).",
            'run_dir="${SLURM_SUBMIT_DIR:-$PWD}/rlhf-tasks-${SLURM_JOB_ID}"',
            'mkdir -p "$run_dir/logs"',
            *self.job_dir_lines(plan),
            *heredoc('"$run_dir/plan.json"', self.node_plan(plan).to_json(), PLAN_EOF),
            "# The node agent's package and the code the recipe needs on the nodes (the demo's), first on",
            "# PYTHONPATH; the agent runs by its entry file's path (never `-m`: the working directory could shadow it).",
        ]
        made = set()
        for path, text in module_files([AGENT, *plan.modules]).items():
            if Path(path).parent not in made:
                made.add(Path(path).parent)
                lines.append(f'mkdir -p "$run_dir/lib/{Path(path).parent}"')
            lines += heredoc(f'"$run_dir/lib/{path}"', text, MODULE_EOF)
        lines.append('export PYTHONPATH="$run_dir/lib${PYTHONPATH:+:$PYTHONPATH}"')
        if plan.checkpoint_dir:
            lines.append(f"mkdir -p {q(plan.checkpoint_dir)}")
        if plan.image:
            lines += ["", "# No scontrol inside the image: the host list, expanded once here.",
                      f'{HOSTS_ENV}=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
                      f"export {HOSTS_ENV}"]
            if engine:
                lines += ["# The engine runs each node's container outside the Slurm step: a wrapper stops it by name.",
                          "container=" + CONTAINER_NAME.format(name=q(plan.name), job_id='"$SLURM_JOB_ID"'),
                          *heredoc('"$run_dir/container.sh"', CONTAINER_SH, CONTAINER_EOF)]
                if plan.env:
                    lines += ["# The task's env, passed into the container by name.",
                              *(f"export {key}={q(value)}" for key, value in plan.env.items())]
        srun = [["srun", f"--nodes={plan.nodes}", f"--ntasks={plan.nodes}", "--ntasks-per-node=1",
                 "--kill-on-bad-exit=1", "--whole"], ['--output="$run_dir/node%n.out"']]
        if plan.job.working_dir:
            srun[-1].append('--chdir="$job_dir"')
        if plan.image:  # pyxis options, or the docker/podman command the agent runs in
            srun += self.container_lines(plan)
        srun.append(["python3", f'"$run_dir/lib/{AGENT_ENTRY}"', "--plan", '"$run_dir/plan.json"', "--log-dir", '"$run_dir/logs"'])
        lines += [
            "",
            'echo "rlhf-tasks: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; the agents write $run_dir/node<N>.out"',
            "# One step, one agent per node: the head submits the job and exits with its result.",
            "status=0",
            " \\\n    ".join(" ".join(words) for words in srun) + " || status=$?",
            'echo "rlhf-tasks: the node agents ended with exit code $status"',
        ]
        if engine:
            lines += ["# Every node's container stopped and removed by name: a task Slurm killed (KillWait after",
                      "# its SIGTERM, as --kill-on-bad-exit does to the others) could not stop its own.",
                      f"srun --overlap --nodes={plan.nodes} --ntasks={plan.nodes} --ntasks-per-node=1 \\",
                      f'    bash "$run_dir/container.sh" "$container" {engine} stop '
                      '|| echo "rlhf-tasks: the containers\' clean-up step ended with exit code $?"']
        lines.append('exit "$status"')
        return "\n".join(lines) + "\n"

    def job_dir_lines(self, plan: Plan) -> list[str]:
        """Where the agents run, so that the head's `ray job submit --working-dir .` finds job.working_dir:
        the directory itself, absolute (it must be on a filesystem every node sees; the containers mount it)."""
        if not plan.job.working_dir:
            return []
        return [f"# job.working_dir: the agents run in it; it must be on a filesystem every node sees",
                "# (the head uploads it from there to the job, with Ray).",
                f"job_dir={shlex.quote(plan.job.working_dir)}"]

    @staticmethod
    def node_plan(plan: Plan) -> Plan:
        """The plan the nodes read: job.working_dir is the directory they run in (job_dir)."""
        if not plan.job.working_dir:
            return plan
        return plan.replace(job=plan.job.model_copy(update={"working_dir": "."}))

    def uploads_working_dir(self, plan: Plan) -> bool:
        """`submit: head` too: the head reads job.working_dir on the shared filesystem and its Ray uploads
        it to the job, so it is measured here, before sbatch."""
        return super().uploads_working_dir(plan) or (bool(plan.job.working_dir) and plan.job.submit == "head")

    def upload_words(self, plan: Plan) -> str:
        if plan.job.submit != "head":
            return super().upload_words(plan)
        return ("the agents run in it and the head uploads it to the job (Ray's working_dir), so it must be on the "
                "cluster's shared filesystem")

    def render(self, plan: Plan) -> dict[str, str]:
        return {f"{plan.name}.sbatch": self.script(plan)}

    # ------------------------------------------------------------------ apply, status, down

    def ready(self, plan: Plan) -> None:
        if plan.job.mode == "ray" and plan.job.submit == "client":
            raise BadInput("job.submit: `launch --provider slurm` follows the job the head submits; for a client "
                           "submission render the script, sbatch it, and forward the head's dashboard port (ssh -L)")
        for name in ("sbatch", "scontrol", "scancel"):
            _cli(name)

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """sbatch; the handle reads the agents' output on the shared filesystem and Slurm's
        record of the job (its state while it waits, its exit code at the end)."""
        self.ready(plan)
        sbatch = _cli("sbatch")
        directory, token, env = self.stage(plan, secrets)
        out = subprocess.run([sbatch, "--parsable", f"{plan.name}.sbatch"], cwd=directory, env=env,
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise StepFailed("sbatch", out.stderr.strip() or out.stdout.strip() or f"exit code {out.returncode}")
        job_id = out.stdout.strip().splitlines()[-1].split(";")[0]
        state.save(plan.name, {"provider": self.name, "cluster_id": job_id, "job_id": job_id,
                               "directory": str(directory), "mode": plan.job.mode, "image": plan.image,
                               "container": slurm_placement(plan.placement).container if plan.image else None,
                               "dashboard_port": plan.ray.dashboard_port})
        say(f"submitted Slurm job {job_id} ({directory / (plan.name + '.sbatch')})")
        job = SlurmJob(job_id)
        run_dir = run_dir_of(directory, job_id)
        return Cluster(name=plan.name, cluster_id=job_id, token=token, head_alive=job.running,
                       node_logs=[str(run_dir / f"node{rank}.out") for rank in range(plan.nodes)]
                       + [str(directory / f"{plan.name}-{job_id}.out")],
                       tend=job.changes, describe=job.describe)

    def status(self, name: str) -> str | None:
        record = state.load(name)
        if not record or record.get("provider") != self.name:
            return None
        job_id = record["job_id"]
        info = job_info(job_id)
        if not info:
            return f"Slurm job {job_id}: unknown to Slurm (finished long ago?)"
        reason = f" ({info['Reason']})" if info.get("Reason") not in (None, "", "None") else ""
        lines = [f"Slurm job {job_id}: {info.get('JobState')}{reason}, nodes {info.get('NodeList') or '-'}, "
                 f"run time {info.get('RunTime', '-')} of {info.get('TimeLimit', '-')}, {exit_text(info)}"]
        head_out = run_dir_of(Path(record["directory"]), job_id) / "node0.out"
        result = parse_result(head_out.read_text(errors="replace")) if head_out.exists() else None
        if result is not None:
            job = result.get("job") or {}
            lines.append(f"job {job.get('submission_id') or '-'}: {job.get('status') or 'not run'} "
                         f"(the head agent ended with exit code {result.get('exit_code')})")
        elif info.get("JobState") == "RUNNING" and record.get("mode") == "ray" and not record.get("image"):
            lines.append(self._ray_jobs(name, job_id, info, record.get("dashboard_port", 8265)))
        else:
            lines.append(f"job: see the head agent's output, {head_out}")
        return "\n".join(lines)

    def _ray_jobs(self, name: str, job_id: str, info: dict, port: int) -> str:
        """Ray's view of the jobs, asked on the head through a second step beside the agents'."""
        hosts = subprocess.run([_cli("scontrol"), "show", "hostnames", info.get("NodeList", "")],
                               capture_output=True, text=True).stdout.split()
        if not hosts:
            return "Ray jobs: the head node is not known yet"
        query = ("import json, os, sys, urllib.request\n"
                 "token = os.environ.get('RAY_AUTH_TOKEN')\n"
                 "request = urllib.request.Request('http://127.0.0.1:%s/api/jobs/' % sys.argv[1],"
                 " headers={'Authorization': 'Bearer ' + token} if token else {})\n"
                 "for job in json.load(urllib.request.urlopen(request, timeout=10)):\n"
                 "    print('job %s: %s' % (job.get('submission_id'), job.get('status')))\n")
        token = state.token(name)
        env = {**os.environ, **({"RAY_AUTH_TOKEN": token} if token else {})}
        argv = [_cli("srun"), f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={hosts[0]}",
                "python3", "-c", query, str(port)]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        except subprocess.TimeoutExpired:
            return f"Ray jobs: no answer from the head ({hosts[0]}) within 60s"
        if out.returncode != 0:
            return f"Ray jobs: not reachable yet on {hosts[0]} ({(out.stderr.strip().splitlines() or ['?'])[-1]})"
        return out.stdout.strip() or "Ray jobs: none submitted yet"

    def down(self, name: str) -> str:
        record = state.load(name)
        if not record or not record.get("job_id"):
            return f"no Slurm job named {name} is known here"
        job_id = record["job_id"]
        scancel, squeue = _cli("scancel"), _cli("squeue")

        def gone() -> tuple[bool, object]:
            steps = subprocess.run([squeue, "-h", "-s", "-j", job_id], capture_output=True, text=True).stdout.strip()
            job_state = job_info(job_id).get("JobState")
            done = not steps and (job_state is None or job_state in FINAL_STATES)
            return done, f"job {job_state}, steps: {steps.replace(chr(10), '; ') or 'none'}"

        if record.get("container") in ENGINES and job_info(job_id).get("JobState") == "RUNNING":
            # Asked, not killed: each node's wrapper stops its container by name, the script's
            # clean-up step removes any a killed task left, and the job ends by itself (FAILED:
            # its agents were stopped by a signal). scancel's kill would leave the wrappers only
            # KillWait for that, and a container outlives a job that ends before it is stopped.
            subprocess.run([scancel, "--signal=TERM", job_id], capture_output=True, text=True)
            limit = CONTAINER_STOP_S + 60  # the containers' stop, then the clean-up step on a busy cluster
            try:
                wait_for(f"Slurm job {job_id} to stop its containers and end", gone, limit, interval=0.2,
                         max_interval=1.0, report=say)
                state.forget(name)
                return f"stopped Slurm job {job_id} and its {record['container']} containers; its steps are gone"
            except AgentError as exc:
                say(f"{exc}; cancelling it")
        subprocess.run([scancel, job_id], capture_output=True, text=True)
        wait_for(f"Slurm job {job_id} and its steps to end", gone, 300, interval=0.2, max_interval=1.0, report=say)
        state.forget(name)
        return f"cancelled Slurm job {job_id}; its steps are gone"
