"""pydantic's validation errors in the task file's terms: each error's field path as the task writes it
(`services[0].ready.http`, union tags dropped) and a message that says what to write there (the field or
argument meant, a quoted string for a number, a mapping's fields), for spec.parse_task and spec.provider_part."""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

from .models import NAME_PATTERN, did_you_mean
from .recipes import JOB_MODELS

_RECIPES = {m.model_fields["recipe"].annotation.__args__[0] for m in JOB_MODELS}
#: The fields of `job:`, which a task written one indentation short has at the top.
_JOB_FIELDS = {name for m in JOB_MODELS for name in m.model_fields}


def _field_path(loc: tuple) -> str:
    """('services', 0, 'ready', 'http') -> 'services[0].ready.http' (union tags dropped)."""
    path = ""
    for index, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif (part in {"http", "tcp"} and loc[index - 1] == "ready") or (part in _RECIPES and loc[index - 1] == "job"):
            continue  # union tags are not field names
        else:
            path += f".{part}" if path else str(part)
    return path


def _unwrap(tp: Any) -> list:
    """The types a value of `tp` may be: Optional, unions and Annotated taken apart."""
    if get_origin(tp) is Annotated:
        return _unwrap(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        return [t for arg in get_args(tp) for t in _unwrap(arg) if t is not type(None)]
    return [tp]


def _is_member(model: type[BaseModel], tag: Any) -> bool:
    """Whether a union tag in an error location (a recipe's name; `http` or `tcp` for
    readiness checks) picks this member of the union."""
    recipe = model.model_fields.get("recipe")
    return tag in get_args(recipe.annotation) if recipe else tag in model.model_fields


def _model_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The model whose fields live at `loc` below `root`, walking fields, union tags, lists and mappings."""
    candidates: list = [root]
    for part in loc:
        models = [t for t in candidates if isinstance(t, type) and issubclass(t, BaseModel)]
        if len(models) > 1:  # a union: the next part is the tag that picks the member
            candidates = [m for m in models if _is_member(m, part)][:1]
        elif models and isinstance(part, str):
            field = next((f for name, f in models[0].model_fields.items() if part in (name, f.alias)), None)
            candidates = _unwrap(field.annotation) if field else []
        else:  # list[X] (an index) or dict[str, X] (a key): X
            containers = [t for t in candidates if get_origin(t) in (list, dict)]
            candidates = _unwrap(get_args(containers[0])[-1]) if containers else []
    models = [t for t in candidates if isinstance(t, type) and issubclass(t, BaseModel)]
    return models[0] if len(models) == 1 else None


def _yaml_scalar(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def error_message(err: dict, root: type[BaseModel]) -> tuple[str, str]:
    """(field path, message) for one pydantic error of `root`, in the task file's terms."""
    loc, kind, msg = err["loc"], err["type"], err["msg"].removeprefix("Value error, ")
    path = _field_path(loc)
    if kind == "task_entry":
        return err["ctx"]["field"], msg
    if kind == "union_tag_invalid" and loc[-1:] == ("job",):
        tag = err["ctx"]["tag"]
        return "job.recipe", f"unknown recipe {tag!r} {did_you_mean(tag, sorted(_RECIPES))}"
    if kind == "union_tag_not_found" and loc[-1:] == ("job",):
        return "job.recipe", f"missing {did_you_mean('', sorted(_RECIPES))}"
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1], root)
        if "job" in root.model_fields and len(loc) == 1 and loc[0] in _JOB_FIELDS:  # the task itself
            return path, f"unknown field here; it belongs under job: (job.{loc[0]}): indent it below `job:`"
        if model is not None:
            names = [f.alias or name for name, f in model.model_fields.items()]
            if len(loc) >= 3 and loc[-2] == "args" and loc[-3] in _RECIPES:
                return path, f"unknown argument of the {loc[-3]} recipe {did_you_mean(loc[-1], names, 'its arguments')}"
            return path, f"unknown field {did_you_mean(loc[-1], names, 'fields here')}"
    if kind == "string_type" and isinstance(err.get("input"), (bool, int, float)):
        value = err["input"]
        what = "a boolean" if isinstance(value, bool) else "a number"
        return path, f"{_yaml_scalar(value)} is {what}; write it as \"{_yaml_scalar(value)}\""
    if kind == "string_type" and err.get("input") is None:
        return path, 'no value; write one in quotes (e.g. "")'
    none = "no value; " if err.get("input", ...) is None else ""
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        if len(loc) >= 2 and loc[-1] == "args" and loc[-2] in _RECIPES:
            return path, f"{none}expected a mapping of {loc[-2]}'s arguments (rlhf-tasks recipes lists them)"
        if loc == ("job",):
            return path, f"{none}expected a mapping: recipe: NAME and its args: (rlhf-tasks recipes lists them)"
        model = _model_at(loc, root)
        fields = f" ({', '.join(f.alias or n for n, f in model.model_fields.items())})" if model else ""
        return path, f"{none}expected a mapping of fields{fields}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return path, f"{none}expected a whole number"
    if kind in ("bool_type", "bool_parsing"):
        return path, f"{none}expected true or false"
    if kind == "list_type":
        return path, f"{none}expected a list"
    if kind == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == NAME_PATTERN:
        return path, (f"{err.get('input')!r}: use lowercase letters, digits and dashes (at most 40, beginning and "
                      f"ending with a letter or digit), e.g. tiny-grpo")
    return path, msg
