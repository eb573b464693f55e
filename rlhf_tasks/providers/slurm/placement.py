"""The task's `placement.slurm`, read with this provider's model (spec.py keeps it as a mapping): Slurm's
own options (sbatch's) and how the task's image runs there, and what a passed-through sbatch option may
not fight (the options the script sets itself, those `launch` counts on).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator

from ...models import StrictModel, did_you_mean
from ...spec import Placement, group_part, provider_part

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


def option_name(option: str) -> str:
    """`--mail-type=FAIL` -> `mail-type`."""
    return option.removeprefix("--").split("=", 1)[0]


def origin_words(where: str) -> str:
    return where if where.startswith("the script") else f"from {where}"



def slurm_placement(placement: Placement) -> SlurmPlacement:
    """A task's or plan's `placement.slurm`, read with this provider's model (BadInput naming the field)."""
    return provider_part(SlurmPlacement, placement.slurm, "placement.slurm")


def group_slurm(placement: Placement, group: Any, index: int) -> SlurmPlacement:
    """A node group's options: its `placement.slurm` keys over the task's (its partition, constraint or GPU
    type), read with this provider's model (BadInput naming `groups[i].placement.slurm`)."""
    return group_part(SlurmPlacement, placement, group, index, "slurm")
