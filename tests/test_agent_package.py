"""The node agent's package (rlhf_tasks/agent/): standard library only and Python 3.8
syntax in every module, each module says what it owns and stays under 800 lines, and
code outside the package imports nothing of it but its protocol."""

from __future__ import annotations

import ast
import sys

import pytest

from conftest import ROOT

AGENT = ROOT / "rlhf_tasks" / "agent"
MODULES = sorted(p for p in AGENT.rglob("*.py") if "__pycache__" not in p.parts)  # agent/**/*.py


def dotted(path) -> str:
    """A module's dotted name: rlhf_tasks/agent/protocol/__init__.py -> rlhf_tasks.agent.protocol."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(AGENT).as_posix())
def test_each_agent_module_is_standard_library_only_and_python_38(path):
    tree = ast.parse(path.read_text(), feature_version=(3, 8))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    package = dotted(path.parent).split(".")  # a relative import's `.`
    relative = {".".join(package[:len(package) - n.level + 1] + ([n.module] if n.module else []))
                for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    allowed = set(sys.stdlib_module_names) | ({"ray", "torch"} if path.name in ("preflight.py", "probe.py") else set())
    assert imported <= allowed, imported - allowed
    assert relative <= {dotted(p) for p in MODULES}, relative  # modules of its own package
    assert ast.get_docstring(tree), f"{path.name} starts with no docstring"
    assert len(path.read_text().splitlines()) < 800


def test_ray_and_torch_are_imported_only_inside_functions():
    """The agent runs before Ray exists: at import time, the standard library only."""
    for path in MODULES:
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name.split(".")[0] for n in top for a in n.names if isinstance(n, ast.Import)}
        names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert not names & {"ray", "torch"}, path.name


def test_the_launcher_imports_only_the_agents_protocol():
    """What the launcher and the agent both speak is one package, agent/protocol/ (with its
    bundle: the same gathering and wording of a failure's logs for the head, the launcher's
    summary and `logs --bundle`); local.py may also use the agent's process groups (it runs
    agents on this machine and stops them the same way)."""
    offenders = []
    for path in sorted((ROOT / "rlhf_tasks").rglob("*.py")):
        if AGENT in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-node.level or None]) if node.level \
                    else ""
                names = [f"{package}.{node.module}" if node.level else node.module]
                names += [f"{names[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("rlhf_tasks.agent") and not (name == "rlhf_tasks.agent.protocol" or
                                                                name.startswith("rlhf_tasks.agent.protocol.")) \
                        and name != "rlhf_tasks.agent" and not (path.name == "local.py" and
                                                              name.startswith("rlhf_tasks.agent.processes")):
                    offenders.append((str(path.relative_to(ROOT)), name))
    assert offenders == []
