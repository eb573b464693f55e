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

Slurm's own options (the guides' `--nodelist`, `--output`/`--error`, `--mail-type`/`--mail-user`,
`--overcommit`) are fields of `placement.slurm`; any other passes through `placement.slurm.sbatch`, refused where
it sets what a line of the render sets (sbatch takes the later line silently) and, where sbatch is installed and
configured, by `sbatch --test-only` (`check`, and `launch` before anything is written), in sbatch's words.
"""

from __future__ import annotations

import getpass
import math
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from .. import state
from ..agent.protocol import AGENT_ENTRY, AgentError, parse_result, wait_for
from ..console import say
from ..errors import BadInput, StepFailed
from ..models import StrictModel, did_you_mean, size_bytes, size_text
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
#: An item of placement.slurm.sbatch: one long option (getopt_long's --name or --name=value), its value one word.
_SBATCH_OPTION = re.compile(r"^--[a-z][a-z0-9-]*(=[^\s'\"\\#]+)?$")
#: sbatch's --mail-type values (sbatch(1), Slurm 22.05; compared ignoring case, as sbatch does).
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")
_MOUNT = re.compile(r"^/[^:,\s]*:/[^:,\s]*(?::(?:ro|rw))?$")


def _mail_type(kind: str) -> str:
    if kind.strip().upper() not in MAIL_TYPES:
        raise ValueError(f"{kind!r} is not one of sbatch's mail types {did_you_mean(kind.strip().upper(), MAIL_TYPES)}")
    return kind.strip().upper()


def _sbatch_option(option: str) -> str:
    if not _SBATCH_OPTION.match(option):
        short = " in sbatch's long form (--nodelist=VALUE, not -w VALUE)" if re.match(r"^-[^-]", option) else ""
        raise ValueError(f"{option!r}: one option an item, --NAME or --NAME=VALUE{short}, the value one word (no "
                         f"spaces, quotes, backslashes or #)")
    return option


MailType = Annotated[str, AfterValidator(_mail_type)]
SbatchOption = Annotated[str, AfterValidator(_sbatch_option)]


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
    nodelist: str | None = Field(None, description=(
        "--nodelist: these hosts (a Slurm host list, e.g. gpu[01-04]), and others as `nodes` needs more"))
    output: str | None = Field(None, description=(
        "--output: the batch script's output, in sbatch's filename pattern (default %x-%j.out in the submission "
        "directory); the agents' own output stays rlhf-tasks-<job id>/node<N>.out"))
    error: str | None = Field(None, description="--error: the batch script's stderr apart from its output, "
                                                "in sbatch's filename pattern")
    mail_type: list[MailType] = Field([], description=(
        "--mail-type: when Slurm mails (BEGIN, END, FAIL, REQUEUE, ALL, TIME_LIMIT_90, ...; a list or END,FAIL)"))
    mail_user: str | None = Field(None, description="--mail-user: who Slurm mails (default: the submitting user)")
    overcommit: bool = Field(False, description="--overcommit: the job's steps may run more tasks than CPUs")
    sbatch: list[SbatchOption] = Field([], description=(
        "more #SBATCH options, each one item --NAME[=VALUE] in sbatch's long form (e.g. --mail-type=FAIL, "
        "--mem=0); refused when it fights an option the script sets, and by sbatch --test-only where sbatch "
        "is installed"))
    privileged: bool = Field(False, description=(
        "docker/podman: run each node's container with --privileged (every device and capability of the host), "
        "as verl's AMD script does, for a site whose GPUs or network need it"))

    @field_validator("partition", "account", "qos", "constraint", "reservation", "gres", "gpu_type", "nodelist",
                     "output", "error", "mail_user")
    @classmethod
    def _one_word(cls, value):
        if value is not None and not _SBATCH_VALUE.match(value):
            raise ValueError(f"{value!r}: one word, no spaces, quotes, backslashes or #")
        return value

    @field_validator("output", "error")
    @classmethod
    def _made_directory(cls, value):
        if value is not None and "%" in value.rpartition("/")[0]:
            raise ValueError(f"{value!r}: Slurm makes no directory for it, so a pattern in its directory names one "
                             f"that does not exist yet; put the pattern in the file's name")
        return value

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, value):
        for mount in value:
            if not _MOUNT.match(mount):
                raise ValueError(f"{mount!r} is not SRC:DST[:ro] with absolute paths (no commas)")
        return value

    @field_validator("mail_type", mode="before")
    @classmethod
    def _mail_list(cls, value):
        """Slurm's own comma list (`END,FAIL`) is taken as the list it is."""
        return value.split(",") if isinstance(value, str) else value


#: The batch script's output when the task names none: beside the script, `<name>-<job id>.out`.
DEFAULT_OUTPUT = "%x-%j.out"
#: Why the script sets the options no field of the task gives (the words of a conflict with one).
OWN = {"ntasks-per-node": "the script's own: one agent a node",
       "exclusive": "the script's own: Ray's fixed ports and the GPUs are the job's alone",
       "output": f"the script's own, {DEFAULT_OUTPUT} beside it, which launch follows; placement.slurm.output sets it",
       "export": "the script's own: the secrets and the Ray token come from the submitting environment"}
#: sbatch's options that set what another of the group sets (sbatch(1), Slurm 22.05): one the script sets
#: fights any other of its group.
SAME_THING = (
    ("the job's GPUs", {"gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket", "gres"}),
    ("the job's memory (sbatch: --mem, --mem-per-cpu and --mem-per-gpu are mutually exclusive)",
     {"mem", "mem-per-cpu", "mem-per-gpu"}),
    ("the CPUs of a task (sbatch: --cpus-per-gpu is not compatible with --cpus-per-task)",
     {"cpus-per-task", "cpus-per-gpu"}),
    ("the job's tasks (sbatch: with --ntasks, --ntasks-per-node is only a maximum)",
     {"ntasks", "ntasks-per-node", "ntasks-per-core", "ntasks-per-socket", "ntasks-per-gpu", "ntasks-per-tres"}),
    ("whether the job shares its nodes", {"exclusive", "oversubscribe"}),
    ("whether Slurm requeues the job", {"requeue", "no-requeue"}),
    ("the job's hosts", {"nodelist", "nodefile"}),
)
#: The options of placement.slurm a task seldom gives (sbatch's own, and --privileged): in the plan only
#: where the task gives them, so a task without them plans as before.
GIVEN_ONLY = ("nodelist", "output", "error", "mail_type", "mail_user", "overcommit", "sbatch", "privileged")
#: Options that break what `launch` counts on, whatever the script sets.
LAUNCH_OWN = {
    "array": "the script is one job holding one cluster; an array would start one cluster per task",
    "wait": "launch follows the job itself; with --wait, sbatch would not return until the job ended",
    "test-only": "the job would never be submitted (check runs sbatch --test-only itself)",
    "clusters": "launch asks this cluster's slurmctld for the job (scontrol, scancel)",
}


def _option_name(option: str) -> str:
    """`--mail-type=FAIL` -> `mail-type`."""
    return option.removeprefix("--").split("=", 1)[0]


def _origin(where: str) -> str:
    return where if where.startswith("the script") else f"from {where}"


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


_PATTERN = re.compile(r"%(\d*)(.)")


def filename(pattern: str, name: str, job_id: str, directory: Path) -> Path | None:
    """The batch script's --output/--error file: sbatch's filename pattern (sbatch(1)) with what Slurm puts for
    a job that is no array (%j and %A the job id, %x its name, %u the user, %% a %; a number pads with zeros),
    relative to the submission directory; None where it holds what only the node knows (%N, the host)."""
    unknown = False

    def one(match: re.Match) -> str:
        nonlocal unknown
        width, letter = match.groups()
        value = {"j": job_id, "A": job_id, "x": name, "u": getpass.getuser(), "%": "%"}.get(letter)
        if value is None:
            unknown = True
            return ""
        return value.zfill(int(width)) if width and value.isdigit() else value

    path = _PATTERN.sub(one, pattern)
    return None if unknown else directory / path


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


#: sbatch's words where it reached no Slurm here (no configuration, no controller): nothing was checked.
UNREACHED = ("Could not establish a configuration source", "Unable to process configuration file",
             "Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted or received")
TEST_ONLY_S = 60
#: Where sbatch finds its configuration without SLURM_CONF: the builds' defaults (Debian's and a source build's
#: sysconfdir) and the copy slurmd/sackd keep on a configless node.
SLURM_CONFS = ("/etc/slurm/slurm.conf", "/usr/local/etc/slurm.conf", "/etc/slurm-llnl/slurm.conf",
               "/run/slurm/conf/slurm.conf")


def slurm_config() -> str | None:
    """The configuration sbatch reads here, or None: without one it reaches no Slurm (its DNS SRV lookup
    aside), so `check` does not start it."""
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    return next((path for path in SLURM_CONFS if os.path.exists(path)), None)


def sbatch_version(sbatch: str) -> str:
    """`slurm 22.05.8`: sbatch's own name for its release."""
    out = subprocess.run([sbatch, "--version"], capture_output=True, text=True, timeout=TEST_ONLY_S)
    return out.stdout.strip() or "slurm"


def sbatch_test_only(sbatch: str, script: str) -> tuple[bool | None, str]:
    """`sbatch --test-only` of a script (on its stdin): sbatch parses its #SBATCH lines and slurmctld says
    whether and when the job would start; nothing is submitted. (True, the estimate), (False, sbatch's
    words), or (None, its words) where it reached no Slurm, so nothing was checked."""
    try:
        out = subprocess.run([sbatch, "--test-only"], input=script, capture_output=True, text=True,
                             timeout=TEST_ONLY_S)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {TEST_ONLY_S}s"
    said = [line.strip() for line in (out.stderr + out.stdout).splitlines()
            if line.strip() and not line.startswith('Try "sbatch --help"')]
    words = "; ".join(said) or f"exit code {out.returncode}"
    if out.returncode == 0:
        return True, words
    return (None if any(w in words for w in UNREACHED) else False), words


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
        if task.resources.gpu_memory and not slurm.gpu_type and not slurm.gres:
            raise BadInput(f"resources.gpus: {task.resources.gpus}: Slurm asks for GPUs by the type names each "
                           f"cluster gives them (its gres.conf), not by memory; give placement.slurm.gpu_type with "
                           f"your cluster's name for such a GPU (`sinfo -o %G` lists them: gpu:a100_80g:8 -> "
                           f"a100_80g), or placement.slurm.gres")
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
        options = slurm_placement(plan.placement)
        # Every option, defaults too: the plan says them; those of sbatch's alone only where given, so the plan
        # (and script) of a task without them is what it was.
        slurm = options.model_dump(exclude={key for key in GIVEN_ONLY if getattr(options, key) in (None, False, [])})
        plan = plan.replace(placement=plan.placement.model_copy(update={"slurm": slurm}))
        try:
            self.check_passed(plan)
            if plan.image:
                check_contract_env(task, self.container_contract, self.name)
        except BadInput as exc:
            raise BadInput(f"{task.source}: {exc}") from None
        return plan.replace(contract=self.container_contract) if plan.image else plan

    # ------------------------------------------------------------------ render

    def sbatch_options(self, plan: Plan) -> list[str]:
        return [option for option, _ in self.sbatch_lines(plan)]

    def sbatch_lines(self, plan: Plan, passed: bool = True) -> list[tuple[str, str]]:
        """The script's #SBATCH options, each with where it comes from (the task's field, or why the script
        sets it): the words of a conflict and of sbatch's refusal name it. `passed`: with placement.slurm.sbatch."""
        res, slurm = plan.resources, slurm_placement(plan.placement)
        lines = [(f"--job-name={plan.name}", "name"), (f"--nodes={plan.nodes}", "nodes"),
                 ("--ntasks-per-node=1", OWN["ntasks-per-node"])]
        if res.cpus:
            lines.append((f"--cpus-per-task={res.cpus}", "resources.cpus"))
        if slurm.gres:
            lines.append((f"--gres={slurm.gres}", "placement.slurm.gres"))
        elif plan.gpus_per_node:
            typed = f"{slurm.gpu_type}:" if slurm.gpu_type else ""
            lines.append((f"--gpus-per-node={typed}{plan.gpus_per_node}", "resources.gpus"))
        if res.memory:
            lines.append((f"--mem={slurm_mem(res.memory)}", "resources.memory"))
        lines.append(("--exclusive", OWN["exclusive"]))
        limit = self.time_limit(plan)
        if limit:
            lines.append((f"--time={_slurm_time(limit)}",
                          "placement.max_duration" if plan.placement.max_duration else "job.timeout, with the waits"))
        lines.append((f"--output={slurm.output or DEFAULT_OUTPUT}",
                      "placement.slurm.output" if slurm.output else OWN["output"]))
        if slurm.error:
            lines.append((f"--error={slurm.error}", "placement.slurm.error"))
        lines += [("--export=ALL", OWN["export"]),
                  ("--requeue" if plan.placement.retry else "--no-requeue", "placement.retry")]
        for key in ("partition", "account", "qos", "constraint", "reservation", "nodelist"):
            if getattr(slurm, key):
                lines.append((f"--{key}={getattr(slurm, key)}", f"placement.slurm.{key}"))
        if slurm.mail_type:
            lines.append((f"--mail-type={','.join(slurm.mail_type)}", "placement.slurm.mail_type"))
        if slurm.mail_user:
            lines.append((f"--mail-user={slurm.mail_user}", "placement.slurm.mail_user"))
        if slurm.overcommit:
            lines.append(("--overcommit", "placement.slurm.overcommit"))
        if passed:
            lines += [(option, f"placement.slurm.sbatch[{i}]") for i, option in enumerate(slurm.sbatch)]
        return lines

    def check_passed(self, plan: Plan) -> None:
        """placement.slurm.sbatch against the options the script sets itself (its render, not a list of
        names): BadInput for one that sets what a rendered option sets, since sbatch takes the last
        silently; for a prefix of a rendered option's name, which sbatch reads as that option
        (getopt_long) or refuses as ambiguous; and for those that break what `launch` counts on."""
        rendered = {_option_name(option): (option, where) for option, where in self.sbatch_lines(plan, passed=False)}
        for i, item in enumerate(slurm_placement(plan.placement).sbatch):
            name, field = _option_name(item), f"placement.slurm.sbatch[{i}]"
            if name in LAUNCH_OWN:
                raise BadInput(f"{field}: {item}: {LAUNCH_OWN[name]}")
            if name == "chdir":
                relative = [option for option, _ in rendered.values()
                            if option.startswith(("--output=", "--error=")) and not option.split("=", 1)[1].startswith("/")]
                if relative:
                    raise BadInput(f"{field}: {item} moves the script's {relative[0]} (relative to the job's working "
                                   f"directory), which launch follows in the submission directory; give "
                                   f"placement.slurm.output and error absolute paths")
            for own, (option, where) in rendered.items():
                same = next((what for what, group in SAME_THING if name in group and own in group and name != own),
                            None)
                if name == own:
                    why = "sbatch takes the later of the two, silently"
                elif same:
                    why = f"both set {same}"
                elif own.startswith(name):
                    why = (f"sbatch reads --{name}, which starts --{own}, as that option where no other one starts "
                           f"so (getopt_long), and refuses it as ambiguous where one does")
                else:
                    continue
                raise BadInput(f"{field}: {item} fights the script's own #SBATCH {option} ({_origin(where)}): {why}")

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
        slurm = slurm_placement(plan.placement)
        container = slurm.container
        engine = container if plan.image and container in ENGINES else None
        output = (slurm.output or "<name>-<job id>.out") + (f" (its stderr: {slurm.error})" if slurm.error else "")
        names = plan.secrets + ([plan.token_env] if plan.token_env else [])
        token_hint = f"export {plan.token_env}=$(rlhf-tasks token {plan.name}); " if plan.token_env else ""
        lines = [
            "#!/bin/bash",
            "# Rendered by rlhf-tasks for Slurm. Submit it with:",
            f"#   {token_hint}sbatch {plan.name}.sbatch",
            "# or submit and follow it: rlhf-tasks launch TASK --provider slurm",
            f"# From the submitting environment (--export=ALL), never written here: {', '.join(names) or 'nothing'}",
            f"# Output: {output} (this script), rlhf-tasks-<job id>/node<N>.out (the node agents)",
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
        """The commands launch needs, and Slurm's own word on the script (sbatch --test-only), before anything
        is written."""
        self.can_submit(plan)
        self.sbatch_test(plan)

    def can_submit(self, plan: Plan) -> None:
        if plan.job.mode == "ray" and plan.job.submit == "client":
            raise BadInput("job.submit: `launch --provider slurm` follows the job the head submits; for a client "
                           "submission render the script, sbatch it, and forward the head's dashboard port (ssh -L)")
        for name in ("sbatch", "scontrol", "scancel"):
            _cli(name)

    def ask_own_code(self, plan: Plan) -> list[str]:
        return [self.sbatch_test(plan)]

    def sbatch_test(self, plan: Plan) -> str:
        """The script as Slurm's own sbatch takes it, where sbatch is installed here: `sbatch --test-only`
        (its option parser over the #SBATCH lines, then slurmctld's answer: the partition, nodes, features and
        GPUs exist, the limits hold). A refusal is BadInput with sbatch's words, naming the field of each line
        without which sbatch does not refuse it; else the line `check` prints (what sbatch said, or why nothing
        was checked: no sbatch, or no Slurm it reaches)."""
        sbatch = shutil.which("sbatch")
        name = f"{plan.name}.sbatch"
        if sbatch is None:
            return f"sbatch --test-only of {name}: not checked: sbatch is not on PATH here (it is on a login node)"
        if slurm_config() is None:
            return (f"sbatch --test-only of {name}: not checked: no Slurm configuration here for sbatch (SLURM_CONF, "
                    f"{', '.join(SLURM_CONFS)})")
        version, script = sbatch_version(sbatch), self.script(plan)
        taken, words = sbatch_test_only(sbatch, script)
        if taken:
            return f"{version}'s sbatch --test-only takes {name}: {words}"
        if taken is None:
            return f"{version}'s sbatch --test-only of {name}: not checked: it reached no Slurm here ({words})"
        blamed = []  # the lines without which sbatch does not refuse it: the passed ones first, then the fields'
        for option, where in sorted(self.sbatch_lines(plan), key=lambda line: (
                not line[1].startswith("placement.slurm.sbatch"), not line[1].startswith("placement.slurm"))):
            without, _ = sbatch_test_only(sbatch, script.replace(f"\n#SBATCH {option}\n", "\n", 1))
            if without is not False:
                blamed.append((option, where))
            if without is None:  # its parser took the rest, and no Slurm answers (each try waits MessageTimeout)
                break
        fields = [where for _, where in blamed if not where.startswith("the script")] or ["placement.slurm"]
        without = (" (it does not refuse it without #SBATCH " + ", nor without ".join(option for option, _ in blamed)
                   + ")" if blamed else f" (its #SBATCH lines: {' '.join(self.sbatch_options(plan))})")
        raise BadInput(f"{', '.join(dict.fromkeys(fields))}: {version}'s sbatch --test-only refuses {name}: "
                       f"{words}{without}")

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        """sbatch; the handle reads the agents' output on the shared filesystem and Slurm's
        record of the job (its state while it waits, its exit code at the end)."""
        self.can_submit(plan)  # the launcher asked sbatch --test-only before (ready)
        sbatch = _cli("sbatch")
        directory, token, env = self.stage(plan, secrets)
        slurm = slurm_placement(plan.placement)
        for pattern in (slurm.output, slurm.error):  # Slurm opens them in a directory that must be there
            if pattern and "/" in pattern:
                (directory / pattern.rpartition("/")[0]).mkdir(parents=True, exist_ok=True)
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
        script_logs = [filename(pattern, plan.name, job_id, directory)
                       for pattern in (slurm.output or DEFAULT_OUTPUT, slurm.error) if pattern]
        return Cluster(name=plan.name, cluster_id=job_id, token=token, head_alive=job.running,
                       node_logs=[str(run_dir / f"node{rank}.out") for rank in range(plan.nodes)]
                       + [str(path) for path in script_logs if path],
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
