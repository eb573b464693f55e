"""What the launcher keeps on the user's machine, under $RLHF_TASKS_HOME (default
~/.rlhf-tasks), never inside the working directory (so it is never uploaded with a job's
working_dir), and wherever the command is run from:

  clusters/<name>/token         the cluster's Ray token (mode 0600) while it lives
  clusters/<name>/cluster.json  provider, dashboard address, cluster id, local PIDs; once
                                the cluster has ended: when, how its job ended, its logs
  runs/<name>/                  a launch's files: rendered output, node logs, and for the
                                local provider its checkpoints (so a relaunch resumes)
  runs/<name>/spend.json        the training's spend over its attempts (the heads' result
                                lines), which a later launch of the name continues
                                (agent/protocol/spend.py has the format; `launch --fresh` starts anew)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path


def root() -> Path:
    return Path(os.environ.get("RLHF_TASKS_HOME") or Path.home() / ".rlhf-tasks")


def home() -> Path:
    return root() / "clusters"


def cluster_dir(name: str) -> Path:
    return home() / name


def run_dir(name: str) -> Path:
    """Where a launch of task `name` keeps its files, whatever the current directory."""
    return root() / "runs" / name


def new_token(name: str) -> str:
    """A fresh token for a new cluster, written with mode 0600 before it is used."""
    directory = cluster_dir(name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    path = directory / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    os.chmod(path, 0o600)
    return token


def token(name: str) -> str | None:
    try:
        return (cluster_dir(name) / "token").read_text().strip()
    except OSError:
        return None


def save(name: str, record: dict) -> None:
    """A cluster's record; a new one (a launch's) is stamped with when it was made (`launched`, for `ps`)."""
    record = record if "launched" in record else {**record, "launched": time.time()}
    directory = cluster_dir(name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = directory / "cluster.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(directory / "cluster.json")


def update(name: str, **facts) -> None:
    """Add facts (e.g. how the job ended) to a cluster's record."""
    record = load(name)
    if record is not None:
        save(name, {**record, **facts})


def load(name: str) -> dict | None:
    try:
        return json.loads((cluster_dir(name) / "cluster.json").read_text())
    except (OSError, ValueError):
        return None


def end(name: str, **facts) -> None:
    """The cluster is gone: drop its token, keep a record of when and how it ended."""
    record = load(name) or {}
    try:
        (cluster_dir(name) / "token").unlink()
    except OSError:
        pass
    if record:
        save(name, {**record, **facts, "ended": time.strftime("%Y-%m-%d %H:%M:%S")})


def forget(name: str) -> None:
    """Remove everything kept about a cluster (a launch that failed before it started)."""
    shutil.rmtree(cluster_dir(name), ignore_errors=True)


def known() -> list[str]:
    """Clusters launched from here that have not ended."""
    if not home().exists():
        return []
    return sorted(p.name for p in home().glob("*") if (load(p.name) or {"ended": 1}).get("ended") is None)


def launched() -> dict[str, bool]:
    """Every cluster launched from here that has a record, and whether it has ended."""
    if not home().exists():
        return {}
    records = {p.name: load(p.name) for p in sorted(home().glob("*"))}
    return {name: record.get("ended") is not None for name, record in records.items() if record}


@dataclass(frozen=True)
class Before:
    """What was kept of a cluster, and which files a launch's staging directory held, before
    a launch wrote anything: a launch that fails removes only what it wrote itself, never an
    earlier launch's record, token or files (`down` and `status` still need them)."""

    name: str
    staged: Path
    record: str | None
    token: str | None
    files: frozenset[Path]
    dirs: frozenset[Path]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def before_launch(name: str, staged: Path) -> Before:
    """The cluster's record and token as they are now, and what `staged` holds."""
    files, dirs = set(), set()
    for path in staged.rglob("*") if staged.is_dir() else ():
        (dirs if path.is_dir() else files).add(path)
    dirs.update(p for p in (staged, *staged.parents) if p.is_dir())
    return Before(name, staged, _read(cluster_dir(name) / "cluster.json"), _read(cluster_dir(name) / "token"),
                  frozenset(files), frozenset(dirs))


def undo_launch(before: Before) -> list[str]:
    """Remove what a launch wrote since `before` (files it added to its staging directory,
    a record or token it made) and put back a record or token it replaced: what was undone."""
    undone = []
    if before.staged.is_dir():
        added = sorted((p for p in before.staged.rglob("*") if p not in before.files and p not in before.dirs),
                       key=lambda p: len(p.parts), reverse=True)
        for path in added:
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            else:
                path.unlink(missing_ok=True)
        if added:
            undone.append(f"its files in {before.staged}")
    for path in (before.staged, *before.staged.parents):  # directories it made to hold them, when left empty
        if path in before.dirs or not path.is_dir() or any(path.iterdir()):
            break
        path.rmdir()
    directory = cluster_dir(before.name)
    for name, was, what in (("cluster.json", before.record, "record"), ("token", before.token, "token")):
        path = directory / name
        if _read(path) == was:
            continue
        if was is None:
            path.unlink(missing_ok=True)
            undone.append(f"the {what} it made")
        else:  # an earlier cluster's, which this launch replaced: put it back
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(was)
            undone.append(f"the earlier {what} put back")
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
    return undone


def spend_path(name: str) -> Path:
    return run_dir(name) / "spend.json"


def training(name: str, fresh: str | None = None) -> dict:
    """The training of cluster `name` as the launcher keeps it: `{"training": ID, "attempts": {...}}`. The
    name's own (its first launch, or a rendered file applied by hand: the training is the name) unless
    `fresh` (the launch's stamp) starts a new one, which is kept from then on."""
    try:
        record = json.loads(spend_path(name).read_text())
    except (OSError, ValueError):
        record = None
    wanted = f"{name}-{fresh}" if fresh else None  # a relaunch within the fresh launch continues its training
    if not isinstance(record, dict) or not record.get("training") or (wanted and record["training"] != wanted):
        return {"version": 1, "training": wanted or name, "attempts": {}}
    return record


def keep_training(name: str, record: dict) -> None:
    """Write the training's record whole (a temporary file renamed over it)."""
    path = spend_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    tmp.replace(path)
