"""What every recipe shares: the strict model base, the job fields, the cluster shape
a recipe is built against, and what a recipe hands to the cluster plan."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr

from ..errors import BadInput
from ..models import Duration, RuntimeEnvSpec, Service, StrictModel, WandbOptions


@dataclass(frozen=True)
class GroupShape:
    """One node group of the task (spec.Group) as a recipe sees it."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu_name: str | None = None


@dataclass(frozen=True)
class Shape:
    """The cluster a recipe is built for: the numbers every role flag must agree with."""

    nodes: int
    gpus_per_node: int
    checkpoint_dir: str | None
    resume: bool
    gpu_name: str | None = None
    #: wait.node_silence: a recipe whose framework takes a collective timeout bounds it by this.
    node_silence_s: float = 30.0
    #: placement.wandb with job.wandb over it: a recipe passes them as its framework takes them.
    wandb: WandbOptions | None = None
    #: The task's node groups (the first holds rank 0); empty without groups. `nodes` and `gpus_per_node`
    #: are then those of the nodes with GPUs (shape_of in plan.py), which the recipes' arithmetic counts.
    groups: tuple[GroupShape, ...] = ()


@dataclass
class RecipeOutput:
    """A recipe's contribution to the plan. `entrypoint` is an argument list; the
    literal `{head_addr}` in an argument is replaced by the head's private address at
    submission. `wandb_args` are appended only when WANDB_API_KEY is provided."""

    entrypoint: list[str]
    #: "ray": submitted to the Ray cluster once it is up; "every_node": no Ray, every node
    #: runs the entrypoint itself, with {rank}, {nodes}, {head_addr} and {node_addr} filled in.
    mode: str = "ray"
    prepare: list[str] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: Commands for every node before Ray starts, after the task's own setup (installs what is missing).
    setup: list[str] = field(default_factory=list)
    #: Packages of rlhf_tasks these commands import on the nodes (`rlhf_tasks.demo`): providers
    #: that ship the node agent ship them beside it.
    modules: list[str] = field(default_factory=list)
    excludes: list[str] = field(default_factory=list)
    wandb_args: list[str] = field(default_factory=list)
    summary: dict | None = None
    #: The framework's checkpoints, as shell patterns of paths relative to the checkpoint directory
    #: (tiny-grpo's `step_*.pt`): the newest match is "the last checkpoint" a budget cap names, never
    #: the metrics or the prepared data beside them. Empty: not known (the newest file counts).
    checkpoint_files: list[str] = field(default_factory=list)
    #: Paths that `prepare` makes on the head and every node reads (an every-node service's index):
    #: where the nodes share no storage for them, the provider refuses the task.
    node_inputs: list[str] = field(default_factory=list)
    #: Whether the job's processes use torch: preflight then imports it on every node and
    #: runs a Gloo (and NCCL) all_reduce; otherwise it checks the network with TCP only.
    uses_torch: bool = True
    #: The open-files soft limit (RLIMIT_NOFILE) the framework's guide sets (`ulimit -n`): every node's
    #: agent raises its own to it before it starts Ray or the job (agent/limits.py). None: the node's stands.
    open_files: int | None = None
    #: Hugging Face Hub models the job loads (policy, reward, reference, a retriever's encoder): fetched
    #: once before the head starts (agent/hub.py), the job then runs with the hub offline.
    models: list[str] = field(default_factory=list)
    #: What else the job reads from the hub by name at run time (a dataset): not fetched ahead, so the
    #: job keeps the hub online.
    hub_reads: list[str] = field(default_factory=list)
    #: Node groups whose GPUs the recipe serves outside Ray (a reward model, a GPU retriever): their nodes join
    #: Ray with no GPUs (GroupPlan.ray_gpus 0), or a framework's placement groups ({GPU: 1} bundles on any node)
    #: could put an actor or a vLLM engine on the GPUs the served model holds.
    served_groups: list[str] = field(default_factory=list)


#: A Hugging Face Hub repository id as a recipe's argument names one (`Qwen/Qwen2.5-7B`); a path
#: (`/models/x`, `./x`, `~/x`) or a templated one is the user's own copy, never fetched.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_models(*names: str | None) -> list[str]:
    """The names among `names` that are Hugging Face Hub repositories (org/name), each once."""
    found = [n for n in names if n and _HUB_ID.match(n) and "--" not in n and ".." not in n]
    return list(dict.fromkeys(found))


class JobBase(StrictModel):
    """Fields every `job:` section has, whatever the recipe."""

    recipe_summary: ClassVar[str] = ""
    recipe_needs: ClassVar[str] = ""

    submit: Literal["head", "client"] = "head"
    working_dir: str | None = Field(".", description=(
        "the directory of the job's code, shipped with it: relative to the task file's directory (as dstack, "
        "SkyPilot and docker compose resolve paths) or absolute; null for none"))
    excludes: list[str] = []
    runtime_env: RuntimeEnvSpec | None = Field(None, description=(
        "Ray's runtime environment of the job besides its working_dir: pip, uv, env_vars, py_modules, excludes "
        "(ray.runtime_env.RuntimeEnv), passed to the job's submission on every provider"))
    timeout: Duration | None = None
    max_restarts: int = Field(2, ge=0, description="how often the head resubmits the job after a lost node, a "
                              "failure or a stall (it resumes from the latest checkpoint)")
    stall_timeout: Duration | None = Field(None, description="restart the job when its log has not grown for this "
                                           "long (e.g. 20m); off by default")
    wandb: WandbOptions | None = Field(None, description="W&B entity, project, group and tags of this job (over "
                                       "placement.wandb); logging is on when WANDB_API_KEY is a secret")
    open_files: int | None = Field(None, ge=1, description="the open-files soft limit (`ulimit -n`) every node's agent "
                                   "raises before Ray and the job start; default: the recipe's (search-r1 65535, "
                                   "openrlhf-m-grpo 65536, the others none)")

    #: What `check` says of where the framework puts its roles on the task's node groups, set by `build` (which
    #: check runs before ask_framework on the same job): printed with what was asked of the framework.
    _placement: list[str] = PrivateAttr(default_factory=list)

    def build(self, shape: Shape) -> RecipeOutput:  # pragma: no cover - abstract
        raise NotImplementedError

    def ask_framework(self, argv: list[str]) -> list[str]:
        """What the framework's own code, where it is installed here, says of the rendered command
        (`argv`: the entrypoint with the W&B flags; `check` asks, `render` does not): BadInput naming the
        task's field, with the framework's words, when it refuses; else the lines `check` prints of what
        was asked and of what could not be (recipes.installed)."""
        return []

    def metrics_reader(self):
        """A reader of this framework's metric lines (recipes.metrics), fresh for one job's log;
        None where the recipe knows no metric lines (a free command)."""
        return None


WHERE_PATTERN = r"group [a-z0-9][a-z0-9-]*"


def role_group(where: str, shape: Shape, arg: str, what: str) -> str | None:
    """The node group a role's `where: group NAME` argument (`arg`) names, None for the recipe's default place.
    Not the first group: it holds the head, where the framework's driver and trainers run."""
    if not where.startswith("group "):
        return None
    name = where.removeprefix("group ")
    groups = [g.name for g in shape.groups]
    if name not in groups:
        have = f"its groups: {', '.join(groups)}" if groups else "it has no groups"
        raise infeasible(f"the task has no group {name!r} ({have})", "name one of its groups", args=(arg,))
    if name == groups[0]:
        raise infeasible(f"group {name} is the trainer's (the first group holds the head and the driver)",
                         f"give the {what} a group of its own after the first", args=(arg,))
    return name


def served_line(name: str, what: str, roles: str) -> str:
    """What check says of a group the recipe serves `what` on outside Ray (RecipeOutput.served_groups)."""
    return (f"group {name}'s GPUs are the {what}'s, not Ray's: its nodes join Ray with none (ray start "
            f"--num-gpus 0), so no {roles} lands there")


def without_group(shape: Shape, name: str, arg: str, what: str) -> Shape:
    """The shape the trainer's roles count with group `name` given to the `what`: the other GPU groups."""
    rest = [g for g in shape.groups if g.name != name and g.gpus_per_node]
    if not rest:
        raise infeasible(f"with the {what} on group {name} no GPU group is left for the trainer",
                         "give another group GPUs", args=(arg,))
    return replace(shape, nodes=sum(g.nodes for g in rest), gpus_per_node=min(g.gpus_per_node for g in rest),
                   gpu_name=rest[0].gpu_name)


class Infeasible(BadInput):
    """An allocation that cannot work: the task fields involved, the arithmetic, and what to change."""

    def __init__(self, message: str, suggestion: str = "", args: tuple[str, ...] = (), fields: tuple[str, ...] = ()):
        self.message, self.suggestion, self.args_involved, self.fields = message, suggestion, tuple(args), tuple(fields)
        super().__init__(self._text())

    def _text(self) -> str:
        where = ", ".join([f"job.args.{name}" for name in self.args_involved] + list(self.fields))
        text = f"{where + ': ' if where else ''}infeasible allocation: {self.message}"
        return text + (f"\n  suggestion: {self.suggestion}" if self.suggestion else "")

    def only_args(self, names) -> "Infeasible":
        """The same error naming only the arguments that exist in `names` (for a recipe built on another's)."""
        kept = tuple(name for name in self.args_involved if name in names)
        return Infeasible(self.message, self.suggestion, kept, self.fields)


def infeasible(message: str, suggestion: str = "", args: tuple[str, ...] = (),
               fields: tuple[str, ...] = ()) -> Infeasible:
    """An allocation that cannot work. `args` are the recipe arguments in its arithmetic (named
    `job.args.NAME` in the error), `fields` other task fields (`resources.gpus`)."""
    return Infeasible(message, suggestion, args, fields)
