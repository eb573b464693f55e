"""A framework's own code, read where it is installed on this machine without importing it (its
package's `__init__` imports torch, ray and vllm, and needs GPUs): `check` asks it of the rendered
command. verl's Hydra config is composed with hydra-core; OpenRLHF's argument parser is the
`__main__` block of its `cli/train_ppo_ray.py`, run on the command with `train()` cut down to its
assertions on `args`. The tests feed the same functions from the released wheels.

Each asker returns what it checked, in a line `check` prints, or raises BadInput naming the
task's field with the framework's own words; where the framework is not installed here, the line
says what was not checked."""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import datetime
import importlib.util
import io
import math
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable


class Refused(Exception):
    """The framework refused the command (argparse's error, a failed assertion, Hydra's composition);
    `options`: the flags its parser knows, where a parser refused."""

    def __init__(self, words: str, options: list[str] | None = None):
        super().__init__(words)
        self.options = options or []


def package(name: str) -> tuple[Path | None, str | None]:
    """(the installed package's directory, its version) without importing it; (None, None) if absent."""
    spec = importlib.util.find_spec(name)  # a top-level name: finds, runs nothing of it
    if spec is None or not spec.submodule_search_locations:
        return None, None
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        version = None
    return Path(list(spec.submodule_search_locations)[0]), version


# --- verl: Hydra ---------------------------------------------------------------------------


def hydra_compose(config_dir: Path, config_name: str, overrides: list[str]):
    """Compose as the trainer's @hydra.main does (struct mode: an unknown key raises); Refused with
    Hydra's words."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            return compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise Refused(str(exc).strip()) from None


# --- OpenRLHF: argparse ----------------------------------------------------------------------

_BUILTINS = set(dir(builtins))


def _only_args(node: ast.AST) -> bool:
    """True when an expression reads nothing but `args` (and builtins)."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return names <= {"args"} | _BUILTINS


def _assertions(body: list[ast.stmt]) -> list[ast.stmt]:
    """train()'s checks that need no GPU: asserts on args, the ifs around them, _validate_* calls."""
    kept: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.Assert) and _only_args(stmt):
            kept.append(stmt)
        elif isinstance(stmt, ast.If) and _only_args(stmt.test):
            inner, orelse = _assertions(stmt.body), _assertions(stmt.orelse)
            if inner or orelse:
                kept.append(ast.If(test=stmt.test, body=inner or [ast.Pass()], orelse=orelse))
        elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
              and stmt.value.func.id.startswith("_validate")):
            kept.append(stmt)
    return kept


def _imported(read: Callable[[str], str], node: ast.ImportFrom) -> dict:
    """`from openrlhf.x import y` inside __main__, run from the release's own file."""
    namespace: dict = {"__name__": node.module}
    exec(compile(read(node.module.replace(".", "/") + ".py"), node.module, "exec"), namespace)
    return {alias.asname or alias.name: namespace[alias.name] for alias in node.names}


def openrlhf_main(read: Callable[[str], str], version: str) -> tuple:
    """train_ppo_ray's __main__ block of a release, compiled with train() cut down to its assertions.
    `read(path)` gives a file of the release by its path inside the package tree (`openrlhf/...`)."""
    tree = ast.parse(read("openrlhf/cli/train_ppo_ray.py"))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    train = functions["train"]
    train.body = _assertions(train.body) + [ast.parse("_parsed.append(args)").body[0]]
    namespace = {"argparse": argparse, "os": os, "math": math, "datetime": datetime.datetime, "_parsed": []}
    body = [train] + [f for name, f in functions.items() if name.startswith("_validate")]
    for stmt in main.body:
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("openrlhf"):
            namespace.update(_imported(read, stmt))
        else:
            body.append(stmt)
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    return compile(module, f"openrlhf-{version}/train_ppo_ray.py", "exec"), namespace


def openrlhf_parse(main: tuple, argv: list[str]):
    """Parse argv as train_ppo_ray would and run its GPU-free checks; Refused with its words."""
    code, namespace = main
    namespace = dict(namespace, _parsed=[], __name__="__main__")
    saved, sys.argv = sys.argv, ["train_ppo_ray.py", *argv]
    stderr, stdout = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            exec(code, namespace)
    except SystemExit as exc:
        parser = namespace.get("parser")
        options = list(getattr(parser, "_option_string_actions", {}))
        raise Refused(stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue() else f"exit {exc.code}",
                      options) from None
    except AssertionError as exc:
        raise Refused(f"assertion failed: {exc}") from None
    finally:
        sys.argv = saved
    return namespace["_parsed"][0]


def installed_reader(root: Path) -> Callable[[str], str]:
    """read(path) of an installed package: `openrlhf/cli/x.py` under the directory holding `openrlhf/`."""
    return lambda member: (root.parent / member).read_text()
