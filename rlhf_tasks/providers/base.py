"""The provider contract: pure `plan`/`render` (the dry run), effectful `apply`/`down`.

Everything that is true of one provider lives in its own file: its environment
contract and network presets (data the node agent interprets), the ports it must
avoid, its extra CLI options, and whether the launcher stops its cluster after the job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from .. import runtimeenv, state, workdir
from ..agent.protocol import CACHE_DIR
from ..errors import BadInput, StepFailed
from ..models import size_bytes, size_text
from ..plan import Contract, Plan, build_plan, name_bytes, with_caches
from ..registry import BUILTIN, provider_class
from ..spec import Task


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.0f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


@dataclass
class Cluster:
    """A cluster `apply` brought up: where the launcher reads it. A provider brings the
    cluster up and describes it; it never follows or summarises the job (the launcher does,
    once, for every provider: follow.py and outcome.py)."""

    name: str
    cluster_id: str
    token: str | None
    #: False once the head's node agent has ended (its process, its Slurm job, its pod).
    head_alive: Callable[[], bool]
    #: The head's dashboard, reachable from here (e.g. a forwarded localhost port); None when
    #: it is not (the launcher then follows the head's log).
    dashboard: str | None = None
    #: Files on this machine that the provider keeps filled with the node agents' output, the
    #: head's (rank 0) first; the head's holds the job's log, which the head agent relays. Empty:
    #: only the dashboard can be followed.
    node_logs: list[str] = field(default_factory=list)
    #: The head's output when it is not in node_logs (e.g. `dstack apply`'s attached log).
    head_log: Callable[[], str] | None = None
    #: What the provider tells of its machines (a Slurm job's state, the pods and their price):
    #: lines for the launcher's summary.
    describe: Callable[[], list[str]] = lambda: []
    #: The provider's own word that the job ended, and how, once it knows it (SkyPilot: `sky logs` exited
    #: FAILED): the headline when the head leaves without its result line, instead of a lost head.
    job_ended: Callable[[], str | None] = lambda: None
    #: Called while the launcher waits: what the provider does meanwhile (replace a dead node's
    #: agent, keep a tunnel up, report a queued job's state), as lines to show.
    tend: Callable[[], list[str]] = lambda: []
    #: Called once the launcher is done with the cluster: stop what the handle holds (log
    #: streams, tunnels); the cluster itself stays until `down`.
    close: Callable[[], None] = lambda: None
    #: Set by the launcher when Ctrl-C ended the launch: what becomes of the cluster was decided
    #: then (`down`, or left as a second Ctrl-C asked), so close() must not remove anything.
    interrupted: bool = False
    #: Every node's logs gathered here into a bundle by the provider's own means, for a failure whose bundle
    #: the dashboard can no longer give (the run over): its path and how it was made, or None.
    gather_here: Callable[[str], tuple[str, str] | None] | None = None
    #: The cluster's price per hour that its head agent counts, where the provider priced it itself before
    #: anything was rented (RunPod's catalog, dstack's run plan); None: the plan's (placement.price_per_hour).
    price_per_hour: float | None = None

    @property
    def logs_dir(self) -> str | None:
        """Where the node logs are, for the summary."""
        return str(Path(self.node_logs[0]).parent) if self.node_logs else None

    def read_head_log(self) -> str:
        """The head agent's output so far ("" when none reaches this machine)."""
        if self.node_logs:
            try:
                return Path(self.node_logs[0]).read_text(errors="replace")
            except FileNotFoundError:
                return ""
        return self.head_log() if self.head_log else ""


@dataclass(frozen=True)
class Retries:
    """What a provider relaunches on its own (placement.retry; a managed job's recovery), as read in its code:
    a relaunched attempt's head must find the training's spend where it reads it (the checkpoint storage), and
    end at a cap in a way the provider does not relaunch."""

    on: str                        # what it relaunches after, in words
    unbounded: str | None          # what it relaunches without a count, in words (None: every relaunch counted)
    cites: str                     # where that is read in its code
    on_failure: bool = False       # it relaunches after the job's own failure (placement.retry.errors)
    cap_exit: int = 1              # the head agent's exit status it does not relaunch (plan.budget.cap_exit)
    error_retries: int | None = None  # relaunches after the job's own failure the head counts (None: it counts none)


@dataclass(frozen=True)
class Option:
    """An extra `rlhf-tasks launch` option a provider declares (argparse's arguments)."""

    flag: str
    help: str
    kwargs: dict = field(default_factory=lambda: {"action": "store_true"})

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Sharing:
    """One rule of which storage every node can really share: a form of `checkpoints.shared.<provider>` on one
    backend, as the provider's own code and docs have it. The provider's check follows its rules, and the table
    in docs/providers.md is these rows (a test compares them), so a rule changes in one place."""

    form: str  #: the entry's key (`volume`, `bucket`, `claim`...), or what the provider shares without one
    backend: str  #: where the run lands: a backend or cloud, `any`, `other`, `SSH fleet`
    shared: str  #: "yes", "no", or "if ..." (a condition `check` cannot see, said as a note)
    why: str  #: the reason, citing the provider's code or docs

    def row(self, provider: str) -> str:
        return f"| `{provider}` | `{self.form}` | {self.backend} | {self.shared} | {self.why} |"


class Provider:
    name: ClassVar[str] = "?"
    #: How a node finds its rank, the node count and the head in this provider's environment.
    contract: ClassVar[Contract]
    #: Network presets this provider offers beyond auto, ethernet and infiniband.
    networks: ClassVar[dict[str, dict[str, str]]] = {}
    #: Ray settings this provider must move (e.g. away from SkyPilot's own ports).
    ray_overrides: ClassVar[dict[str, Any]] = {}
    #: Extra options of `rlhf-tasks launch --provider NAME`.
    options: ClassVar[tuple[Option, ...]] = ()
    #: The model of the task's `placement.<name>` when this provider owns such options
    #: (spec.PROVIDER_PLACEMENT); the provider reads them with it, `rlhf-tasks schema` shows it.
    placement_options: ClassVar[type | None] = None
    #: The launcher stops the cluster once the job has ended (unless `launch --keep`).
    stop_after_job: ClassVar[bool] = False
    #: The dashboard `launch` followed goes when the launcher ends (a port forward of the launch's own, such as
    #: `dstack apply`'s): after Ctrl-C, `rlhf-tasks stop` reaches it again through `rlhf-tasks forward NAME`.
    forward_after_launch: ClassVar[bool] = False
    #: What a second Ctrl-C does while `launch` stops the cluster it cancels (`down`): said with the first.
    down_again: ClassVar[str] = "Ctrl-C again leaves it running"
    #: The head's job.working_dir is this machine's directory (its node agents run here), so
    #: `submit: head` uploads it from here too.
    working_dir_here: ClassVar[bool] = False
    #: What the last plan measured of job.working_dir (workdir.Measure), when it is uploaded from here.
    upload: workdir.Measure | None = None
    #: Every node sees one filesystem (one machine; a Slurm cluster's shared filesystem), so what
    #: `prepare` makes on the head is there for the others without any storage of the task's.
    shares_filesystem: ClassVar[bool] = False
    #: The task's option for storage every node sees at checkpoints.path (checkpoints.shared.<name>).
    shared_option: ClassVar[str] = ""
    #: Which storage the nodes of one run can share here, per form and backend (Sharing).
    sharing: ClassVar[tuple[Sharing, ...]] = ()
    #: Where the cluster's price per hour comes from when the provider knows it itself (`check` says it);
    #: None: placement.price_per_hour.
    price_source: ClassVar[str | None] = None
    #: How placement.price_per_hour reaches the provider as its own bound on an instance's price (`check` says it);
    #: None: it does not (the price is only counted by the head).
    price_bound: ClassVar[str | None] = None
    #: The provider's own price of what it will provision, which `launch` asks before anything starts and the head
    #: counts instead of placement.price_per_hour where the provider prices it (`check` says it); None: none asked.
    #: Unlike price_source, a cap still needs placement.price_per_hour (kept where the provider prices nothing).
    launch_price: ClassVar[str | None] = None
    #: The portable placement fields (spot, retry, price_per_hour, fleets, backends, regions) this provider
    #: cannot use, and why: said by `check` and `render` and ignored, not refused, so one task file serves every
    #: provider (field -> what the provider does instead).
    ignores: ClassVar[dict[str, str]] = {}
    #: Whether its machines are billed (`check` says the cost; the local provider's are this machine).
    bills: ClassVar[bool] = True
    #: Whether it renders a task's node groups (`groups:`); one that does not refuses such a task at check.
    renders_groups: ClassVar[bool] = False
    #: The directory the rendered files are written to (set by `render -o` and `stage`); None: the
    #: current directory. A provider whose CLI resolves local paths from there (SkyPilot) uses it.
    render_dir: Path | None = None

    def __init__(self, **options: Any):
        known = {option.dest for option in self.options}
        unknown = set(options) - known
        if unknown:
            raise BadInput(f"--provider {self.name}: unknown options {sorted(unknown)}")
        self.chosen = {option.dest: options.get(option.dest) for option in self.options}

    @classmethod
    def live(cls, record: dict) -> bool:
        """Whether the cluster of this record may still run (and bill): until the record says it
        ended. A provider that can tell from here that it ended on its own says so."""
        return not record.get("ended")

    def relaunches(self) -> int:
        """How often `launch` relaunches the whole task when its head is lost (the provider's
        own relaunch, like dstack's `retry`, happens outside and needs none)."""
        return 0

    def retries(self, plan: Plan) -> Retries | None:
        """What this provider relaunches on its own for this plan; None: nothing (a relaunch is the
        launcher's, `launch --retry N`, which passes the spend on itself)."""
        return None

    def spend_kept(self, plan: Plan) -> bool:
        """Whether a relaunched attempt's head finds the spend record the attempts before it wrote: the
        checkpoint directory is storage every attempt sees (shared storage, one filesystem)."""
        return bool(plan.checkpoint_dir) and bool(plan.checkpoint_shared or self.shares_filesystem)

    def retry_rules(self, plan: Plan) -> Plan:
        """The plan's budget with the provider's retry rules (agent/budget.py), or BadInput naming the field
        where the retries could spend past the caps: a retried attempt's head that cannot read what the
        attempts before it spent starts its count again."""
        retries = self.retries(plan)
        errors = plan.placement.retry_errors
        if errors and (retries is None or not retries.on_failure):
            raise BadInput(f"placement.retry.errors: the {self.name} provider does not relaunch a run after the "
                           f"job's own failure; use placement.retry: true (or the job's own job.max_restarts)")
        if retries is None:
            return plan
        budget = plan.budget
        capped = budget.max_duration_s or (budget.max_cost is not None and (budget.price_per_hour or
                                                                           self.price_source))
        if capped and not self.spend_kept(plan):
            from ..agent.protocol.spend import SPEND_FILE

            grace = budget.stop_grace_s
            if budget.max_cost is not None and budget.price_per_hour:
                each = f"${budget.max_cost + budget.price_per_hour * grace / 3600:.2f} (placement.max_cost " \
                       f"${budget.max_cost:.2f}, then placement.stop_grace {grace:.0f}s at ${budget.price_per_hour:.2f}/h)"
            else:
                each = f"its caps (placement.max_duration {budget.max_duration_s or 0:.0f}s, then placement." \
                       f"stop_grace {grace:.0f}s)"
            where = f"checkpoints.path {plan.checkpoint_dir} is a directory on each node" if plan.checkpoint_dir \
                else "the task has no checkpoint directory (checkpoints.path)"
            many = f"with no bound on the attempts ({retries.unbounded})" if retries.unbounded else "on every attempt"
            raise BadInput(f"placement.retry: {self.name} relaunches the run after {retries.on} ({retries.cites}), "
                           f"and {where}, so a relaunched attempt's head cannot read what the attempts before it "
                           f"spent (the spend record {SPEND_FILE} is kept there): each attempt may spend up to {each}, "
                           f"{many}, past the training's caps. Give {self.shared_option or 'shared checkpoint storage'}"
                           f", or leave placement.retry out")
        return plan.replace(budget=budget.model_copy(update={"cap_exit": retries.cap_exit,
                                                             "error_retries": retries.error_retries}))

    def default_checkpoint_dir(self, task: Task) -> str:
        """Where checkpoints go when the task names no path."""
        return f"/checkpoints/{task.name}"

    def cache_dir(self, plan: Plan) -> str | None:
        """Where the caches go (plan.CACHE_ENV below it: HF_HOME, TORCH_HOME, VLLM_CACHE_ROOT): on the storage
        every node and a later run see, `.cache` in the checkpoint directory (kept by `launch --fresh`); None:
        each node's own default (~/.cache)."""
        if plan.checkpoint_dir and (plan.checkpoint_shared or self.shares_filesystem):
            return f"{plan.checkpoint_dir.rstrip('/')}/{CACHE_DIR}"
        return None

    def hub_words(self, plan: Plan) -> tuple[str, bool] | None:
        """What `check` says of the models the nodes fetch from the hub, and whether it is a warning: fetched
        once where one cache is shared; else what fetching them on every node costs (by the sizes in their
        names), a warning. None: the task names no model."""
        hub = plan.hub
        if hub is None:
            return None
        names = ", ".join(hub.models)
        where = hub.cache or "the default cache of this machine (~/.cache/huggingface)" if hub.shared else \
            hub.cache or "the node's default cache (~/.cache/huggingface)"
        offline = ("then Ray, the job and the services run with HF_HUB_OFFLINE=1" if hub.offline else
                   f"the job keeps the hub online: it reads {', '.join(hub.online_for)} from the hub at run time"
                   if hub.online_for else "HF_HUB_OFFLINE stays as the task's env sets it")
        if hub.shared or plan.nodes == 1:
            return f"{names}: fetched once, on the head before Ray starts, into {where}; {offline}", False
        sizes = {model: name_bytes(model) for model in hub.models}
        known = sum(size for size in sizes.values() if size)
        unknown = [model for model, size in sizes.items() if not size]
        cost = (f"about {_gb(known)} per node by the sizes in their names, {_gb(known * plan.nodes)} "
                f"from the hub in all" if known else "their size is not known from their names")
        if known and unknown:
            cost += f" (and {', '.join(unknown)}, whose size is not known from its name)"
        return (f"{names}: each of the {plan.nodes} nodes fetches them into its own cache ({where}) before Ray "
                f"starts, {plan.nodes} times: {cost}; to fetch them once, give "
                f"{self.shared_option or 'shared checkpoint storage'}; {offline}"), True

    def check(self, task: Task) -> None:
        """The provider's own checks of a task (BadInput naming the field); pure."""

    #: Why this provider cannot run node groups at all (its own code's reason), where it is not just "not yet".
    groups_refusal: ClassVar[str | None] = None

    def check_groups(self, task: Task) -> None:
        """A task with node groups refused where this provider does not render them (renders_groups), before its
        own checks, which read the task's top-level resources: with its reason (groups_refusal), or "not yet"."""
        if task.groups and not self.renders_groups:
            those = ", ".join(name for name in BUILTIN if provider_class(name).renders_groups)
            why = self.groups_refusal or f"the {self.name} provider does not render node groups yet"
            raise BadInput(f"groups: {why}: run the task with a provider that does ({those}), or give it top-level "
                           f"nodes and resources (one kind of node) instead of groups")

    def ask_own_code(self, plan: Plan) -> list[str]:
        """What the provider's own code, where it is installed here, says of this plan's render (its
        parsers, names and catalogs, offline; `check` asks, `render` does not, to stay fast): BadInput
        naming the task's field, with the provider's words, when it refuses; else the lines `check`
        prints of what was asked and of what could not be."""
        return []

    def notes(self, plan: Plan) -> list[str]:
        """What `check` and `render` say the plan leaves to the user on this provider (warnings,
        not refusals): the shared-storage warning, and the provider's own."""
        warning = self.shared_storage_warning(plan)
        hub = self.hub_words(plan)
        return ([warning] if warning else []) + ([f"models: {hub[0]}"] if hub and hub[1] else []) + \
            self.ignored_words(plan)

    def ignored_words(self, plan: Plan) -> list[str]:
        """`placement.F: ignored on NAME: why` for each field of `ignores` the task sets."""
        placement = plan.placement
        said = [f"placement.{field}: ignored on {self.name}: {why}" for field, why in self.ignores.items()
                if field in placement.model_fields_set and getattr(placement, field) not in (None, False, [], "off")]
        if "price_per_hour" in self.ignores and plan.groups and plan.groups[0].price_per_hour is not None:
            said.append(f"groups[i].price_per_hour: ignored on {self.name}: {self.ignores['price_per_hour']}")
        return said

    def shared_storage_warning(self, plan: Plan) -> str | None:
        """Why a multi-node task's checkpoints would be seen by one node only here, if so
        (the CLI prints it at `check` and `render`); pure."""
        return None

    def plan(self, task: Task) -> Plan:
        """The plan this provider's nodes run."""
        try:
            self.check_groups(task)
            self.check(task)
            plan = self.retry_rules(self.build(task))
            plan = with_caches(plan, self.cache_dir(plan), self.shares_filesystem)
            self.check_node_inputs(plan)
            return self.measure_upload(plan)
        except BadInput as exc:
            raise BadInput(f"{task.source}: {exc}") from None

    def build(self, task: Task) -> Plan:
        """Task + recipe + this provider's contract and choices -> the plan (nothing measured)."""
        return build_plan(task, self.name, self.contract, self.networks, self.default_checkpoint_dir(task),
                          self.ray_overrides, priced=self.price_source is not None)

    def fits(self, task: Task) -> None:
        """BadInput when this provider cannot run the task (`check` without --provider): its own
        checks and the plan's, without measuring an upload. A plan that cannot be built (an
        infeasible allocation) is the task's fault, which `check` then says with the plan's error."""
        self.check_groups(task)
        self.check(task)
        try:
            plan = self.build(task)
        except BadInput:
            return
        self.check_node_inputs(self.retry_rules(plan))

    def check_node_inputs(self, plan: Plan) -> None:
        """What `prepare` makes on the head and every node reads (plan.node_inputs, the recipe's)
        must be on storage every node sees: refused (BadInput naming this provider's option) when
        it lies in the checkpoint directory and that is a directory on each node. A path outside
        it (an image's, a mount of the user's) is the user's to share."""
        if plan.nodes < 2 or self.shares_filesystem or plan.checkpoint_shared or not plan.checkpoint_dir:
            return
        inside = [p for p in plan.node_inputs
                  if p.rstrip("/") == plan.checkpoint_dir.rstrip("/") or p.startswith(plan.checkpoint_dir.rstrip("/") + "/")]
        if inside:
            raise BadInput(
                f"checkpoints.shared.{self.name}: missing: `prepare` writes {inside[0]} on the head, and every node "
                f"reads it (the recipe's every-node services), but checkpoints {plan.checkpoint_dir} is a directory "
                f"on each {self.name} node, so every node but the head would find nothing; add {self.shared_option} "
                f"(storage every node mounts at checkpoints.path)")

    def uploads_working_dir(self, plan: Plan) -> bool:
        """Whether Ray uploads job.working_dir as it is on this machine (measured here: `submit: client`,
        or a provider whose head reads this machine's directory or a copy of it)."""
        return bool(plan.job.working_dir) and (self.working_dir_here or plan.job.submit == "client")

    def upload_excluded(self, plan: Plan) -> list[Callable[[Path], bool]]:
        """What the provider's own copy of job.working_dir leaves out before the head's Ray packs it."""
        return []

    def upload_words(self, plan: Plan) -> str:
        """Where the measured job.working_dir goes, for `check`."""
        return "uploaded from this machine, the job runs in Ray's copy of it"

    def measure_upload(self, plan: Plan) -> Plan:
        """When Ray uploads job.working_dir from this machine's copy (uploads_working_dir), measure it
        now, before anything starts (BadInput over Ray's limit), and leave out the virtualenvs and
        runs directory found in it (workdir.py)."""
        self.upload = None
        plan = self.check_runtime_env(plan)
        if not self.uploads_working_dir(plan):
            return plan
        self.upload = workdir.check(plan.job.working_dir, plan.job.excludes, self.upload_excluded(plan),
                                    "" if plan.job.submit == "client" or self.working_dir_here else
                                    f" (the head uploads it to the job on {self.name})")
        return plan.replace(job=plan.job.model_copy(update={"excludes": plan.job.excludes + self.upload.left_out}))

    def check_runtime_env(self, plan: Plan) -> Plan:
        """Refuse the paths of job.runtime_env that would not reach the job here (runtimeenv.check_paths:
        a py_module outside job.working_dir where only the working_dir is shipped, a nodes' path where Ray
        reads it on this machine), and measure the py_modules Ray uploads from this machine."""
        if plan.job.runtime_env:
            here = self.working_dir_here or plan.job.submit == "client"
            runtimeenv.check_paths(plan.job.runtime_env, plan.job.working_dir, self.name, plan.job.submit, here,
                                   plan.job.excludes)
        return plan

    def working_dir_words(self, plan: Plan) -> str | None:
        """What `check` says of job.working_dir where nothing is uploaded from this machine and the
        job runs in a directory of the provider's (None: nothing to say; an upload says its size)."""
        return None

    def render(self, plan: Plan) -> dict[str, str]:
        """File name -> content; pure, printable, safe to commit (no secret values).
        What `apply` runs is exactly this."""
        raise NotImplementedError

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        raise NotImplementedError

    def down(self, name: str) -> str:
        """Stop the cluster; StepFailed when the provider could not."""
        raise NotImplementedError

    def refuses_missing_secrets(self, plan: Plan, missing: list[str]) -> str | None:
        """Why this provider cannot launch `plan` while these of its secrets are not set here
        (the launcher refuses before anything starts, exit 2); None: it launches without them,
        and the launcher says once which are not passed."""
        return None

    def status(self, name: str) -> str | None:
        """What the provider says of the cluster's machines (`rlhf-tasks status NAME`), if it can."""
        return None

    def state_line(self, name: str) -> str | None:
        """The cluster's state in one line, as the provider reports it now (`rlhf-tasks ps`): the first
        line of `status`; None where the provider reports none from here. Raises (OSError, StepFailed,
        BadInput) where it cannot be asked."""
        said = self.status(name)
        if not said:
            return None
        first = said.splitlines()[0].strip()
        return first[len(name) + 2:] if first.startswith(f"{name}: ") else first

    #: Where a provider that reports no state here has it said (`rlhf-tasks ps`), `{name}` the cluster's.
    state_elsewhere: ClassVar[str | None] = None

    def cluster_token(self, name: str) -> str | None:
        """The Ray token of a cluster whose token the provider makes itself (kept here for `env`,
        `token`, `submit`); None where rlhf-tasks makes it (the record's token file is the one)."""
        return None

    #: Whether the provider makes the cluster's Ray token (then `token NAME` reads it, never invents one).
    makes_token: ClassVar[bool] = False

    def forward(self, name: str, port: int | None = None) -> int:
        """Forward the head's dashboard to this machine until Ctrl-C (`rlhf-tasks forward NAME`)."""
        raise BadInput(f"forward: the {self.name} provider opens no tunnel of its own; use its port forward "
                       f"(e.g. ssh -L)")

    def bundle_here(self, name: str, secrets: dict[str, str]) -> str | None:
        """`logs NAME --bundle` where the dashboard reaches no node: a bundle made of what the provider kept
        here (its path), or None."""
        return None

    def ready(self, plan: Plan) -> None:
        """What `apply` needs of this machine (its CLI, credentials), checked before the
        launcher writes anything: BadInput saying what is missing and how to get it."""

    def before_launch(self, name: str) -> state.Before:
        """What is kept of cluster `name` and staged for it before a launch writes anything."""
        return state.before_launch(name, state.run_dir(name) / self.name)

    def abandon(self, before: state.Before) -> list[str]:
        """Undo what a launch that failed before its job started created here, and only that
        (never an earlier launch's record, token or files): what was undone."""
        return state.undo_launch(before)

    def stage(self, plan: Plan, secrets: dict[str, str]) -> tuple[Path, str | None, dict[str, str]]:
        """For `apply` through a provider CLI: write the rendered files under runs/NAME/PROVIDER,
        make the cluster's token, and the CLI's environment (secrets and token by value)."""
        directory = state.run_dir(plan.name) / self.name
        self.render_dir = directory
        write_files(directory, self.render(plan))
        token = state.new_token(plan.name) if plan.token_env else None
        env = {**os.environ, **secrets, **({plan.token_env: token} if token else {})}
        return directory, token, env


#: docker's and podman's --shm-size units (go-units RAMInBytes): powers of 1024, whatever the case.
DOCKER_UNITS = (("g", 2**30), ("m", 2**20), ("k", 2**10), ("b", 1))


#: What `docker run`/`podman run` needs for AMD GPUs, as verl's AMD script (docs/amd_tutorial/
#: amd_build_dockerfile_page.rst) and ROCm's container guide run them: the devices (/dev/kfd, the compute
#: interface; /dev/dri, a node per GPU) and their group; ptrace for debuggers and py-spy (Ray's stack traces);
#: no seccomp filter, which ROCm recommends on HPC nodes (numactl's memory-policy calls).
AMD_CONTAINER_OPTIONS = ("--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--cap-add=SYS_PTRACE",
                         "--security-opt=seccomp=unconfined")


def docker_size(size: str) -> str:
    """A task's size as `docker run --shm-size` / `podman run --shm-size` takes it, the same bytes: `64GiB` ->
    `64g`, `128GB` -> `125000000k`."""
    return size_text(size_bytes(size), DOCKER_UNITS)


def require_cli(executable: str, extra: str) -> str:
    """The provider's CLI beside the running interpreter (a venv's bin/) or on PATH, or a
    bad-input error that says how to install it."""
    beside = Path(sys.executable).parent / executable
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    path = shutil.which(executable)
    if path is None:
        raise BadInput(f"--provider: the `{executable}` command is not installed; "
                       f"pip install 'rlhf-tasks[{extra}]' (and configure it) first")
    return path


def write_files(directory, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = Path(directory) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def end_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """Stop a helper process this launcher started (a port forward, a tunnel): SIGTERM, then
    SIGKILL after `grace` seconds; reaped either way."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def start_tunnel(argv: list[str]) -> tuple[subprocess.Popen, Callable[[], str]]:
    """Start a port forward's command (`kubectl port-forward`, `dstack attach`) in its own session, its
    output read by a thread: the process, and what it has said so far (the last 600 characters, one line)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
    reader.start()

    def said() -> str:
        if proc.poll() is not None:
            reader.join(5)
        return " ".join(b"".join(chunks).decode(errors="replace").split())[-600:]
    return proc, said


def hold_forward(name: str, tunnel: subprocess.Popen, how: str, dashboard: str, *, timeout: float,
                 said: Callable[[], str], then: str, recorded: bool, ready: Callable[[], None] | None = None,
                 silent_head: str = "", end: Callable[[subprocess.Popen], None] | None = None) -> int:
    """`rlhf-tasks forward`, once the provider started its tunnel (`how`: its command, for messages): only
    once the head's dashboard answers through it is the address recorded (where the cluster has a record
    here: `recorded`; then `ready` runs) and said, with `then` to run in another shell; then the tunnel is
    held until Ctrl-C (exit 0) or until it exits. A tunnel
    that exits first, or a dashboard silent for `timeout` seconds (`silent_head`: what to check then), is a
    StepFailed in the tunnel's own words. The tunnel is ended either way (`end`, else SIGTERM)."""
    from ..agent.protocol import AgentError, http_check, wait_for
    from ..console import say

    what = f"forwarding the dashboard of {name}"

    def answers() -> bool:
        if tunnel.poll() is not None:
            raise StepFailed(what, f"{how} exited with code {tunnel.returncode}: {said() or 'no output'}")
        return http_check(f"{dashboard}/api/gcs_healthz")
    try:
        try:
            wait_for(f"the dashboard of {name} through {how}", answers, timeout, interval=0.3, max_interval=2.0)
        except AgentError as exc:
            raise StepFailed(what, f"{exc}{silent_head}") from None
        if recorded:
            state.update(name, dashboard=dashboard)
            if ready:
                ready()
        say(f"the dashboard of {name} is at {dashboard} (Ctrl-C closes it); in another shell: {then}")
        return tunnel.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        (end or end_process)(tunnel)


def stop_with_cli(argv: list[str], name: str) -> str:
    """`down` through a provider's CLI (`dstack stop`, `sky down`): what it said, or StepFailed
    naming the command; the cluster's record is marked ended."""
    what = " ".join([Path(argv[0]).name, *argv[1:3]])
    out = subprocess.run(argv, capture_output=True, text=True)
    said = (out.stdout.strip() + "\n" + out.stderr.strip()).strip()
    if out.returncode != 0:
        raise StepFailed(what, said or f"exit code {out.returncode}")
    state.end(name)
    return said or f"{what}: done"
