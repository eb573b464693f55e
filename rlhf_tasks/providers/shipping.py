"""What every remote provider ships to its nodes: the node agent and the plan, under
one directory on the node, and the command line that starts the agent there."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from ..plan import Plan

#: Beside the rendered file on the user's machine, and on every node.
LOCAL_DIR = "rlhf-tasks"
NODE_DIR = "/opt/rlhf-tasks"


def agent_source(name: str = "node.py") -> str:
    """The node agent (node.py) or its preflight (preflight.py, run beside it as a Ray job),
    shipped verbatim: rlhf-tasks itself is not installed on the nodes."""
    return (Path(__file__).resolve().parent.parent / name).read_text()


def shipped_files(plan: Plan) -> dict[str, str]:
    """Local path (relative to the rendered file) -> content."""
    return {f"{LOCAL_DIR}/{plan.name}.plan.json": plan.to_json(), f"{LOCAL_DIR}/node.py": agent_source(),
            f"{LOCAL_DIR}/preflight.py": agent_source("preflight.py")}


def node_path(local: str) -> str:
    return f"{NODE_DIR}/{Path(local).name}"


def agent_command(plan: Plan) -> str:
    return shlex.join(["python3", f"{NODE_DIR}/node.py", "--plan", node_path(f"{plan.name}.plan.json"),
                       "--skip-setup", "--log-dir", f"{NODE_DIR}/logs"])


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (shell scripts) as literal blocks, so rendered files read well."""


_Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def dump_yaml(data: dict, header: str = "") -> str:
    """YAML built as data and dumped: never templated."""
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
