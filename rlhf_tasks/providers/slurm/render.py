"""The batch script (`render`, pure): its #SBATCH lines, each with the field it comes from, the agent and
its plan as heredocs, and the one step of agents; and what must hold before it is written (the task's
checks, the passed-through sbatch options against the script's own).

SlurmRender is the provider without its side effects; SlurmProvider (the package) adds `launch`, `status`
and `down`, which run Slurm's commands.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from ...agent.protocol import AGENT_ENTRY
from ...errors import BadInput
from ...models import size_bytes, size_text
from ...plan import Contract, GroupPlan, Plan, check_contract_env, command, env
from ...spec import Resources, Task
from ..base import Provider, Sharing
from ..shipping import AGENT, heredoc, module_files
from .container import CONTAINER_EOF, CONTAINER_NAME, CONTAINER_SH, ENGINES, HOSTS_ENV, container_lines
from .placement import (DEFAULT_OUTPUT, GIVEN_ONLY, LAUNCH_OWN, OWN, SAME_THING, SlurmPlacement, group_slurm,
                        option_name, origin_words, slurm_placement)

NODELIST = ["scontrol", "show", "hostnames", "{SLURM_JOB_NODELIST}"]


def het_nodelists(plan: Plan, var: str = "{SLURM_JOB_NODELIST_HET_GROUP_%d}") -> str:
    """Every component's hosts in the components' order (a heterogeneous job's SLURM_JOB_NODELIST is not)."""
    return ",".join(var % index for index in range(len(plan.groups)))


def het_contract(plan: Plan) -> Contract:
    """A heterogeneous job's contract, as Slurm 22.05 sets it in the one step over every component (`srun
    --het-group=0-N`, seen on the tests' Slurm): SLURM_NODEID counts the nodes component by component (rank 0
    is the first component's first host) and SLURM_JOB_NUM_NODES is every component's; the head is the first
    host of the first component's list, the peer the next host in the components' order."""
    hosts = ["scontrol", "show", "hostnames", het_nodelists(plan)]
    return SlurmRender.contract.model_copy(update={"head": command(hosts, item=0), "peer": command(hosts, item=1)})
MODULE_EOF, PLAN_EOF = "RLHF_TASKS_MODULE_PY", "RLHF_TASKS_PLAN_JSON"


def run_dir_of(directory: Path, job_id: str) -> Path:
    """Where the script puts the agent, the plan and each node's output."""
    return directory / f"rlhf-tasks-{job_id}"


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


#: Why the script writes `#SBATCH hetjob` (sbatch(1): the separator of a heterogeneous job's components).
HETJOB = "the script's own: the next node group's component"


class Fields:
    """The task's fields a component's lines come from: the task's own, or a node group's (`groups[1].nodes`,
    `groups[1].placement.slurm.partition` where the group gives it, else the task's placement.slurm)."""

    def __init__(self, group=None, index: int = 0):
        self.group, self.prefix = group, f"groups[{index}]." if group is not None else ""
        self.nodes = group.nodes if group is not None else None

    def of(self, field: str) -> str:
        return self.prefix + field

    def slurm(self, key: str) -> str:
        """Where the option came from: the group's own, else the task's."""
        own = self.group is not None and key in self.group.placement.slurm
        return f"{self.prefix if own else ''}placement.slurm.{key}"

    def give(self, key: str) -> str:
        """Where to write the option for this component alone: the group's (the task's applies to every one)."""
        return f"{self.prefix}placement.slurm.{key}"


class SlurmRender(Provider):
    """The provider's pure part: its contract, the task's checks, the plan and the batch script."""

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
    renders_groups = True  # a heterogeneous job: one component per node group (components)
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
        images = {group.image or task.image for group in task.groups}
        if len(images) > 1:
            raise BadInput(f"groups: the groups name {len(images)} images; the slurm provider runs one step of "
                           f"agents, in one image for every node: give the groups one image (the task's)")
        for fields, res, own in self.machines(task):
            gpu_type, gres = fields.slurm("gpu_type"), fields.slurm("gres")
            if own.gpu_type and own.gres:
                raise BadInput(f"{gpu_type}: {gres} says the GPUs ({own.gres}) with their type already; give one "
                               f"of them")
            if own.gpu_type and ":" in own.gpu_type:
                raise BadInput(f"{gpu_type}: {own.gpu_type!r}: the type's name alone (h100 of gpu:h100:8); the "
                               f"count comes from {fields.of('resources.gpus')}")
            if res.gpu_memory and not own.gpu_type and not own.gres:
                raise BadInput(f"{fields.of('resources.gpus')}: {res.gpus}: Slurm asks for GPUs by the type names "
                               f"each cluster gives them (its gres.conf), not by memory; give {fields.give('gpu_type')} "
                               f"with your cluster's name for such a GPU (`sinfo -o %G` lists them: gpu:a100_80g:8 "
                               f"-> a100_80g), or {fields.give('gres')}")
            if own.gpu_type and not res.gpus_per_node:
                raise BadInput(f"{gpu_type}: the {'group' if task.groups else 'task'} asks for no GPUs "
                               f"({fields.of('resources.gpus')}); give {fields.of('resources.gpus')}, or remove "
                               f"gpu_type")

    @staticmethod
    def machines(task: Task | Plan) -> list[tuple["Fields", Resources, SlurmPlacement]]:
        """Each component's fields, resources and placement.slurm: the task's, or each node group's."""
        if not task.groups:
            return [(Fields(), task.resources, slurm_placement(task.placement))]
        return [(Fields(group, index), group.machine if isinstance(group, GroupPlan) else group.resources,
                 group_slurm(task.placement, group, index)) for index, group in enumerate(task.groups)]

    def notes(self, plan: Plan) -> list[str]:
        """Besides the shared-storage warning: what the script leaves to Slurm without a word in it,
        the GPU type (Slurm names types per cluster) and the time limit."""
        out = super().notes(plan)
        for fields, res, own in self.machines(plan):
            if res.gpu_name and not own.gpu_type and not own.gres:
                out.append(f"{fields.of('resources.gpus')}: the script asks Slurm for {res.gpus_per_node} GPU(s) of "
                           f"any type per node (--gpus-per-node={res.gpus_per_node}): {res.gpu_name} is not passed, "
                           f"since each Slurm cluster names its GPU types itself (gres.conf); give "
                           f"{fields.give('gpu_type')} with your cluster's name for it (`sinfo -o %G` lists them: "
                           f"gpu:h100:8 -> h100), or {fields.give('gres')}")
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
        if plan.image:  # the container's contract reads the host list the script expands (in components' order)
            return plan.replace(contract=self.container_contract)
        return plan.replace(contract=het_contract(plan)) if plan.groups else plan

    # ------------------------------------------------------------------ render

    def sbatch_options(self, plan: Plan) -> list[str]:
        return [option for option, _ in self.sbatch_lines(plan)]

    def sbatch_lines(self, plan: Plan, passed: bool = True) -> list[tuple[str, str]]:
        """The script's #SBATCH options, each with where it comes from (the task's field, or why the script
        sets it): the words of a conflict and of sbatch's refusal name it. `passed`: with placement.slurm.sbatch.
        With node groups, a heterogeneous job: one component per group in the task's order, `hetjob` between
        them (components), the job's own options in the first."""
        return [line for component in self.components(plan, passed) for line in component]

    def components(self, plan: Plan, passed: bool = True) -> list[list[tuple[str, str]]]:
        """The #SBATCH lines of each component of the job: one, or one per node group (each its machine and its
        placement.slurm keys over the task's; Slurm 22.05 resets --nodes, --constraint, --partition and the
        like for each component, and carries --job-name and --time from the first, as seen on the tests' Slurm)."""
        if not plan.groups:
            return [self.component_lines(plan, slurm_placement(plan.placement), Fields(), True, passed)]
        out = []
        for index, group in enumerate(plan.groups):
            own = group_slurm(plan.placement, group, index)
            lines = self.component_lines(plan.for_group(group), own, Fields(group, index), index == 0, passed)
            out.append(lines if index == 0 else [("hetjob", HETJOB), *lines])
        return out

    def component_lines(self, plan: Plan, slurm: SlurmPlacement, fields: "Fields", first: bool,
                        passed: bool) -> list[tuple[str, str]]:
        """One component's lines (the whole job's without groups); `first`: with the job's own options."""
        res = plan.resources
        lines = [(f"--job-name={plan.name}", "name")] if first else []
        lines += [(f"--nodes={fields.nodes or plan.nodes}", fields.of("nodes")),
                  ("--ntasks-per-node=1", OWN["ntasks-per-node"])]
        if res.cpus:
            lines.append((f"--cpus-per-task={res.cpus}", fields.of("resources.cpus")))
        if slurm.gres:
            lines.append((f"--gres={slurm.gres}", fields.slurm("gres")))
        elif plan.gpus_per_node:
            typed = f"{slurm.gpu_type}:" if slurm.gpu_type else ""
            lines.append((f"--gpus-per-node={typed}{plan.gpus_per_node}", fields.of("resources.gpus")))
        if res.memory:
            lines.append((f"--mem={slurm_mem(res.memory)}", fields.of("resources.memory")))
        lines.append(("--exclusive", OWN["exclusive"]))
        if first:
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
                lines.append((f"--{key}={getattr(slurm, key)}", fields.slurm(key)))
        if first and slurm.mail_type:
            lines.append((f"--mail-type={','.join(slurm.mail_type)}", "placement.slurm.mail_type"))
        if first and slurm.mail_user:
            lines.append((f"--mail-user={slurm.mail_user}", "placement.slurm.mail_user"))
        if slurm.overcommit:
            lines.append(("--overcommit", fields.slurm("overcommit")))
        if passed:
            lines += [(option, f"{fields.slurm('sbatch')}[{i}]") for i, option in enumerate(slurm.sbatch)]
        return lines

    def check_passed(self, plan: Plan) -> None:
        """placement.slurm.sbatch against the options the script sets itself (its render, not a list of
        names): BadInput for one that sets what a rendered option sets, since sbatch takes the last
        silently; for a prefix of a rendered option's name, which sbatch reads as that option
        (getopt_long) or refuses as ambiguous; and for those that break what `launch` counts on."""
        for bare, full in zip(self.components(plan, passed=False), self.components(plan)):
            self.check_passed_in(dict((option_name(option), (option, where)) for option, where in bare),
                                 full[len(bare):])

    @staticmethod
    def check_passed_in(rendered: dict[str, tuple[str, str]], passed: list[tuple[str, str]]) -> None:
        """One component's passed options against its rendered ones (check_passed)."""
        for item, field in passed:
            name = option_name(item)
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
                raise BadInput(f"{field}: {item} fights the script's own #SBATCH {option} ({origin_words(where)}): "
                               f"{why}")

    @staticmethod
    def time_limit(plan: Plan) -> float | None:
        """--time in seconds: placement.max_duration, else the job's timeout and the waits before it; None: none."""
        return plan.placement.max_duration or (
            plan.job.timeout_s + plan.wait.head_s + plan.wait.nodes_s if plan.job.timeout_s else None)

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
            nodelist = het_nodelists(plan, "$SLURM_JOB_NODELIST_HET_GROUP_%d") if plan.groups else "$SLURM_JOB_NODELIST"
            lines += ["", "# No scontrol inside the image: the host list, expanded once here.",
                      f'{HOSTS_ENV}=$(scontrol show hostnames "{nodelist}" | paste -sd, -)',
                      f"export {HOSTS_ENV}"]
            if engine:
                lines += ["# The engine runs each node's container outside the Slurm step: a wrapper stops it by name.",
                          "container=" + CONTAINER_NAME.format(name=q(plan.name), job_id='"$SLURM_JOB_ID"'),
                          *heredoc('"$run_dir/container.sh"', CONTAINER_SH, CONTAINER_EOF)]
                if plan.env:
                    lines += ["# The task's env, passed into the container by name.",
                              *(f"export {key}={q(value)}" for key, value in plan.env.items())]
        srun = [["srun", *self.step_nodes(plan), "--kill-on-bad-exit=1", "--whole"], ['--output="$run_dir/node%n.out"']]
        if plan.job.working_dir:
            srun[-1].append('--chdir="$job_dir"')
        if plan.image:  # pyxis options, or the docker/podman command the agent runs in
            srun += container_lines(plan)
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
                      f"srun --overlap {' '.join(self.step_nodes(plan))} \\",
                      f'    bash "$run_dir/container.sh" "$container" {engine} stop '
                      '|| echo "rlhf-tasks: the containers\' clean-up step ended with exit code $?"']
        lines.append('exit "$status"')
        return "\n".join(lines) + "\n"

    @staticmethod
    def step_nodes(plan: Plan) -> list[str]:
        """srun's words for a step of one task on every node: of every component of a heterogeneous job (each
        component's own --nodes and --ntasks-per-node=1 then hold)."""
        if plan.groups:
            return [f"--het-group=0-{len(plan.groups) - 1}"]
        return [f"--nodes={plan.nodes}", f"--ntasks={plan.nodes}", "--ntasks-per-node=1"]

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

