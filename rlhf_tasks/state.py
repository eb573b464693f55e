"""What the launcher keeps on the user's machine, under $RLHF_TASKS_HOME (default
~/.rlhf-tasks), never inside the working directory (so it is never uploaded with a job's
working_dir), and wherever the command is run from:

  clusters/<name>/token         the cluster's Ray token (mode 0600) while it lives
  clusters/<name>/cluster.json  provider, dashboard address, cluster id, local PIDs; once
                                the cluster has ended: when, how its job ended, its logs
  runs/<name>/                  a launch's files: rendered output, node logs, and for the
                                local provider its checkpoints (so a relaunch resumes)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
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
