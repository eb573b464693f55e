"""What every recipe shares: the strict model base, the job fields, the cluster shape
a recipe is built against, and what a recipe hands to the cluster plan."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from ..errors import BadInput


class StrictModel(BaseModel):
    """Unknown fields are errors: a typo must never be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(value: str | int | float) -> float:
    """'90s', '15m', '2h' or a number of seconds -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(f"{value!r} is not a duration (use e.g. 90s, 15m, 2h)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


def require_absolute(value: str | None, why: str = "every node reads it") -> str | None:
    """Paths that travel to the nodes must be absolute (relative ones resolve inside Ray's working_dir copy)."""
    if value is not None and not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path: {why}")
    return value


@dataclass(frozen=True)
class Shape:
    """The cluster a recipe is built for: the numbers every role flag must agree with."""

    nodes: int
    gpus_per_node: int
    checkpoint_dir: str | None
    resume: bool
    gpu_name: str | None = None


@dataclass
class RecipeOutput:
    """A recipe's contribution to the plan. `entrypoint` is an argument list; the
    literal `{head_addr}` in an argument is replaced by the head's private address at
    submission. `wandb_args` are appended only when WANDB_API_KEY is provided."""

    entrypoint: list[str]
    prepare: list[str] = field(default_factory=list)
    services: list[dict] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    excludes: list[str] = field(default_factory=list)
    wandb_args: list[str] = field(default_factory=list)
    summary: dict | None = None


class JobBase(StrictModel):
    """Fields every `job:` section has, whatever the recipe."""

    recipe_summary: ClassVar[str] = ""
    recipe_needs: ClassVar[str] = ""

    submit: Literal["head", "client"] = "head"
    working_dir: str | None = "."
    excludes: list[str] = []
    timeout: str | None = None

    @field_validator("timeout")
    @classmethod
    def _timeout_is_duration(cls, value):
        if value is not None:
            parse_duration(value)
        return value

    def build(self, shape: Shape) -> RecipeOutput:  # pragma: no cover - abstract
        raise NotImplementedError


def infeasible(message: str, suggestion: str = "") -> BadInput:
    """An allocation that cannot work: the arithmetic, and what to change."""
    text = f"infeasible allocation: {message}"
    if suggestion:
        text += f"\n  suggestion: {suggestion}"
    return BadInput(text)
