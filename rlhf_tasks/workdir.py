"""Where a job's `working_dir` is (a relative one is of the task file's directory) and what of
it is uploaded with it, measured on this machine before anything starts, on every provider whose
head's Ray uploads this directory or the provider's copy of it (local, SkyPilot, Slurm, any
`submit: client`; dstack and RunPod add their own limits): what never belongs in a job's code is
left out by default (virtualenvs, found by their `pyvenv.cfg`; `node_modules`, `__pycache__`,
`.git`; the runs directory of rlhf-tasks), the rest is measured with Ray's own traversal and
exclude rules when Ray is installed here, or with a standard-library one that follows the same
rules (the job's excludes, `.gitignore` and `.rayignore` files) closely enough, and a working_dir
over Ray's upload limit is refused with its size, its biggest entries and how to leave them out."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import BadInput

#: Ray's dashboard takes a request body of at most 100 MiB (ray_constants.DASHBOARD_CLIENT_MAX_SIZE):
#: a bigger package fails mid-launch with "413: Maximum request body size 104857600 exceeded".
DASHBOARD_BODY_LIMIT = 100 * 2**20
#: Directories that never belong in a job's code, wherever they are (besides virtualenvs).
NEVER_CODE = (".git", "node_modules", "__pycache__")
RAY_TRAVERSAL = "Ray's own traversal"
STDLIB_TRAVERSAL = "rlhf-tasks' own traversal (Ray is not installed here; it follows Ray's rules closely)"


@dataclass
class Measure:
    """A working_dir as Ray would pack it."""

    path: str
    size: int = 0
    #: Top-level entries and their bytes, the biggest first.
    biggest: list[tuple[str, int]] = field(default_factory=list)
    #: Anchored exclude patterns for what was left out by default here (a virtualenv, the runs directory).
    left_out: list[str] = field(default_factory=list)
    how: str = RAY_TRAVERSAL


def resolve(working_dir: str, base: str) -> str:
    """A job.working_dir as an absolute path: a relative one is of `base`, the task file's directory
    (as dstack, SkyPilot and docker compose resolve the paths their files name), not of the shell's."""
    return os.path.normpath(os.path.join(base, os.path.expanduser(working_dir)))


def moved(working_dir: str, base: str, cwd: str | None = None) -> str | None:
    """What to tell of a relative job.working_dir that names another directory from `cwd` (the current
    one) than from the task file's, where earlier versions read it (None: nothing changed)."""
    if not working_dir or os.path.isabs(os.path.expanduser(working_dir)):
        return None
    here, there = resolve(working_dir, cwd or os.getcwd()), resolve(working_dir, base)
    if here == there or not os.path.isdir(here):
        return None
    return (f"job.working_dir: {working_dir} is {there}, of the task file's directory (as dstack, SkyPilot and docker "
            f"compose read relative paths), not {here} of the current directory, as rlhf-tasks read it before; "
            f"write the path relative to the task file, or absolute")


def require_dir(path: str, written: str | None = None, field: str = "job.working_dir") -> None:
    """Refuse, on every provider, a job.working_dir (or `field`) that is not a directory here."""
    if not Path(path).is_dir():
        what = "does not exist" if not os.path.lexists(path) else "is not a directory"
        said = f"{written} ({path}, of the task file's directory)" if written and written != path else path
        raise BadInput(f"{field}: {said} {what}: name the directory of the job's code, relative to the "
                       f"task file's directory or absolute, or null for none")


def upload_limit() -> int:
    """The most Ray takes: its dashboard's request body limit, or GCS's own when lower."""
    if importlib.util.find_spec("ray") is None:
        return DASHBOARD_BODY_LIMIT
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE

    return min(GCS_STORAGE_MAX_SIZE, DASHBOARD_BODY_LIMIT)


def _runs_dir() -> Path:
    from . import state

    return (state.root() / "runs").absolute()


def measure(path: str, excludes: list[str], files: list[Path] | None = None,
            also: list[Callable[[Path], bool]] = ()) -> Measure:
    """Bytes Ray would pack from `path` (before compression), by top-level entry, leaving out by
    default what never belongs in a job's code (`files`: appended with each file packed; `also`:
    what the provider's own copy leaves out before Ray packs it, e.g. SkyPilot's .skyignore)."""
    root = Path(path).absolute()
    out = Measure(str(path))
    sizes: dict[str, int] = {}
    runs = _runs_dir()

    def left_out(p: Path) -> bool:
        if not p.is_dir() or p == root:
            return False
        if p.name in NEVER_CODE:
            return True
        if (p / "pyvenv.cfg").is_file() or p.absolute() == runs:
            out.left_out.append("/" + p.relative_to(root).as_posix())
            return True
        return False

    def add(p: Path) -> None:
        if p.is_file():
            if files is not None:
                files.append(p)
            top = p.relative_to(root).parts[0]
            sizes[top] = sizes.get(top, 0) + p.stat().st_size

    if importlib.util.find_spec("ray") is not None:
        from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

        _dir_travel(root, [_get_excludes(root, excludes), left_out, *also], add, include_gitignore=True)
    else:
        out.how = STDLIB_TRAVERSAL
        _travel(root, [_rules_matcher(root, excludes), left_out, *also], add)
    out.size = sum(sizes.values())
    out.biggest = sorted(sizes.items(), key=lambda item: -item[1])
    return out


def check(path: str, excludes: list[str], also: list[Callable[[Path], bool]] = (),
          who: str = "", field: str = "job.working_dir") -> Measure:
    """Refuse, before anything starts, a working_dir (or a py_module: `field`) Ray would reject as too
    large: its size, its biggest entries and how to leave them out (`who`: who uploads it, for the message)."""
    require_dir(path, field=field)
    found, limit = measure(path, excludes, also=also), upload_limit()
    if found.size >= limit:
        top = [(name + ("/" if (Path(path) / name).is_dir() else ""), size) for name, size in found.biggest[:5]
               if size * 100 >= found.size]  # an entry under 1% of the whole is no help
        listed = ", ".join(f"{name} {human(size)}" for name, size in top)
        example = ", ".join(f'"/{name}"' for name, _ in enough(top, found.size - limit + 1))
        raise BadInput(f"{field}: {path} packs {human(found.size)} (measured with {found.how}), over Ray's "
                       f"upload limit of {human(limit)}{who}; the biggest entries: {listed}. Leave out what the job "
                       f"does not need with job.excludes: [{example}] (or a .rayignore file there), or set "
                       f"{field} to the directory of the job's code only"
                       + (" (null: none)" if field == "job.working_dir" else ""))
    return found


def ignore_files(root: str, name: str) -> Callable[[Path], bool]:
    """What the `name` files below `root` leave out (each applies to its own directory and below, as
    rsync's `dir-merge` and Ray's .gitignore do)."""
    base = Path(root).absolute()
    matchers: dict[Path, Callable[[Path], bool] | None] = {}

    def excluded(p: Path) -> bool:
        p = p.absolute()
        for parent in reversed(p.parents):
            if parent != base and base not in parent.parents:
                continue
            if parent not in matchers:
                matchers[parent] = _ignore_file(parent / name)
            if matchers[parent] is not None and matchers[parent](p):
                return True
        return False
    return excluded


def enough(entries: list[tuple[str, int]], over: int) -> list[tuple[str, int]]:
    """The fewest of `entries` (the biggest first) that together weigh `over` bytes: the ones
    worth excluding (all of them when even that is not enough)."""
    chosen, total = [], 0
    for entry in entries:
        if total >= over:
            break
        chosen.append(entry)
        total += entry[1]
    return chosen


def human(size: int) -> str:
    """Bytes as a person reads them: 104 MiB, 12 KiB, 9 bytes."""
    if size >= 2**20:
        return f"{size / 2**20:.0f} MiB"
    return f"{size / 2**10:.0f} KiB" if size >= 2**10 else f"{size} bytes"


# ------------------------------------------------------------------ without Ray: the same rules

def _travel(path: Path, excludes: list[Callable[[Path], bool]], handler: Callable[[Path], None],
            ignore_files: tuple[str, ...] = (".gitignore", ".rayignore")) -> None:
    """Ray's `_dir_travel`: a directory's .gitignore and .rayignore (or `ignore_files`) apply below it."""
    added = [m for m in (_ignore_file(path / name) for name in ignore_files) if m] if path.is_dir() else []
    excludes = excludes + added
    if any(exclude(path) for exclude in excludes):
        return
    handler(path)
    if path.is_dir():  # a link to a directory is followed, as Ray does
        try:
            subs = sorted(path.iterdir())
        except OSError:  # unreadable here: Ray could not pack it either, and says so at upload
            return
        for sub in subs:
            _travel(sub, excludes, handler, ignore_files)


def _ignore_file(file: Path) -> Callable[[Path], bool] | None:
    try:
        lines = file.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return _rules_matcher(file.parent, lines)


def _rules_matcher(base: Path, lines: list[str]) -> Callable[[Path], bool]:
    """gitignore rules relative to `base` (the last matching rule wins; `!` negates)."""
    rules = [rule for rule in map(_rule, lines) if rule]
    base = base.absolute()

    def match(p: Path) -> bool:
        try:
            rel = p.absolute().relative_to(base).as_posix()
        except ValueError:
            return False
        if rel == ".":
            return False
        excluded = False
        for regex, negate, dir_only in rules:
            if (not dir_only or p.is_dir()) and regex.match(rel):
                excluded = not negate
        return excluded
    return match


def _rule(line: str):
    """A gitwildmatch pattern as (regex, negated, directories only), or None for none."""
    line = re.sub(r"(?<!\\)\s+$", "", line)
    if not line or line.startswith("#"):
        return None
    negate = line.startswith("!")
    line = line[1:] if negate else line
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    anchored = "/" in line
    line = line.lstrip("/")
    body, i = "", 0
    while i < len(line):
        if line.startswith("**/", i):
            body, i = body + "(?:.*/)?", i + 3
        elif line.startswith("**", i):
            body, i = body + ".*", i + 2
        elif line[i] == "*":
            body, i = body + "[^/]*", i + 1
        elif line[i] == "?":
            body, i = body + "[^/]", i + 1
        elif line[i] == "[" and "]" in line[i + 1:]:
            end = line.index("]", i + 1)
            inside = line[i + 1:end]
            body, i = body + "[" + ("^" + inside[1:] if inside.startswith("!") else inside) + "]", end + 1
        elif line[i] == "\\" and i + 1 < len(line):
            body, i = body + re.escape(line[i + 1]), i + 2
        else:
            body, i = body + re.escape(line[i]), i + 1
    regex = ("^" if anchored else "^(?:.*/)?") + body + "(?:/.*)?$"
    return re.compile(regex), negate, dir_only
