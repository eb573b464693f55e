"""Recipes: one framework each. Pure functions from the task's `job` section and the
cluster shape to an entrypoint, after checking that the allocation fits."""

from __future__ import annotations

from .base import JobBase, RecipeOutput, Shape
from .command import CommandJob
from .openrlhf import OpenRLHFPPOJob
from .openrlhf_m import OpenRLHFMGrpoJob
from .search_r1 import SearchR1Job
from .tiny_grpo import TinyGrpoJob
from .torchrun import TorchrunJob
from .verl import VerlPPOJob

#: Every recipe's job model; the task spec's `job` is a union discriminated by `recipe`.
JOB_MODELS: tuple[type[JobBase], ...] = (TinyGrpoJob, CommandJob, OpenRLHFPPOJob, OpenRLHFMGrpoJob, VerlPPOJob, SearchR1Job,
                                         TorchrunJob)


def recipe_name(model: type[JobBase]) -> str:
    return model.model_fields["recipe"].annotation.__args__[0]


def catalogue() -> list[dict]:
    """Name, summary, needs and argument docs of every recipe (for `rlhf-tasks recipes`)."""
    rows = []
    for model in JOB_MODELS:
        args_model = model.model_fields["args"].annotation
        args = {
            name: {"required": f.is_required(), "default": None if f.is_required() else f.default,
                   "description": f.description or ""}
            for name, f in args_model.model_fields.items()
        }
        rows.append({"name": recipe_name(model), "summary": model.recipe_summary,
                     "needs": model.recipe_needs, "args": args})
    return rows


__all__ = ["JOB_MODELS", "JobBase", "RecipeOutput", "Shape", "catalogue", "recipe_name"]
