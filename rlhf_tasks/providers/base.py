"""The provider contract: pure `plan`/`render` (the dry run), effectful `apply`/`down`.

Everything that is true of one provider lives in its own file: its environment
contract and network presets (data the node agent interprets), the ports it must
avoid, its extra CLI options, and whether the launcher stops its cluster after the job.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from .. import state
from ..errors import BadInput
from ..plan import Contract, Plan, build_plan
from ..spec import Task


@dataclass
class Cluster:
    """A cluster `apply` brought up, as the launcher sees it."""

    name: str
    cluster_id: str
    dashboard: str                       # reachable from here (e.g. a forwarded localhost port)
    token: str | None
    head_alive: Callable[[], bool]       # False once the head's process (or run) has ended
    head_log: Callable[[], str] = lambda: ""
    logs_dir: str | None = None
    #: Set when the provider followed the job to its end itself (a managed job): its exit code.
    finished: int | None = None
    #: Called while the launcher waits: replaces what the provider replaces (a dead node's
    #: agent, on the local provider) and says what it did.
    tend: Callable[[], list[str]] = lambda: []


@dataclass(frozen=True)
class Option:
    """An extra `rlhf-tasks launch` option a provider declares (argparse's arguments)."""

    flag: str
    help: str
    kwargs: dict = field(default_factory=lambda: {"action": "store_true"})

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


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

    def __init__(self, **options: Any):
        known = {option.dest for option in self.options}
        unknown = set(options) - known
        if unknown:
            raise BadInput(f"--provider {self.name}: unknown options {sorted(unknown)}")
        self.chosen = {option.dest: options.get(option.dest) for option in self.options}

    def relaunches(self) -> int:
        """How often `launch` relaunches the whole task when its head is lost (the provider's
        own relaunch, like dstack's `retry`, happens outside and needs none)."""
        return 0

    def default_checkpoint_dir(self, task: Task) -> str:
        """Where checkpoints go when the task names no path."""
        return f"/checkpoints/{task.name}"

    def check(self, task: Task) -> None:
        """The provider's own checks of a task (BadInput naming the field); pure."""

    def shared_storage_warning(self, plan: Plan) -> str | None:
        """Why a multi-node task's checkpoints would be seen by one node only here, if so
        (the CLI prints it at `check` and `render`); pure."""
        return None

    def plan(self, task: Task) -> Plan:
        """The plan this provider's nodes run."""
        try:
            self.check(task)
            return build_plan(task, self.name, self.contract, self.networks, self.default_checkpoint_dir(task),
                              self.ray_overrides)
        except BadInput as exc:
            raise BadInput(f"{task.source}: {exc}") from None

    def render(self, plan: Plan) -> dict[str, str]:
        """File name -> content; pure, printable, safe to commit (no secret values).
        What `apply` runs is exactly this."""
        raise NotImplementedError

    def apply(self, plan: Plan, secrets: dict[str, str]) -> Cluster:
        raise NotImplementedError

    def down(self, name: str) -> str:
        """Stop the cluster; StepFailed when the provider could not."""
        raise NotImplementedError

    def status(self, name: str) -> str | None:
        """What the provider says of the cluster's machines (`rlhf-tasks status NAME`), if it can."""
        return None

    def forward(self, name: str, port: int | None = None) -> int:
        """Forward the head's dashboard to this machine until Ctrl-C (`rlhf-tasks forward NAME`)."""
        raise BadInput(f"forward: the {self.name} provider opens no tunnel of its own; use its port forward "
                       f"(e.g. dstack attach, ssh -L)")

    def abandon(self, name: str, fresh: bool) -> None:
        """Undo what a launch that failed before its job started created here: the staged
        files and, when this launch made it (`fresh`), the cluster's record and token."""
        shutil.rmtree(state.run_dir(name) / self.name, ignore_errors=True)
        if fresh:
            state.forget(name)

    def stage(self, plan: Plan, secrets: dict[str, str]) -> tuple[Path, str | None, dict[str, str]]:
        """For `apply` through a provider CLI: write the rendered files under runs/NAME/PROVIDER,
        make the cluster's token, and the CLI's environment (secrets and token by value)."""
        directory = state.run_dir(plan.name) / self.name
        write_files(directory, self.render(plan))
        token = state.new_token(plan.name) if plan.token_env else None
        env = {**os.environ, **secrets, **({plan.token_env: token} if token else {})}
        return directory, token, env


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
