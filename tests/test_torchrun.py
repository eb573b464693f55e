"""The torchrun recipe on the local provider: every node's agent starts the same
torchrun with its own rank (no Ray), and `launch` ends with the command's exit code."""

from __future__ import annotations

import subprocess
import sys

import yaml

from conftest import ROOT
from rlhf_tasks.agent.protocol.ports import free_port

PROGRAM = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"TORCHRUN rank {dist.get_rank()} of {dist.get_world_size()}: sum {value.item():g}", flush=True)
dist.destroy_process_group()
sys.exit(int(sys.argv[1]))
"""


def launch_torchrun(tmp_path, env, code: int) -> subprocess.CompletedProcess:
    (tmp_path / "allreduce.py").write_text(PROGRAM)
    task = tmp_path / "gloo.yaml"
    task.write_text(yaml.safe_dump({
        "name": "gloo", "nodes": 2, "resources": {"cpus": 1}, "wait": {"head": "2m"},
        "job": {"recipe": "torchrun", "timeout": "3m",
                "args": {"script": str(tmp_path / "allreduce.py"), "args": [str(code)], "port": free_port(host="")}}}))
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(task)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_torchrun_on_the_local_provider(tmp_path, cli_env, rlhf_home):
    cli_env["PYTHONPATH"] = str(ROOT)
    run = launch_torchrun(tmp_path, cli_env, 0)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "no Ray" in out and "ray start" not in out
    logs = "".join(p.read_text() for p in (rlhf_home / "runs" / "gloo" / "nodes").glob("node-*.log"))
    assert sorted(line.split(":")[0] for line in logs.splitlines() if line.startswith("TORCHRUN")) == [
        "TORCHRUN rank 0 of 2", "TORCHRUN rank 1 of 2"]
    assert "sum 3" in logs and "job gloo-" in out and "SUCCEEDED" in out


def test_torchrun_failure_is_the_launchs_failure(tmp_path, cli_env):
    cli_env["PYTHONPATH"] = str(ROOT)
    run = launch_torchrun(tmp_path, cli_env, 5)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-6000:]
    assert "failed: running the job: exit code 1" in out, out[-3000:]  # torchrun's code for a failed worker
    assert "exitcode  : 5" in out and "job gloo-" in out and "FAILED" in out
