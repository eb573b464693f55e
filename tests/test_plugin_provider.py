"""A provider added from outside: `tests/plugins/acme_provider` registers itself through the
`rlhf_tasks.providers` entry-point group with an invented environment contract (ACME_RANK,
ACME_COUNT, ACME_HOSTS). It is installed as a third party would install it, the CLI renders
a task with it, and the rendered script runs with the shipped agent on the namespace
testbed: the cluster forms and the job succeeds, with nothing in rlhf_tasks/ naming Acme."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import testbed as tbmod
from conftest import ROOT
from test_contracts import TOKEN, place

testbed3 = tbmod.make_testbed_fixture(3)
PLUGIN = ROOT / "tests" / "plugins" / "acme_provider"


@pytest.fixture(scope="module")
def acme_site(tmp_path_factory) -> Path:
    """The plugin installed (pip, no index) into a directory of its own, put on PYTHONPATH."""
    site = tmp_path_factory.mktemp("acme-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(PLUGIN)], check=True, capture_output=True, timeout=300)
    return site


def cli(args, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    # the checkout under test after the plugin (a worktree's, not the one the venv installed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), RLHF_TASKS_HOME=str(cwd / "home"))
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def acme_task(tmp_path: Path) -> Path:
    path = tmp_path / "acme.yaml"
    path.write_text(yaml.safe_dump({
        "name": "acme-job", "nodes": 3, "resources": {"cpus": 1}, "network": "acme-fabric", "preflight": "off",
        "ray": {"object_store_memory": "80MB"}, "wait": {"head": "3m", "nodes": "3m"},
        "checkpoints": {"path": str(tmp_path / "ckpt")},
        "job": {"recipe": "command", "working_dir": None, "timeout": "5m", "args": {"entrypoint": (
            "python3 -c \"import os, ray; ray.init(); n = sum(1 for x in ray.nodes() if x['Alive']); "
            "print('ACME alive nodes', n, 'fabric', os.environ.get('ACME_FABRIC')); assert n == 3\"")}},
    }))
    return path


def test_an_outside_provider_is_listed_and_renders(acme_site, tmp_path):
    rendered = tmp_path / "out" / "acme-job.acme.sh"
    out = cli(["render", str(acme_task(tmp_path)), "--provider", "acme", "-o", str(rendered)], acme_site, tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads((rendered.parent / "rlhf-tasks" / "acme-job.acme.plan.json").read_text())
    assert plan["contract"]["rank"] == {"env": "ACME_RANK", "template": None, "command": None, "value": None,
                                        "item": None, "plus": 0, "default": None}
    assert plan["network_env"] == {"GLOO_SOCKET_IFNAME": "{iface}", "ACME_FABRIC": "on"}
    unknown = cli(["render", str(acme_task(tmp_path)), "--provider", "acme-typo"], acme_site, tmp_path)
    assert unknown.returncode == 2 and "acme" in unknown.stderr  # the known providers include it


def test_an_outside_provider_forms_a_cluster_with_the_shipped_agent(acme_site, testbed3, tmp_path):
    tb = testbed3
    rendered = tmp_path / "out" / "acme-job.acme.sh"
    out = cli(["render", str(acme_task(tmp_path)), "--provider", "acme", "-o", str(rendered)], acme_site, tmp_path)
    assert out.returncode == 0, out.stderr
    shipped = {f"/opt/rlhf-tasks/{p.name}": p for p in (rendered.parent / "rlhf-tasks").iterdir()}
    hosts = "\n".join(h.ip for h in tb.hosts)
    procs = []
    for rank in range(3):
        place(tb, rank, shipped)
        env = tb.env(ACME_RANK=str(rank), ACME_COUNT="3", ACME_HOSTS=hosts, RAY_AUTH_TOKEN=TOKEN)
        procs.append(tb.run(rank, ["bash", str(rendered)], env=env, name=f"acme-node{rank}"))
    assert procs[0].wait(240) == 0, procs[0].output[-4000:]
    head = procs[0].output
    assert "ACME alive nodes 3 fabric on" in head and "GLOO_SOCKET_IFNAME=eth0" in head
    result = json.loads(head.strip().splitlines()[-1].split(" ", 1)[1])
    assert result["exit_code"] == 0 and result["job"]["status"] == "SUCCEEDED"
    assert TOKEN not in head
    for worker in procs[1:]:
        assert worker.wait(90) == 0, worker.output[-3000:]
