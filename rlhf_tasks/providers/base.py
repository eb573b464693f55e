"""The provider contract: pure `plan`/`render`, effectful `apply`/`down`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import state
from ..plan import build_plan
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
    extra: dict = field(default_factory=dict)


class Provider:
    name = "?"
    #: Ray settings this provider must move (e.g. away from SkyPilot's own ports)
    ray_overrides: dict = {}

    def default_checkpoint_dir(self, task: Task) -> str:
        """Where checkpoints go when the task names no path."""
        return f"/checkpoints/{task.name}"

    def plan(self, task: Task) -> dict:
        """The plan this provider's nodes run (pure)."""
        return build_plan(task, self.name, self.default_checkpoint_dir(task), self.ray_overrides)

    def stage(self, plan: dict, secrets: dict[str, str]) -> tuple[Path, str | None, dict[str, str]]:
        """For `apply` through a provider CLI: write the rendered files under runs/NAME/PROVIDER,
        make the cluster's token, and the CLI's environment (secrets and token by value)."""
        directory = Path.cwd() / "runs" / plan["name"] / self.name
        write_files(directory, self.render(plan))
        token = state.new_token(plan["name"]) if plan["token_env"] else None
        env = {**os.environ, **secrets, **({plan["token_env"]: token} if token else {})}
        return directory, token, env

    def render(self, plan: dict) -> dict[str, str]:
        """File name -> content; pure, printable, safe to commit (no secret values)."""
        raise NotImplementedError

    def apply(self, task: Task, plan: dict, secrets: dict[str, str]) -> Cluster:
        raise NotImplementedError

    def down(self, name: str) -> str:
        raise NotImplementedError


def require_cli(executable: str, extra: str) -> str:
    """The provider's CLI on PATH, or a bad-input error that says how to install it."""
    import shutil

    from ..errors import BadInput

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
