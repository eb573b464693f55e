"""Imports run one way: the import graph of rlhf_tasks, read from the source with `ast`
(module-level and function-level imports alike, relative imports resolved), has no
cycle, and the node agent (rlhf_tasks/agent/) stays a separate house: the launcher
imports only its protocol package (rlhf_tasks/agent/protocol/: what both speak, and the
failure bundle both make) and providers/local.py its process handling, and the agent
imports nothing of the launcher.

    python tests/test_imports.py    # prints the graph and each module's line count

Dynamic imports (`importlib.import_module` of a registered provider) are not edges:
a provider is found by name at run time, never imported by what it imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "rlhf_tasks"
AGENT = "rlhf_tasks.agent"
#: What code outside the agent may import of it (importer None: any importer), each with its
#: submodules (rlhf_tasks.agent.protocol.bundle).
AGENT_FACES = {(None, "rlhf_tasks.agent.protocol"), ("rlhf_tasks.providers.local", "rlhf_tasks.agent.processes")}


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _known(name: str, known: dict) -> str | None:
    """The longest prefix of `name` that is a module of the package (`a.b.c` of `a.b.c.X`)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def _enclosing(tree: ast.AST) -> dict[ast.AST, bool]:
    """Import node -> whether it sits inside a function (a late import)."""
    late = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            late[node] = in_function
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return late


def graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, bool]]:
    """Module -> {imported module of the package -> True when every such import is late}."""
    known = modules(root, package)
    edges: dict[str, dict[str, bool]] = {name: {} for name in known}
    for name, path in known.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, late in _enclosing(ast.parse(path.read_text(), str(path))).items():
            targets = []
            if isinstance(node, ast.Import):
                targets = [_known(alias.name, known) for alias in node.names]
            else:
                if node.level:
                    base_parts = own_package.split(".")
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                    target = f"{base}.{alias.name}"
                    targets.append(target if target in known else _known(base, known))
            for target in targets:
                if target and target != name:
                    edges[name][target] = edges[name].get(target, True) and late
    return edges


def cycles(edges: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one
    concrete cycle through its first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, {}):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return [_cycle_through(component, edges) for component in sorted(components)]


def _cycle_through(component: list[str], edges: dict[str, dict[str, bool]]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(edges[node]):
            if target == start:
                return paths[node] + [start]
            if target in members and target not in paths:
                paths[target] = paths[node] + [target]
                queue.append(target)
    return component


def _in_agent(name: str) -> bool:
    return name == AGENT or name.startswith(AGENT + ".")


def _a_face(source: str, target: str) -> bool:
    """Whether code outside the agent (`source`) may import `target` of it."""
    return any(importer in (None, source) and (target == face or target.startswith(face + "."))
               for importer, face in AGENT_FACES)


def agent_breaches(edges: dict[str, dict[str, bool]]) -> list[str]:
    """Imports across the agent's wall that the rules do not allow."""
    breaches = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if _in_agent(source) and not _in_agent(target):
                breaches.append(f"{source} (the agent) imports {target} (the launcher)")
            elif not _in_agent(source) and _in_agent(target) and not _a_face(source, target):
                breaches.append(f"{source} imports {target}: outside the agent, import only "
                                f"{AGENT}.protocol and its submodules (and {AGENT}.processes from providers/local.py)")
    return breaches


def _short(name: str, package: str = PACKAGE) -> str:
    return name[len(package) + 1:] if name.startswith(package + ".") else name


def report(root: Path = ROOT, package: str = PACKAGE) -> str:
    edges, files = graph(root, package), modules(root, package)
    lines = [f"# {package}: module (lines) -> the modules of {package} it imports (prefix dropped; "
             f"* = only inside functions)"]
    total = 0
    for name in sorted(edges):
        count = len(files[name].read_text().splitlines())
        total += count
        targets = ", ".join(_short(t, package) + ("*" if late else "") for t, late in sorted(edges[name].items()))
        lines.append(f"{_short(name, package)} ({count}) -> {targets or '-'}")
    lines.append(f"# {len(edges)} modules, {total} lines")
    found = cycles(edges)
    lines += [f"# cycle: {' -> '.join(_short(m, package) for m in cycle)}" for cycle in found] or ["# no cycle"]
    lines += [f"# breach: {breach}" for breach in agent_breaches(edges)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- tests


def test_the_graph_builder_sees_late_relative_and_absolute_imports(tmp_path):
    """The builder itself: a cycle hidden in a function, `from . import mod`, `from ..x import y`
    and `import pkg.mod` all become edges; an agent breach is named."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from .sub.c import thing\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import pkg.a\nfrom .. import errors_not_a_module\n",
        "pkg/d.py": "from .sub import c\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = graph(tmp_path, "pkg")
    assert edges["pkg.a"] == {"pkg.b": False}
    assert edges["pkg.b"] == {"pkg.sub.c": True}
    assert edges["pkg.sub.c"] == {"pkg.a": False, "pkg": False}
    assert edges["pkg.d"] == {"pkg.sub.c": False}
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    printed = report(tmp_path, "pkg").splitlines()
    assert "b (2) -> sub.c*" in printed and "sub.c (2) -> pkg, a" in printed
    assert "# cycle: a -> b -> sub.c -> a" in printed


def test_the_agent_rules_bite():
    edges = {"rlhf_tasks.launch": {"rlhf_tasks.agent.protocol": False, "rlhf_tasks.agent.protocol.bundle": False,
                                   "rlhf_tasks.agent.head": True, "rlhf_tasks.agent.forensics": False},
             "rlhf_tasks.cli": {"rlhf_tasks.agent.protocolx": True},
             "rlhf_tasks.providers.local": {"rlhf_tasks.agent.processes": False},
             "rlhf_tasks.providers.sky": {"rlhf_tasks.agent.processes": False},
             "rlhf_tasks.agent.protocol": {"rlhf_tasks.errors": True},
             "rlhf_tasks.agent.head": {"rlhf_tasks.agent.protocol": False}}
    breaches = agent_breaches(edges)
    assert len(breaches) == 5, breaches
    assert any(b.startswith("rlhf_tasks.launch imports rlhf_tasks.agent.head") for b in breaches)
    assert any(b.startswith("rlhf_tasks.launch imports rlhf_tasks.agent.forensics") for b in breaches)
    assert any(b.startswith("rlhf_tasks.cli imports rlhf_tasks.agent.protocolx") for b in breaches)
    assert any(b.startswith("rlhf_tasks.providers.sky imports rlhf_tasks.agent.processes") for b in breaches)
    assert "rlhf_tasks.agent.protocol (the agent) imports rlhf_tasks.errors (the launcher)" in breaches


def test_rlhf_tasks_has_no_import_cycle():
    edges = graph()
    assert {"rlhf_tasks.cli", "rlhf_tasks.spec", "rlhf_tasks.providers.base"} <= set(edges)  # it read the package
    assert "rlhf_tasks.errors" in edges["rlhf_tasks.cli"]
    found = cycles(edges)
    assert not found, "import cycles (function-level imports count):\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_agent_and_the_launcher_meet_only_at_the_protocol():
    breaches = agent_breaches(graph())
    assert not breaches, "\n".join(breaches)


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    print(report(root))
