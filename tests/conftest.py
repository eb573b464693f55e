"""Shared fixtures. Tests that need root or a package run in CI (CI=true) and fail
there when it is missing; locally they skip with the reason."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI") == "true"


def need(condition: bool, reason: str) -> None:
    """Skip locally, fail in CI: CI must never skip silently."""
    if not condition:
        if IN_CI:
            pytest.fail(f"required in CI: {reason}")
        pytest.skip(reason)


@pytest.fixture
def rlhf_home(tmp_path, monkeypatch):
    """A private launcher state dir (tokens, cluster records) for one test."""
    home = tmp_path / "home"
    monkeypatch.setenv("RLHF_TASKS_HOME", str(home))
    return home


@pytest.fixture
def cli_env(rlhf_home):
    """Environment for running the CLI as a subprocess, as a user would."""
    env = dict(os.environ, RLHF_TASKS_HOME=str(rlhf_home), PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env
