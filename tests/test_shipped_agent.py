"""The agent that runs on a node is the one rlhf-tasks shipped, never an `rlhf_tasks/` package
that happens to be in the working directory (a fork of this project, a job's working_dir):
`python3 -m` puts the working directory first on sys.path, ahead of PYTHONPATH. So every
provider starts the agent, the job's gate and preflight's job by the entry file's path
(issue 32, item 2). Slurm's cluster test with a decoy in the submit directory is in
tests/test_slurm_provider.py (the podman variant)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.agent import head, jobrunner
from rlhf_tasks.spec import parse_task

from conftest import ROOT

DECOY_SAYS = "DECOY rlhf_tasks RAN"


def make_decoy(where: Path) -> Path:
    """A directory holding an `rlhf_tasks` package whose agent, gate and preflight only say they ran."""
    agent = where / "rlhf_tasks" / "agent"
    agent.mkdir(parents=True)
    (where / "rlhf_tasks" / "__init__.py").write_text("")
    (agent / "__init__.py").write_text("")
    marker = where / "decoy-ran"
    for name in ("__main__.py", "preflight.py"):
        (agent / name).write_text(f"print({DECOY_SAYS!r}, flush=True)\nopen({str(marker)!r}, 'a').write('ran\\n')\n"
                                  "raise SystemExit(7)\n")
    return where


@pytest.fixture
def decoy(tmp_path):
    return make_decoy(tmp_path / "repo")


def decoy_env(decoy: Path, **extra) -> dict:
    # Ray puts a job's working_dir first on PYTHONPATH too: the decoy is there as well as in the cwd.
    return {"PATH": os.environ["PATH"], "PYTHONPATH": f"{decoy}{os.pathsep}{ROOT}", **extra}


TASK = {"name": "t", "nodes": 2, "resources": {"gpus": "H100:1"},
        "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}}


def rendered(provider: str, data: dict = TASK) -> dict[str, str]:
    p = providers.get(provider)
    return p.render(p.plan(parse_task(data)))


@pytest.mark.parametrize("provider, data", [
    ("local", {**TASK, "resources": {}}), ("dstack", TASK), ("sky", TASK), ("runpod", TASK), ("slurm", TASK),
    ("slurm", {**TASK, "image": "nvcr.io/nvidia/pytorch:24.05-py3"}),
    ("slurm", {**TASK, "image": "rocm/vllm:latest", "placement": {"slurm": {"container": "podman"}}}),
    ("kuberay", {**TASK, "image": "rayproject/ray:2.60.0"}),
], ids=["local", "dstack", "sky", "runpod", "slurm", "slurm-pyxis", "slurm-podman", "kuberay"])
def test_every_provider_starts_the_agent_by_its_entry_files_path(provider, data, rlhf_home):
    # what the provider runs, not the shipped agent's own files (a directory, or heredocs in Slurm's script)
    text = "\n".join(body for name, body in rendered(provider, data).items() if "/lib/" not in name)
    text = re.sub(r"<<'(RLHF_TASKS_MODULE\w*)'\n.*?\n\1\n", "", text, flags=re.S)
    assert "-m rlhf_tasks.agent" not in text and "'-m' rlhf_tasks.agent" not in text
    assert "rlhf_tasks/agent/__main__.py --plan" in text.replace('"', "").replace("'", "")


def test_the_rendered_agent_command_runs_the_shipped_agent_from_a_directory_with_a_decoy(decoy, tmp_path):
    files = rendered("dstack")
    out = tmp_path / "out"
    for name, body in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(body)
    command = yaml.safe_load(files["t.dstack.yml"])["commands"][-1].replace("/opt/rlhf-tasks", str(out / "rlhf-tasks"))
    run = subprocess.run(["bash", "-c", command], cwd=decoy, env=decoy_env(decoy), capture_output=True, text=True,
                         timeout=60)
    said = run.stdout + run.stderr
    assert DECOY_SAYS not in said
    # the shipped agent: no dstack contract in this environment, so it stops at reading it, with its result line
    assert run.returncode == 2 and "DSTACK_NODE_RANK" in said and "RLHF_TASKS_RESULT " in said, said


def test_the_jobs_gate_is_the_shipped_one_in_a_working_dir_with_a_decoy(decoy, tmp_path):
    gate = jobrunner.Gate(str(tmp_path / "job.gate"))
    gate.open()
    argv = gate.wrap(["echo", "the job's command ran"], 30)
    run = subprocess.run(argv, cwd=decoy, env=decoy_env(decoy), capture_output=True, text=True, timeout=60)
    said = run.stdout + run.stderr
    assert DECOY_SAYS not in said and "the job's gate is waiting" in said, said  # the shipped gate's own line
    assert run.returncode == 0 and run.stdout.endswith("the job's command ran\n"), said


def test_preflights_job_is_the_shipped_one_in_a_working_dir_with_a_decoy(decoy):
    plan = {"nodes": 2, "wait": {"nodes_s": 60}, "preflight": {"timeout_s": 30, "min_bandwidth_bits": 1e9, "torch": False}}
    argv = head.HeadPreflight(types.SimpleNamespace(plan=plan, cluster_key=lambda: "t-c1"), None).argv()
    assert argv[0] == "python3"
    run = subprocess.run([sys.executable, *argv[1:], "--help"], cwd=decoy, env=decoy_env(decoy), capture_output=True,
                         text=True, timeout=60)
    assert DECOY_SAYS not in run.stdout and run.returncode == 0 and "--min-bandwidth-bits" in run.stdout, \
        run.stdout + run.stderr


def test_a_local_launch_from_a_directory_with_a_decoy_runs_only_the_shipped_agent(decoy, cli_env):
    """The local provider's agents run in the launcher's directory, and the job (its gate, with
    preflight in it) in its working_dir, which is that directory: the decoy is in both."""
    (decoy / "task.yaml").write_text(yaml.safe_dump({
        "name": "decoy", "nodes": 2, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"},
        "preflight": {"timeout": "2m", "torch": False},
        "job": {"recipe": "command", "submit": "head", "working_dir": ".", "max_restarts": 0,
                "args": {"entrypoint": "echo the job ran"}}}))
    launcher = str(Path(sys.executable).with_name("rlhf-tasks"))  # the console script: the launcher itself is ours
    run = subprocess.run([launcher, "launch", "task.yaml"], cwd=decoy, env=cli_env, capture_output=True, text=True,
                         timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "SUCCEEDED" in out and "the job ran" in out, out[-6000:]
    assert re.search(r"preflight passed in [\d.]+s: 2 nodes", out), out[-6000:]  # its probes ran on both nodes
    assert not (decoy / "decoy-ran").exists() and DECOY_SAYS not in out
