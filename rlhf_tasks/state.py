"""What the launcher keeps on the user's machine per cluster: the Ray token (mode 0600)
and a small record (provider, dashboard address, cluster id, local PIDs).

Lives under $RLHF_TASKS_HOME (default ~/.rlhf-tasks/clusters/<name>/), never inside the
working directory, so it is never uploaded with a job's working_dir.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("RLHF_TASKS_HOME") or Path.home() / ".rlhf-tasks") / "clusters"


def cluster_dir(name: str) -> Path:
    return home() / name


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


def load(name: str) -> dict | None:
    try:
        return json.loads((cluster_dir(name) / "cluster.json").read_text())
    except (OSError, ValueError):
        return None


def forget(name: str) -> None:
    for leaf in ("cluster.json", "token"):
        try:
            (cluster_dir(name) / leaf).unlink()
        except OSError:
            pass


def known() -> list[str]:
    return sorted(p.name for p in home().glob("*") if (p / "cluster.json").exists()) if home().exists() else []
