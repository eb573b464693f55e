"""What every recipe shares: the strict model base, the job fields, the cluster shape
a recipe is built against, and what a recipe hands to the cluster plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..errors import BadInput
from ..models import Duration, Service, StrictModel, parse_duration, require_absolute  # noqa: F401  (recipes use them)


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
    #: "ray": submitted to the Ray cluster once it is up; "every_node": no Ray, every node
    #: runs the entrypoint itself, with {rank}, {nodes}, {head_addr} and {node_addr} filled in.
    mode: str = "ray"
    prepare: list[str] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
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
    timeout: Duration | None = None

    def build(self, shape: Shape) -> RecipeOutput:  # pragma: no cover - abstract
        raise NotImplementedError


def infeasible(message: str, suggestion: str = "") -> BadInput:
    """An allocation that cannot work: the arithmetic, and what to change."""
    text = f"infeasible allocation: {message}"
    if suggestion:
        text += f"\n  suggestion: {suggestion}"
    return BadInput(text)
