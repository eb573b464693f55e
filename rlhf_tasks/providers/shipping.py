"""What every remote provider ships to its nodes: the plan under one directory on the node,
the node agent's package (rlhf_tasks/agent/, as plain files) and the packages of
rlhf_tasks the recipe's commands import (the demo's code) in lib/ below it, and the
command line that starts the agent there (by its entry file's path, lib/ first on PYTHONPATH);
and the heredoc that carries a file inside a rendered shell script."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import yaml
from pydantic import BaseModel

from ..agent.protocol import AGENT_ENTRY
from ..plan import Plan
from ..spec import provider_part

#: Beside the rendered file on the user's machine, and on every node.
LOCAL_DIR = "rlhf-tasks"
NODE_DIR = "/opt/rlhf-tasks"
#: Where shipped packages go (on PYTHONPATH of the agent and everything it starts).
LIB = "lib"
#: The node agent's package, shipped verbatim below lib/ (after a comment line that says rlhf-tasks wrote
#: the copy): rlhf-tasks itself is not installed on the nodes.
AGENT = "rlhf_tasks.agent"
#: The agent's entry file on a node, run by its path: `python3 -m` would put the working directory
#: first on sys.path (dstack runs the commands in the repo's directory, which may hold an rlhf_tasks).
NODE_ENTRY = f"{NODE_DIR}/{LIB}/{AGENT_ENTRY}"


#: Near the top of every file rlhf-tasks renders (a comment; a JSON document's `note`): `render -o`
#: writes over no file that does not say it (the user's) without --force.
WRITTEN_BY = "Rendered by rlhf-tasks"
#: The keys of a plan (JSON holds no comment: its own shape says who wrote it).
PLAN_KEYS = {"version", "name", "provider", "contract", "job"}


def written_by_us(text: str) -> bool:
    """Whether a file's text is one rlhf-tasks rendered: WRITTEN_BY in its first lines, or a plan."""
    if WRITTEN_BY in "\n".join(text.splitlines()[:5]):
        return True
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and PLAN_KEYS <= set(data)


def plan_file(plan: Plan) -> str:
    """The plan's file name, beside the rendered file (under rlhf-tasks/) and on the nodes: it names
    the provider, so that renders for two providers into one folder keep each its own plan."""
    return f"{plan.name}.{plan.provider}.plan.json"


def module_files(modules: list[str]) -> dict[str, str]:
    """Path below lib/ -> source, for each package (with the __init__ of its parents), so
    `import rlhf_tasks.demo.train` works on a node that has lib/ on its path and nothing else."""
    files: dict[str, str] = {}
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ValueError(f"cannot ship {module}: not found")
        top = Path(importlib.util.find_spec(module.split(".")[0]).origin).parent  # e.g. .../rlhf_tasks
        root = top.parent
        parents = module.split(".")[:-1]
        sources = [top.joinpath(*parents[1:i + 1], "__init__.py") for i in range(len(parents))]
        if spec.submodule_search_locations:  # a package: every module in it
            package = Path(spec.origin).parent
            sources += sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
        else:
            sources.append(Path(spec.origin))
        for source in sources:
            files[source.relative_to(root).as_posix()] = source.read_text()
    return files


def shipped_files(plan: Plan) -> dict[str, str]:
    """Local path (relative to the rendered file) -> content."""
    files = {f"{LOCAL_DIR}/{plan_file(plan)}": plan.to_json()}
    files.update({f"{LOCAL_DIR}/{LIB}/{path}": f"# {WRITTEN_BY}: a copy of {path} for the nodes\n{text}"
                  for path, text in module_files([AGENT, *plan.modules]).items()})
    return files


def node_path(local: str) -> str:
    """Where a shipped file lands on the node: `rlhf-tasks/lib/x/y.py` -> `/opt/rlhf-tasks/lib/x/y.py`."""
    prefix = f"{LOCAL_DIR}/"
    return f"{NODE_DIR}/{local[len(prefix):] if local.startswith(prefix) else Path(local).name}"


def agent_command(plan: Plan) -> str:
    """The agent's command line: lib/ goes first on PYTHONPATH (the image's is kept after
    it), so that the agent's package imports; the agent, Ray and the job inherit it."""
    command = shlex.join(["python3", NODE_ENTRY, "--plan", f"{NODE_DIR}/{plan_file(plan)}",
                          "--skip-setup", "--log-dir", f"{NODE_DIR}/logs"])
    return f"PYTHONPATH={NODE_DIR}/{LIB}${{PYTHONPATH:+:$PYTHONPATH}} {command}"


def shared_entry(model: type[BaseModel], entry: dict | None, provider: str):
    """A provider's `checkpoints.shared` entry read with that provider's model (None when the
    task has none); BadInput naming the field, e.g. `checkpoints.shared.sky.bucket`."""
    return None if entry is None else provider_part(model, entry, f"checkpoints.shared.{provider}")


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """Multi-line strings (shell scripts) as literal blocks, so rendered files read well. libyaml's emitter where
    PyYAML has it: the same text, in a tenth of the pure-Python emitter's time (a KubeRay render's ConfigMap)."""


_Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def dump_yaml(data: dict, header: str = "") -> str:
    """YAML built as data and dumped: never templated."""
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def heredoc(target: str, text: str, delimiter: str = "RLHF_TASKS_EOF") -> list[str]:
    """`cat > TARGET` with a quoted heredoc, as lines: the text is written byte for byte
    (a final newline added where it has none), nothing expanded. TARGET is a shell word,
    quoted by the caller; the delimiter grows by `_` until no line of the text is it."""
    while delimiter in text.splitlines():
        delimiter += "_"
    body = text if text.endswith("\n") else text + "\n"
    return [f"cat > {target} <<'{delimiter}'", *body[:-1].split("\n"), delimiter]
