"""Surviving node loss on the namespace testbed, with dstack's contract: the head agent stops
the job when a node dies or the job stalls, waits until every node is back, and resubmits
it (`-r1`, ...), which resumes from the shared checkpoint; it gives up, naming the cause,
when the node never comes back, after `job.max_restarts`, or on a bug that fails fast
twice. The metrics file is the proof that nothing was lost or counted twice."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

import testbed as tbmod
from test_contracts import TOKEN, dstack_env, place, render

testbed3 = tbmod.make_testbed_fixture(3)


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

    def start(self, rank: int):
        place(self.tb, rank, self.mounts)
        env = dstack_env(self.tb, rank, self.task["nodes"], self.config["env"])
        return self.tb.run(rank, " && ".join(self.config["commands"]), env=env, name=f"node{rank}")

    @property
    def head(self):
        return self.procs[0]


def wait_step(path: Path, step: int, head) -> None:
    tbmod.poll(lambda: (head.returncode is not None and (_ for _ in ()).throw(AssertionError(head.output[-3000:])))
               or (metrics(path) and metrics(path)[-1]["step"] >= step), 240, f"step {step}", 0.2)


def test_a_replaced_worker_host_rejoins_and_the_job_resumes_from_its_checkpoint(testbed3, tmp_path):
    tb, steps = testbed3, 800  # long enough that the host is lost mid-job on a fast machine
    nodes = Nodes(tb, tmp_path, tiny_grpo(tmp_path, steps))
    wait_step(tmp_path / "ckpt" / "metrics.jsonl", 30, nodes.head)
    tb.reboot(1)  # the machine is gone: every process, its /tmp; then a new one with the same contract
    nodes.procs[1] = nodes.start(1)
    assert nodes.head.wait(420) == 0, nodes.head.output[-6000:]
    out = nodes.head.output
    assert "restarting the job, attempt 1 of 2" in out and "10.77.0.11" in out  # why, and which node
    result = json.loads(out.strip().splitlines()[-1].split(" ", 1)[1])
    attempts = result["job"]["attempts"]
    assert len(attempts) >= 2 and attempts[-1]["status"] == "SUCCEEDED" and attempts[-1]["submission_id"].endswith(
        f"-r{len(attempts) - 1}")
    rows = metrics(tmp_path / "ckpt" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no step lost, none counted twice
    resumed = [r for r in rows if "resumed_from" in r]
    assert resumed and resumed[-1]["resumed_from"] >= 10  # from a checkpoint, not from step 1
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
    assert "waiting for every node to be ALIVE again" in out and "missing: 10.77.0.12" in out
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
