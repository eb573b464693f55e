"""Surviving node loss on the namespace testbed, with dstack's contract: the head agent stops
the job when a node dies, goes silent or the job stalls, waits until the task's count of
nodes is back (a replacement may have another address), and resubmits it (`-r1`, ...),
which resumes from the shared checkpoint; it gives up, naming the cause,
when the node never comes back, after `job.max_restarts`, or on a bug that fails fast
twice. The metrics file is the proof that nothing was lost or counted twice."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import testbed as tbmod
from test_contracts import TOKEN, dstack_env, place, render

testbed3 = tbmod.make_testbed_fixture(3)
testbed4 = tbmod.make_testbed_fixture(4)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def tiny_grpo(tmp_path: Path, steps: int, **job) -> dict:
    return {"name": "loss", "nodes": 3, "resources": {"cpus": 1}, "env": {"PYTHONUNBUFFERED": "1"}, "preflight": "off",
            "ray": {"object_store_memory": "80MB"}, "checkpoints": {"path": str(tmp_path / "ckpt")},
            "wait": {"head": "3m", "nodes": "3m"},
            "job": {"recipe": "tiny-grpo", "working_dir": None, "timeout": "10m", **job,
                    "args": {"steps": steps, "save_every": 10, "prompts_per_step": 8, "group_size": 8,
                             "num_prompts": 200}}}


def command_job(tmp_path: Path, entrypoint: str, **job) -> dict:
    return {"name": "loss", "nodes": 3, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
            "checkpoints": {"path": str(tmp_path / "ckpt")}, "wait": {"head": "3m", "nodes": "20s"},
            "job": {"recipe": "command", "working_dir": None, "timeout": "10m", **job,
                    "args": {"entrypoint": entrypoint}}}


class Nodes:
    """The rendered dstack task started on the testbed's hosts, one agent per host."""

    def __init__(self, tb, tmp_path: Path, task: dict):
        self.tb, self.task = tb, task
        files = render("dstack", task, tmp_path / "rendered")
        self.config = yaml.safe_load(files[f"{task['name']}.dstack.yml"])
        self.mounts = {m.split(":")[1]: tmp_path / "rendered" / m.split(":")[0] for m in self.config["files"]}
        self.procs = [self.start(rank) for rank in range(task["nodes"])]

    def start(self, rank: int, host: int | None = None):
        """The agent of `rank` on its own host, or (`host`) on another machine that takes its place:
        dstack's list of addresses then has that machine's address at the rank's place."""
        host = rank if host is None else host
        place(self.tb, host, self.mounts)
        env = dstack_env(self.tb, rank, self.task["nodes"], self.config["env"])
        ips = env["DSTACK_NODES_IPS"].split("\n")
        ips[rank] = self.tb.hosts[host].ip
        env["DSTACK_NODES_IPS"] = "\n".join(ips)
        return self.tb.run(host, " && ".join(self.config["commands"]), env=env, name=f"node{rank}")

    @property
    def head(self):
        return self.procs[0]


def wait_rows(path: Path, head, what: str, rows, timeout: float = 240) -> list[dict]:
    """The metrics rows `rows(all rows)` gives once it gives any (fails when the head exits first)."""
    def check():
        if head.returncode is not None:
            raise AssertionError(head.output[-4000:])
        return rows(metrics(path))
    return tbmod.poll(check, timeout, what, 0.2)


def wait_step(path: Path, step: int, head) -> None:
    wait_rows(path, head, f"step {step}", lambda rows: rows and rows[-1]["step"] >= step)


@pytest.mark.alone  # the silent node's bound (12 s + 6) is about this test's own cores
def test_lost_workers_are_replaced_and_the_job_resumes_from_its_checkpoint_each_time(testbed4, tmp_path):
    """Two losses in one run. First a worker machine dies (every process, its /tmp; the kernel
    closes its connections) and a new one comes back at the same address. Then another goes
    silent, as a machine a cloud reclaims: its link is cut, its processes keep running,
    nothing closes their connections; a replacement with the same rank comes up 5 s later
    on a fourth machine with another address. The head notices within wait.node_silence,
    counts nodes instead of matching addresses, and the job resumes each time."""
    tb, steps = testbed4, 150
    task = tiny_grpo(tmp_path, steps)
    task["wait"]["node_silence"] = "12s"
    nodes = Nodes(tb, tmp_path, task)
    path = tmp_path / "ckpt" / "metrics.jsonl"
    wait_step(path, 20, nodes.head)
    tb.reboot(1)  # the machine is gone: every process, its /tmp; then a new one with the same contract
    nodes.procs[1] = nodes.start(1)
    first = wait_rows(path, nodes.head, "the job to resume", lambda rows: [r for r in rows if "resumed_from" in r])
    wait_step(path, first[0]["step"] + 30, nodes.head)
    # a reclaimed machine: its link goes down, its processes keep running
    subprocess.run(["ip", "-n", tb.hosts[2].netns, "link", "set", "eth0", "down"], check=True)
    cut, last_before = time.monotonic(), metrics(path)[-1]["step"]
    tbmod.poll(lambda: time.monotonic() - cut >= 5, 10, "5 s", 0.1)
    nodes.procs[2] = nodes.start(2, host=3)  # rank 2 again, on a fourth machine: 10.77.0.13
    # Declared dead within wait.node_silence (12 s): the head says the node left once Ray has marked it
    # DEAD, at its next check (every 2 s, between polls of the job's log that back off to 3 s).
    tbmod.poll(lambda: "10.77.0.12 left the cluster" in nodes.head.output or None, 120,
               "the head to say the silent node left", 0.1)
    left = time.monotonic() - cut
    assert left <= 12 + 6, f"the head said the silent node left {left:.1f}s after the cut"
    second = wait_rows(path, nodes.head, "the job to resume again", lambda rows: [
        r for r in rows if r.get("resumed_from", 0) > first[0]["resumed_from"]], 120)
    first_new = time.monotonic() - cut
    assert nodes.head.wait(240) == 0, nodes.head.output[-6000:]
    out = nodes.head.output
    assert "restarting the job, attempt 1 of 2" in out and "10.77.0.11" in out  # why, and which node
    assert "declared dead within 12s" in out  # the bound for a silent node, said
    assert "node 10.77.0.12 left the cluster" in out and "new: 10.77.0.13" in out, out[-6000:]
    result = json.loads(out.strip().splitlines()[-1].split(" ", 1)[1])
    attempts = result["job"]["attempts"]
    assert [a["submission_id"][-3:] for a in attempts][1:] == ["-r1", "-r2"] and attempts[-1]["status"] == "SUCCEEDED"
    rows = metrics(path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no step lost, none counted twice
    assert first[0]["resumed_from"] >= 10  # from a checkpoint, not from step 1
    assert first[0]["resumed_from"] < second[0]["resumed_from"] <= last_before  # the checkpoint before the cut
    assert first_new < 60, f"the first step after the cut came {first_new:.0f}s after it"
    print(f"the silent node left {left:.1f}s after the cut; "
          f"first step after the cut {first_new:.1f}s after it (steps {last_before} before, "
          f"{second[0]['resumed_from'] + 1} after)")
    import torch  # the latest checkpoint is whole: it loads, at the last step

    assert torch.load(tmp_path / "ckpt" / f"step_{steps:06d}.pt", weights_only=False)["step"] == steps
    assert TOKEN not in out


def test_a_worker_that_never_comes_back_fails_the_run_naming_it(testbed3, tmp_path):
    tb = testbed3
    nodes = Nodes(tb, tmp_path, command_job(tmp_path, "python3 -c 'import time; print(\"up\", flush=True); "
                                                      "time.sleep(600)'"))
    tbmod.poll(lambda: "following job" in nodes.head.output or None, 180, "the job to start")
    tb.reboot(2)
    assert nodes.head.wait(180) == 1, nodes.head.output[-4000:]
    out = nodes.head.output
    assert "node 10.77.0.12 left the cluster" in out
    assert "waiting for 3 nodes to be ALIVE again" in out and "gone: 10.77.0.12" in out
    # The failure's forensics (issue 22): the lost node is named with Ray's word on its death.
    found = json.loads(out.strip().splitlines()[-1].split(" ", 1)[1])["forensics"]  # the head's result line
    lost = next(e for e in found["first_errors"] if e["ip"] == "10.77.0.12")
    assert lost["kind"] == "dead" and lost["error"].startswith("lost: Ray marked the node DEAD"), found
    assert found["bundle"].startswith("/opt/rlhf-tasks/logs/forensics-")


def test_a_stalled_job_is_restarted_then_fails_naming_the_stall(testbed3, tmp_path):
    tb = testbed3
    nodes = Nodes(tb, tmp_path, command_job(
        tmp_path, "python3 -c 'import time; print(\"working\", flush=True); time.sleep(600)'",
        stall_timeout="6s", max_restarts=1))
    assert nodes.head.wait(240) == 1, nodes.head.output[-4000:]
    out = nodes.head.output
    assert out.count("its log has not grown for 6s (job.stall_timeout)") >= 2
    assert "restarting the job, attempt 1 of 1" in out and "no restarts left (job.max_restarts is 1)" in out
    result = json.loads(out.strip().splitlines()[-1].split(" ", 1)[1])
    assert [a["submission_id"][-3:] for a in result["job"]["attempts"]][-1] == "-r1"


def test_a_job_that_fails_fast_the_same_way_twice_is_a_bug_not_restarted_again(testbed3, tmp_path):
    tb = testbed3
    task = command_job(tmp_path, "python3 -c 'raise SystemExit(\"bad config: lr\")'", max_restarts=5)
    task["wait"]["node_loss"] = "3s"
    nodes = Nodes(tb, tmp_path, task)
    assert nodes.head.wait(240) == 1, nodes.head.output[-4000:]
    out = nodes.head.output
    assert "failed the same way twice in a row" in out and "a bug, not a fault" in out
    assert out.count("restarting the job") == 1  # two attempts, not six

