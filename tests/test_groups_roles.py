"""Node groups (issue 46), roles on groups: `{group_addr:NAME}` in the job's command (filled by the head once every
group is in: by the gate of a job submitted early, or at a later submission), and tiny-grpo's reward server on a
group of its own (`reward_where`) with its trainers on the first group's nodes. A real local cluster runs it in
tests/test_edges.py (`launch --fresh`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf_tasks import providers
from rlhf_tasks.agent.protocol import AgentError, fill_group_addrs, group_addrs, job_argv
from rlhf_tasks.agent.raynode import agent_entry
from rlhf_tasks.spec import parse_task

from test_groups import alive, check_exit, grouped


def node(ip: str, group: str) -> dict:
    return {"node_ip": ip, "labels": {"rlhf-tasks/group": group}, "resources_total": {"CPU": 1.0, group: 1.0}}


GROUPS = [{"name": "trainer", "nodes": 2, "resources": {"trainer": 1}},
          {"name": "reward", "nodes": 2, "resources": {"reward": 1}}]


def test_a_groups_address_is_its_node_with_the_lowest_address_as_ray_says():
    nodes = [node("10.0.0.10", "reward"), node("10.0.0.9", "reward"), node("10.0.0.2", "trainer"),
             {"node_ip": "10.0.0.1", "labels": {"rlhf-tasks/group": "reward"}, "resources_total": {"CPU": 1.0}}]
    # by number, not text (10.0.0.9 < 10.0.0.10); a node without the group's resource registered is not in it
    assert group_addrs(nodes, GROUPS) == {"reward": "10.0.0.9", "trainer": "10.0.0.2"}


def test_the_placeholder_is_filled_in_the_command_and_a_missing_group_named():
    argv = ["x", "--url", "http://{group_addr:reward}:5000/score", "{head_addr}"]
    assert fill_group_addrs(argv, {"reward": "10.0.0.9"}) == ["x", "--url", "http://10.0.0.9:5000/score", "{head_addr}"]
    with pytest.raises(AgentError, match="no node of group reward"):
        fill_group_addrs(argv, {})
    job = {"entrypoint": argv, "wandb_args": []}
    assert job_argv(job, "10.0.0.1", "10.0.0.1", {})[0][2] == "http://{group_addr:reward}:5000/score"  # left for the gate
    assert job_argv(job, "10.0.0.1", "10.0.0.1", {}, {"reward": "10.0.0.9"})[0][2:] == ["http://10.0.0.9:5000/score",
                                                                                       "10.0.0.1"]


@pytest.mark.parametrize("word, out, code", [
    ('go\n{"reward": "10.0.0.9"}\n', "http://10.0.0.9:5000", 0),
    ("go\n", "the job's command was not started: filling the job's command failed: {group_addr:reward}: no node", 1)])
def test_the_gate_fills_the_groups_addresses_the_head_gave_when_it_opens(word, out, code, tmp_path):
    gate = tmp_path / "job.gate"
    gate.write_text(word)
    done = subprocess.run([sys.executable, agent_entry(), "gate", str(gate), "5", "--", sys.executable, "-c",
                           "import sys; print('command got', sys.argv[1])", "http://{group_addr:reward}:5000"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code and out in done.stdout, done.stdout + done.stderr


def test_the_job_may_name_only_the_tasks_groups(tmp_path, capsys, rlhf_home):
    data = grouped(job={"recipe": "command", "working_dir": None,
                        "args": {"entrypoint": "python3 x.py --url http://{group_addr:rewrd}:5000"}})
    code, out = check_exit(tmp_path, capsys, data, "--provider", "local")
    assert code == 2 and "job.args.entrypoint: {group_addr:rewrd} names no group of the task (its groups: trainer, " \
                         "reward)" in out, out
    data["job"]["args"]["entrypoint"] = "python3 x.py --url http://{group_addr:reward}:5000"
    assert check_exit(tmp_path, capsys, data, "--provider", "local")[0] == 0
    data["job"] = {"recipe": "torchrun", "args": {"module": "m", "args": ["{group_addr:reward}"]}}
    code, out = check_exit(tmp_path, capsys, data, "--provider", "local")
    assert code == 2 and "job.args: {group_addr:NAME} is filled by the head when it starts a Ray job" in out, out


def tiny(**args) -> dict:
    return grouped(job={"recipe": "tiny-grpo", "working_dir": None, "args": args}, checkpoints={"path": "/tmp/ck"})


def test_tiny_grpo_trains_on_the_first_group_and_serves_its_reward_where_told(rlhf_home):
    plan = providers.get("local").plan(parse_task(tiny(reward_where="group reward")))
    argv = plan.job.entrypoint
    assert argv[argv.index("--reward-url") + 1] == "http://{group_addr:reward}:23080/score"
    assert argv[argv.index("--num-nodes") + 1] == "2" and argv[argv.index("--node-resource") + 1] == "trainer"
    assert next(s for s in plan.services if s.name == "reward").where == "group reward"
    head = providers.get("local").plan(parse_task(tiny())).job.entrypoint
    assert head[head.index("--reward-url") + 1] == "http://{head_addr}:23080/score"
    plain = providers.get("local").plan(parse_task({"name": "plain", "nodes": 2, "checkpoints": {"path": "/tmp/ck"},
                                                    "job": {"recipe": "tiny-grpo"}})).job.entrypoint
    assert "--node-resource" not in plain and plain[plain.index("--num-nodes") + 1] == "2"


def test_tiny_grpo_refuses_a_reward_group_the_task_lacks(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, tiny(reward_where="group rm"), "--provider", "local")
    assert code == 2 and "job.args.reward_where" in out and "no group 'rm'" in out, out
    code, out = check_exit(tmp_path, capsys, tiny(reward_where="somewhere"), "--provider", "local")
    assert code == 2 and "job.args.reward_where" in out, out


def test_the_head_fills_a_later_submission_from_the_nodes_it_sees(monkeypatch):
    """A restart is submitted without a gate: the head fills the addresses itself, from Ray's nodes then."""
    from rlhf_tasks.agent import jobrunner

    runner = jobrunner.JobRunner.__new__(jobrunner.JobRunner)
    runner.plan = {"groups": GROUPS}
    runner.node = type("N", (), {"dashboard": "http://d", "token": None})()
    monkeypatch.setattr(jobrunner, "alive_nodes", lambda dashboard, token: alive("trainer", "reward"))
    assert runner.group_addrs() == {"trainer": "127.0.0.0", "reward": "127.0.0.1"}
    runner.plan = {}
    assert runner.group_addrs() is None


def test_doctor_names_each_nodes_group_and_a_group_short_of_nodes(monkeypatch, rlhf_home):
    from rlhf_tasks import doctor

    plan = providers.get("local").plan(parse_task(grouped()))
    monkeypatch.setattr(doctor, "http_request", lambda url, headers=None, timeout=None: (200 if headers else 401, b""))
    monkeypatch.setattr(doctor, "alive_nodes", lambda address, token: alive("trainer", "trainer", None))
    checks = {c.name: c for c in doctor.access_checks(doctor.Target("grouped", "http://d", "t", plan))}
    assert "127.0.0.0 (trainer, 1 CPU, 0 GPU)" in checks["nodes ALIVE"].detail
    assert not checks["node groups"].ok and checks["node groups"].detail.startswith("group reward: 0 of 1 nodes")
    monkeypatch.setattr(doctor, "alive_nodes", lambda address, token: alive("trainer", "trainer", "reward"))
    checks = {c.name: c for c in doctor.access_checks(doctor.Target("grouped", "http://d", "t", plan))}
    assert checks["node groups"].ok and "group reward: 1 of 1 nodes" in checks["node groups"].detail


def test_ps_shows_a_clusters_groups_from_its_staged_plan(rlhf_home, capsys):
    from rlhf_tasks import state
    from rlhf_tasks.cli import main

    plan = providers.get("local").plan(parse_task(grouped()))
    state.run_dir("grouped").mkdir(parents=True)
    (state.run_dir("grouped") / "plan.json").write_text(plan.to_json())
    state.save("grouped", {"provider": "local", "cluster_id": "c1", "pids": [2**22 + 1]})
    assert main(["ps"]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert "NODES" in header and "3 (trainer 2, reward 1)" in line, line
