"""job.runtime_env: what Ray's runtime environment gives the job besides its working_dir (pip or uv
packages, env_vars, py_modules, excludes): as the task writes it, as the plan carries it to whoever
submits the job (the head's `ray job submit`, on every provider; the launcher's Ray SDK with `submit:
client`), and as Ray's own parsing (ray.runtime_env.RuntimeEnv) judges it at `check` and `launch`
(the task's model is models.RuntimeEnvSpec, which the recipes' job base shares).

Paths are the task file's, as job.working_dir is (a relative one is of the task file's directory):
- a requirements file (`pip: requirements.txt`, `uv: ...`) that is on this machine is read here into
  its packages, as Ray reads one where the job is submitted (ray/_private/runtime_env/validation.py:
  _handle_local_deps_requirement_file), so it reaches the job on every provider; an absolute path that
  is not on this machine is a path on the nodes (an image's: OpenRLHF's `/openrlhf/requirements.txt`),
  left as written for the head's Ray to read when it submits the job;
- a py_module inside job.working_dir travels with it: the plan names it relative to the working_dir,
  which each provider ships its own way, and the submitter joins the two; one elsewhere on this
  machine reaches the job only where Ray uploads it from here (local, `submit: client`); an absolute
  path that is not on this machine is the nodes'; a URI (s3://, gs://, https://...zip) is Ray's to fetch.

`excludes` is Ray's one list for the working_dir and every py_module (ray/_private/runtime_env/
py_modules.py: upload_py_modules_if_needed packs each module with runtime_env["excludes"]): it is
job.excludes continued, after the plan's defaults, the recipe's and job.excludes (gitignore rules: a
later `!pattern` takes back an earlier one), with what the upload's measure leaves out last (workdir.py)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import workdir
from .errors import BadInput
from .models import RuntimeEnvSpec

FIELD = "job.runtime_env"


# ------------------------------------------------------------------ into the plan (render: no Ray here)

def is_uri(value: str) -> bool:
    """Ray's rule (ray/_private/path_utils.py: is_path): a value with a URL scheme is a URI, else a path."""
    return bool(urlparse(value).scheme)


def plan_env(spec: RuntimeEnvSpec | None, base: str, working_dir: str | None) -> dict:
    """The runtime_env the plan carries (without excludes: the plan's job.excludes holds them):
    requirements files on this machine read into their packages, py_modules resolved (`base`: the task
    file's directory; `working_dir`: the job's, absolute, or None). Only the fields given."""
    if spec is None:
        return {}
    out: dict[str, Any] = {}
    for name in ("pip", "uv"):
        value = getattr(spec, name)
        if value is not None:
            out[name] = _requirements(name, value, base)
    if spec.env_vars:
        out["env_vars"] = dict(spec.env_vars)
    if spec.py_modules:
        out["py_modules"] = [_module(index, module, base, working_dir) for index, module in enumerate(spec.py_modules)]
    return out


def _requirements(name: str, value: Any, base: str) -> Any:
    """pip or uv with a requirements file on this machine read into its packages (as Ray reads it)."""
    if isinstance(value, str):
        return _read_requirements(f"{FIELD}.{name}", value, base)
    if name == "pip" and isinstance(value, dict) and isinstance(value.get("packages"), str):
        return {**value, "packages": _read_requirements(f"{FIELD}.pip.packages", value["packages"], base)}
    return value


def _read_requirements(field: str, written: str, base: str) -> list[str] | str:
    path = workdir.resolve(written, base)
    if os.path.isfile(path):
        from .secret_detection import secret_in_text

        lines = Path(path).read_text(errors="replace").strip().split("\n")  # Ray's own split
        for number, line in enumerate(lines, 1):
            why = secret_in_text(line)
            if why:
                raise BadInput(f"{field}: line {number} of {path}: {why}, and a secret's value must not be in the "
                               f"task's files (its packages are written into the rendered files and the plan the "
                               f"nodes read): write $NAME there for a variable listed under `secrets: [NAME]`")
        return lines
    if os.path.isabs(written) and not os.path.lexists(path):
        return written  # the nodes' (an image's): the head's Ray reads it when it submits the job
    what = "is not a file" if os.path.lexists(path) else "does not exist"
    said = f"{written} ({path}, of the task file's directory)" if written != path else path
    raise BadInput(f"{field}: {said} {what}: name a requirements file relative to the task file's directory, an "
                   f"absolute path on the nodes (read on the head when it submits the job), or list the packages")


def _module(index: int, module: str, base: str, working_dir: str | None) -> str:
    if is_uri(module):
        return module
    path = workdir.resolve(module, base)
    if os.path.exists(path):
        if working_dir and (path + os.sep).startswith(working_dir.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, working_dir)  # of the working_dir, wherever a provider puts it
        return path
    if os.path.isabs(module):
        return module  # the nodes' path
    raise BadInput(f"{FIELD}.py_modules[{index}]: {module} ({path}, of the task file's directory) does not exist: "
                   f"name a package directory or a .py or .whl file relative to the task file's directory, an "
                   f"absolute path on the nodes, or a URI Ray fetches (s3://..., gs://..., https://....zip)")


def where(module: str, working_dir: str | None) -> str:
    """Where a plan's py_module is: "uri", "working_dir" (relative to it), "here" (an absolute path on
    this machine) or "nodes" (an absolute path that is not)."""
    if is_uri(module):
        return "uri"
    if not os.path.isabs(module):
        return "working_dir"
    return "here" if os.path.exists(module) else "nodes"


def node_path(value: Any) -> str | None:
    """The requirements file of a plan's pip or uv that the head's Ray reads on the nodes, if any."""
    packages = value.get("packages") if isinstance(value, dict) else value
    return packages if isinstance(packages, str) else None


def check_paths(env: dict, working_dir: str | None, provider: str, submit: str, uploads_here: bool,
                excludes: list[str]) -> list[workdir.Measure]:
    """Refuse the paths of the plan's runtime_env that would not reach the job on `provider` (`uploads_here`:
    Ray packs and uploads from this machine: local, or `submit: client`), and measure the py_modules Ray
    uploads from here as it would pack them (over its upload limit: refused, with what to leave out)."""
    for name in ("pip", "uv"):
        path = node_path(env.get(name))
        if path is not None and uploads_here:
            who = "the job is submitted from this machine (job.submit: client)" if submit == "client" else \
                f"the {provider} head is this machine"
            raise BadInput(f"{FIELD}.{name}: {path} is not a file on this machine, and {who}, where Ray reads it: "
                           f"name a requirements file that is here, relative to the task file's directory, or list "
                           f"the packages")
    measured = []
    for index, module in enumerate(env.get("py_modules") or []):
        field = f"{FIELD}.py_modules[{index}]"
        kind = where(module, working_dir)
        if kind == "working_dir" and not working_dir:
            raise BadInput(f"{field}: {module} is in job.working_dir, which does not reach the job on {provider} "
                           f"with job.submit: {submit} (`check --provider {provider}` says how a working_dir reaches "
                           f"the job there): give a URI Ray fetches (s3://..., gs://..., https://....zip) "
                           f"or an absolute path in the image, or set job.submit: client (launch then uploads it "
                           f"from this machine)")
        if kind == "here" and not uploads_here:
            raise BadInput(f"{field}: {module} is on this machine, outside job.working_dir "
                           f"({working_dir or 'none'}), which is all {provider} ships to the nodes, so the head's "
                           f"Ray would not find it: move it into job.working_dir, give a URI Ray fetches (s3://..., "
                           f"gs://..., https://....zip), or set job.submit: client (launch then uploads it from here)")
        if kind == "nodes" and uploads_here:
            raise BadInput(f"{field}: {module} does not exist on this machine, where Ray packs it "
                           f"({'job.submit: client' if submit == 'client' else f'the {provider} head is here'})")
        if uploads_here and kind in ("here", "working_dir"):
            measured.append(_measure(field, os.path.join(working_dir or "", module), excludes))
    return measured


def _measure(field: str, path: str, excludes: list[str]) -> workdir.Measure:
    """A py_module as Ray packs it: a directory with the excludes (workdir.check), a file whole."""
    if os.path.isdir(path):
        return workdir.check(path, excludes, field=field)
    size, limit = os.path.getsize(path), workdir.upload_limit()
    if size >= limit:
        raise BadInput(f"{field}: {path} is {workdir.human(size)}, over Ray's upload limit of "
                       f"{workdir.human(limit)}: give it as a URI Ray fetches (s3://..., https://...)")
    return workdir.Measure(path, size, [(os.path.basename(path), size)])


# ------------------------------------------------------------------ Ray's own parsing (check, launch)

def for_ray_here(env: dict, working_dir: str | None, excludes: list[str]) -> dict:
    """The plan's runtime_env as Ray's parsing can judge it on this machine: py_modules of the
    working_dir joined to it; what only the nodes have (a requirements file, a module) left out of
    what is read, since the head's Ray reads it there."""
    out = dict(env)
    for name in ("pip", "uv"):
        if node_path(out.get(name)) is not None:
            out[name] = {**out[name], "packages": []} if isinstance(out[name], dict) else []
    if "py_modules" in out:
        out["py_modules"] = [module if where(module, working_dir) != "working_dir" else
                             os.path.join(working_dir or "", module)
                             for module in out["py_modules"] if where(module, working_dir) != "nodes"]
    if working_dir or out.get("py_modules"):
        out["excludes"] = list(excludes)
    return out


def ask_ray(env: dict, working_dir: str | None, excludes: list[str]) -> list[str]:
    """Ray's own parsing of job.runtime_env (ray.runtime_env.RuntimeEnv: ray/_private/runtime_env/
    validation.py's parse_and_validate_* per field, and its rule that pip, uv and conda exclude one
    another): BadInput naming the field, with Ray's words, when it refuses; else the line `check` says.
    Nothing to ask where the task gives none; Ray is imported here only then (render never asks)."""
    if not env:
        return []
    if importlib.util.find_spec("ray") is None:
        return [f"{FIELD}: not parsed here (Ray is not installed on this machine): the head's `ray job submit` "
                f"parses it when it submits the job"]
    import ray
    from ray.runtime_env import RuntimeEnv

    judged = for_ray_here(env, working_dir, excludes)
    for name, value in judged.items():
        try:
            RuntimeEnv(**{name: value})
        except (ValueError, TypeError) as exc:
            raise BadInput(f"{FIELD}.{name}: Ray {ray.__version__} refuses it: {exc}") from None
    try:
        RuntimeEnv(**judged)
    except (ValueError, TypeError) as exc:
        fields = ", ".join(f"{FIELD}.{name}" for name in judged if name != "excludes")
        raise BadInput(f"{fields}: Ray {ray.__version__} refuses them together: {exc}") from None
    nodes = [node_path(env.get(name)) for name in ("pip", "uv") if node_path(env.get(name))] + \
        [module for module in env.get("py_modules") or [] if where(module, working_dir) == "nodes"]
    on_nodes = f"; read on the head when it submits: {', '.join(nodes)}" if nodes else ""
    return [f"{FIELD} ({', '.join(name for name in env)}): Ray {ray.__version__}'s runtime-env parsing "
            f"(ray.runtime_env.RuntimeEnv) takes it{on_nodes}"]
