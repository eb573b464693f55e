"""command: any entrypoint, for frameworks rlhf-tasks does not know yet."""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import Field, field_validator

from .base import JobBase, RecipeOutput, Shape, StrictModel


class CommandArgs(StrictModel):
    entrypoint: str | list[str] = Field(description="the job's command: a string (split like a shell) or a list")

    @field_validator("entrypoint")
    @classmethod
    def _not_empty(cls, value):
        argv = shlex.split(value) if isinstance(value, str) else value
        if not argv:
            raise ValueError("entrypoint is empty")
        return value


class CommandJob(JobBase):
    """Run your own entrypoint on the cluster; nothing is checked beyond the spec."""

    recipe_summary = "any entrypoint (for frameworks without a recipe)"
    recipe_needs = "whatever your command needs, installed by setup or the image"

    recipe: Literal["command"]
    args: CommandArgs

    def build(self, shape: Shape) -> RecipeOutput:
        argv = self.args.entrypoint
        # An arbitrary command may not use torch: preflight checks torch only when asked (preflight.torch).
        return RecipeOutput(entrypoint=shlex.split(argv) if isinstance(argv, str) else list(argv), uses_torch=False)
