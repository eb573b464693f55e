"""The dstack provider against the real dstack server and CLI (tests/dstack/README.md): the server and CLI
are dstack's own, the fleet is provisioned by the server over SSH, the shim and runner are ours (played)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cluster


def test_server_answers_and_cli_lists_runs(dstack_bed):
    info = dstack_bed.api("/api/server/get_info")
    assert info["server_version"] == "0.22.5"
    out = dstack_bed.cli("ps").output
    assert "NAME" in out.upper() or "No runs" in out or out.strip() == "", out
    projects = dstack_bed.cli("project", "list").output
    assert "main" in projects and "127.0.0.1:3000" in projects, projects
