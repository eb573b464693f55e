"""Node groups (issue 46): the task file's `groups:`, the plan's groups, and what a node of a group
does with them (its Ray labels and resources, its group's setup and services, the head's readiness
per group). Errors name the field and exit 2 through `rlhf-tasks check`; a task without groups
plans as before (tests/test_providers_render.py's goldens hold it byte for byte)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.agent.contract import NodeInfo, group_of
from rlhf_tasks.agent.protocol import groups_check
from rlhf_tasks.agent.raynode import Node, fill, ray_start_command
from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks.spec import parse_task

from conftest import ROOT

JOB = {"recipe": "command", "working_dir": None, "args": {"entrypoint": "python3 -c 'print(1)'"}}


def grouped(**extra) -> dict:
    data = {"name": "grouped", "preflight": "off", "job": JOB,
            "groups": [{"name": "trainer", "nodes": 2, "resources": {"cpus": 2}},
                       {"name": "reward", "nodes": 1, "resources": {"cpus": 1}, "setup": ["echo reward-setup"],
                        "services": [{"name": "rm", "command": "echo rm {group}"}]}]}
    data.update(extra)
    return data


def problems(data: dict) -> str:
    with pytest.raises(BadInput) as caught:
        parse_task(data)
    return str(caught.value)


def check_exit(tmp_path, capsys, data: dict, *args: str) -> tuple[int, str]:
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(data))
    code = main(["check", str(path), *args])
    out = capsys.readouterr()
    return code, out.out + out.err


# ------------------------------------------------------------------ the task file

def test_groups_give_the_task_its_node_count_and_the_first_group_the_head():
    task = parse_task(grouped())
    assert task.nodes == 3 and isinstance(task.nodes, int)
    assert [g.name for g in task.groups] == ["trainer", "reward"]
    assert task.groups[1].resources.cpus == 1


@pytest.mark.parametrize("field", ["nodes", "resources"])
def test_groups_beside_top_level_nodes_or_resources_is_refused_naming_groups(field):
    said = problems(grouped(**{field: 2 if field == "nodes" else {"cpus": 1}}))
    assert f"groups: a task with groups gives each group its nodes and resources; remove the top-level `{field}`" in said


def test_group_names_are_unique_and_named_like_the_others():
    data = grouped()
    data["groups"][1]["name"] = "trainer"
    assert "groups[1].name" in problems(data) and "trainer" in problems(data)
    data["groups"][1]["name"] = "Reward"
    assert "groups[1].name" in problems(data)


def test_group_nodes_and_resources_use_the_task_grammar():
    data = grouped()
    data["groups"][0]["nodes"] = 0
    assert "groups[0].nodes" in problems(data)
    data = grouped()
    data["groups"][0]["resources"] = {"gpus": "H100:x"}
    assert "groups[0].resources.gpus" in problems(data)
    data = grouped()
    data["groups"][0]["resources"] = {"disk": "500GB..", "gpus": "H100:8"}
    assert parse_task(data).groups[0].resources.gpus_per_node == 8


def test_where_group_names_a_group_of_the_task():
    ok = parse_task(grouped(services=[{"name": "ret", "where": "group reward", "command": "x"}]))
    assert ok.services[0].where == "group reward"
    said = problems(grouped(services=[{"name": "a", "command": "x"},
                                      {"name": "ret", "where": "group nope", "command": "x"}]))
    assert "services[1].where" in said and "nope" in said and "trainer, reward" in said
    said = problems({"name": "plain", "nodes": 2, "job": JOB,
                     "services": [{"name": "ret", "where": "group reward", "command": "x"}]})
    assert "services[0].where" in said and "no groups" in said
    said = problems(grouped(services=[{"name": "ret", "where": "somewhere", "command": "x"}]))
    assert "services[0].where" in said and "group NAME" in said


def test_a_group_service_runs_on_its_group_and_names_are_unique_across_the_task():
    data = grouped()
    data["groups"][1]["services"][0]["where"] = "head"
    assert "groups[1].services[0].where" in problems(data)
    said = problems(grouped(services=[{"name": "rm", "command": "x"}]))
    assert "rm" in said and "services" in said


def test_check_exits_2_naming_the_field(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, grouped(nodes=3))
    assert code == 2 and "groups: a task with groups" in out
    code, out = check_exit(tmp_path, capsys, grouped(services=[{"name": "ret", "where": "group x", "command": "x"}]))
    assert code == 2 and "services[0].where" in out
    code, out = check_exit(tmp_path, capsys, grouped(), "--provider", "local")
    assert code == 0, out
    assert "trainer" in out and "reward" in out


def test_skypilot_refuses_groups_with_the_reason_its_own_code_gives(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, grouped(), "--provider", "sky")
    assert code == 2 and "groups: SkyPilot 0.14.1 gives every node of a task one resources block" in out, out
    assert "_monitor_job_group_task" in out, out
    assert "run the task with a provider that does (local, dstack, runpod, slurm, kuberay)" in out, out


def test_local_refuses_a_group_with_gpus_naming_it(tmp_path, capsys, rlhf_home):
    data = grouped()
    data["groups"][1]["resources"] = {"gpus": "L40S:4"}
    code, out = check_exit(tmp_path, capsys, data, "--provider", "local")
    assert code == 2 and "groups[1].resources.gpus" in out


def test_the_schema_takes_groups_instead_of_nodes():
    jsonschema = pytest.importorskip("jsonschema")
    from rlhf_tasks.spec import json_schema

    schema = json_schema()
    jsonschema.validate(grouped(), schema)
    jsonschema.validate({"name": "plain", "nodes": 2, "job": JOB}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(grouped(nodes=3), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "plain", "job": JOB}, schema)


# ------------------------------------------------------------------ the plan

def local_plan(data: dict):
    return providers.get("local").plan(parse_task(data))


def test_the_plan_holds_each_group_with_its_ranks_labels_and_resources(rlhf_home):
    data = grouped()
    plan = local_plan(data)
    trainer, reward = plan.groups
    assert (trainer.name, trainer.nodes, trainer.first_rank) == ("trainer", 2, 0)
    assert (reward.name, reward.nodes, reward.first_rank) == ("reward", 1, 2)
    assert trainer.labels == {"rlhf-tasks/group": "trainer"} and reward.labels == {"rlhf-tasks/group": "reward"}
    assert trainer.resources == {"trainer": 1} and reward.resources == {"reward": 1}
    assert (trainer.num_cpus, reward.num_cpus) == (2, 1)
    assert reward.setup == ["echo reward-setup"]
    assert plan.nodes == 3
    rm = next(s for s in plan.services if s.name == "rm")
    assert rm.where == "group reward"
    assert json.loads(plan.to_json())["groups"][1]["resources"] == {"reward": 1}


def test_gpu_groups_carry_a_resource_of_their_gpu_type_and_recipes_count_gpu_nodes_only():
    data = grouped()
    data["job"] = {"recipe": "verl-ppo", "args": {}}
    data["groups"] = [{"name": "trainer", "nodes": 3, "resources": {"gpus": "H100:8"}},
                      {"name": "ref", "nodes": 1, "resources": {"gpus": "L40S:8"}},
                      {"name": "retriever", "nodes": 1, "resources": {"cpus": 8}}]
    plan = providers.get("dstack").build(parse_task(data))
    trainer, ref, retriever = plan.groups
    assert trainer.resources == {"trainer": 8, "h100": 8} and trainer.gpu_name == "H100"
    assert ref.resources == {"ref": 8, "l40s": 8} and ref.gpus_per_node == 8
    assert retriever.resources == {"retriever": 1} and retriever.gpus_per_node == 0
    assert plan.nodes == 5  # 3 + 1 + 1; verl is told of the 4 nodes with GPUs (the retriever's has none)
    assert "trainer.nnodes=4" in plan.job.entrypoint and "trainer.n_gpus_per_node=8" in plan.job.entrypoint


def test_a_task_without_groups_has_no_groups_in_its_plan_json(rlhf_home):
    plan = providers.get("local").plan(parse_task({"name": "plain", "nodes": 2, "job": JOB}))
    assert plan.groups == [] and "groups" not in json.loads(plan.to_json())


# ------------------------------------------------------------------ the node agent

def plan_dict(rlhf_home) -> dict:
    return json.loads(local_plan(grouped()).to_json())


def test_each_rank_finds_its_group(rlhf_home):
    plan = plan_dict(rlhf_home)
    assert [group_of(plan, rank)["name"] for rank in range(3)] == ["trainer", "trainer", "reward"]
    assert group_of({"nodes": 2}, 1) is None


def test_ray_start_carries_the_group_label_and_resources(rlhf_home):
    plan = plan_dict(rlhf_home)
    worker = ray_start_command(plan, NodeInfo(2, 3, "127.0.0.1", "127.0.0.3"), head=False)
    assert worker[worker.index("--labels") + 1] == "rlhf-tasks/group=reward"
    assert json.loads(worker[worker.index("--resources") + 1]) == {"reward": 1}
    assert worker[worker.index("--num-cpus") + 1] == "1"
    head = ray_start_command(plan, NodeInfo(0, 3, "127.0.0.1", "127.0.0.1"), head=True)
    assert head[head.index("--labels") + 1] == "rlhf-tasks/group=trainer"
    assert head[head.index("--num-cpus") + 1] == "2"
    plain = json.loads(providers.get("local").plan(parse_task({"name": "plain", "nodes": 2, "job": JOB})).to_json())
    assert "--labels" not in ray_start_command(plain, NodeInfo(1, 2, "127.0.0.1", "127.0.0.2"), head=False)


def test_group_placeholder_is_filled_where_the_addresses_are(rlhf_home):
    info = NodeInfo(2, 3, "10.0.0.1", "10.0.0.3")
    assert fill("{group} {node_addr} {head_addr}", info, "reward") == "reward 10.0.0.3 10.0.0.1"
    assert fill("{group}", info) == "{group}"  # a task without groups: left as written


def test_group_services_and_setup_run_on_the_groups_nodes(rlhf_home, tmp_path):
    plan = plan_dict(rlhf_home)
    started = {}
    for rank in range(3):
        node = Node(plan, NodeInfo(rank, 3, "127.0.0.1", "127.0.0.%d" % (rank + 1)), {}, str(tmp_path), str(tmp_path))
        started[rank] = [s["name"] for s in node.services_for(("head", "every_node") if rank == 0 else ("every_node",))]
    assert started == {0: [], 1: [], 2: ["rm"]}


def alive(*groups):
    return [{"node_id": str(i), "node_ip": "127.0.0.%d" % i, "labels": {"rlhf-tasks/group": g} if g else {},
             "resources_total": {"CPU": 1.0, g: 1.0} if g else {"CPU": 1.0}} for i, g in enumerate(groups)]


def test_readiness_waits_for_every_group_and_names_the_one_short(monkeypatch, rlhf_home):
    from rlhf_tasks.agent import protocol as module

    plan = plan_dict(rlhf_home)
    seen = {"nodes": alive("trainer", "trainer")}
    monkeypatch.setattr(module, "alive_nodes", lambda dashboard, token: seen["nodes"])
    check = groups_check("http://x", None, plan["groups"])
    done, said = check()
    assert not done and "group reward: 0 of 1 nodes" in said and "group trainer: 2 of 2 nodes" in said
    seen["nodes"] = alive("trainer", "trainer", None)  # a node without its label is not the reward group's
    assert not check()[0]
    seen["nodes"] = alive("trainer", "trainer", "reward")
    done, said = check()
    assert done and "group reward: 1 of 1 nodes" in said
    assert len(check.alive) == 3


# ------------------------------------------------------------------ a real local cluster

#: The job (a Ray driver on the head): each node's group, label and resources as Ray's own records say, a task
#: asking {"reward": 1} (and one by label_selector) run where they must, and the group's service and setup ran on
#: the reward group's node only.
GROUPS_DRIVER = r'''
import json, sys, time
from pathlib import Path
import ray

out = Path(sys.argv[1])
ray.init()
nodes = [n for n in ray.nodes() if n["Alive"]]
by_group = {}
for n in nodes:
    by_group.setdefault(n["Labels"].get("rlhf-tasks/group"), []).append(n)
assert sorted((g, len(v)) for g, v in by_group.items()) == [("reward", 1), ("trainer", 2)], by_group
for n in by_group["trainer"]:
    assert n["Resources"].get("trainer") == 1 and "reward" not in n["Resources"], n["Resources"]
(reward,) = by_group["reward"]
assert reward["Resources"].get("reward") == 1 and "trainer" not in reward["Resources"], reward["Resources"]

@ray.remote(num_cpus=0, resources={"reward": 1})
def on_reward():
    return ray.get_runtime_context().get_node_id()

@ray.remote(num_cpus=0, label_selector={"rlhf-tasks/group": "trainer"})
def on_trainer():
    return ray.get_runtime_context().get_node_id()

assert ray.get(on_reward.remote()) == reward["NodeID"]
trainers = set(ray.get([on_trainer.remote() for _ in range(6)]))
assert trainers <= {n["NodeID"] for n in by_group["trainer"]}, trainers
deadline = time.time() + 60  # the reward node starts its service once its raylet is up: maybe after the head saw it
while not (out / "service.txt").exists() and time.time() < deadline:
    time.sleep(0.2)
service = (out / "service.txt").read_text().split()
assert service == ["reward", reward["NodeManagerAddress"], "2"], (service, reward["NodeManagerAddress"])
setup = (out / "setup.txt").read_text().split()
assert setup == ["reward", "2"], setup
print("GROUPS-OK", json.dumps({g: [n["NodeManagerAddress"] for n in v] for g, v in by_group.items()}), flush=True)
'''



def test_after_a_loss_the_head_waits_for_each_group_whole_again_from_one_read_of_the_nodes(monkeypatch, rlhf_home):
    """Three nodes ALIVE again is not enough when the reward group's node is not among them: the head's wait
    after a loss names the short group, from the same list of nodes its count read (one read a poll)."""
    from rlhf_tasks.agent import jobrunner, protocol

    plan = plan_dict(rlhf_home)
    answers = [alive("trainer", "trainer", None), alive("trainer", "trainer", "reward")]
    reads, said = [], []

    def alive_nodes(dashboard, token):
        reads.append(1)
        return answers[0] if len(reads) <= 2 else answers[1]  # the first poll: its count and its lost-node lookup
    monkeypatch.setattr(protocol, "alive_nodes", alive_nodes)
    monkeypatch.setattr(jobrunner, "alive_nodes", alive_nodes)
    monkeypatch.setattr(protocol.time, "sleep", lambda s: None)
    real_wait_for = jobrunner.wait_for

    def wait_for(what, check, *args, **kwargs):
        def recorded():
            done, have = check()
            said.append(have)
            return done, have
        return real_wait_for(what, recorded, *args, **kwargs)
    monkeypatch.setattr(jobrunner, "wait_for", wait_for)
    runner = jobrunner.JobRunner.__new__(jobrunner.JobRunner)
    runner.node = type("N", (), {"dashboard": "http://d", "token": None, "ray_alive": staticmethod(lambda c: c)})()
    runner.plan = dict(plan, ray={"num_cpus": 1}, wait={"nodes_s": 60})
    runner.expected, runner.node_ids = {"0": "127.0.0.0", "1": "127.0.0.1", "2": "127.0.0.2"}, ["0", "1", "2"]
    runner.wait_for_every_node()
    assert "group reward: 0 of 1 nodes" in said[0] and "1 ALIVE without a group's label" in said[0], said
    assert "group reward: 1 of 1 nodes" in said[1] and "group trainer: 2 of 2 nodes" in said[1], said
    assert len(reads) == 4, reads  # poll 1: the count and the lost-node lookup; poll 2: the count; then the list

def test_groups_on_a_real_local_cluster(tmp_path, cli_env):
    import subprocess
    import sys

    (tmp_path / "driver.py").write_text(GROUPS_DRIVER)
    out = tmp_path / "out"
    out.mkdir()
    task = tmp_path / "groups.yaml"
    task.write_text(yaml.safe_dump({
        "name": "groups-e2e", "preflight": {"timeout": "90s", "torch": False}, "ray": {"object_store_memory": "80MB"},
        "wait": {"nodes": "2m"},
        "groups": [
            {"name": "trainer", "nodes": 2, "resources": {"cpus": 1}},
            {"name": "reward", "nodes": 1, "resources": {"cpus": 1},
             "setup": [f"echo {{group}} $RLHF_TASKS_NODE_RANK >> {out}/setup.txt"],
             "services": [{"name": "rm", "command": f"echo {{group}} {{node_addr}} $RLHF_TASKS_NODE_RANK >> "
                                                     f"{out}/service.txt; exec sleep 600"}]}],
        "job": {"recipe": "command", "submit": "head", "working_dir": None, "max_restarts": 0, "timeout": "3m",
                "args": {"entrypoint": f"python3 {tmp_path / 'driver.py'} {out}"}}}))
    done = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(task)], cwd=tmp_path, env=cli_env,
                          capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-6000:]
    assert "GROUPS-OK" in said, said[-6000:]
    nodes = Path(cli_env["RLHF_TASKS_HOME"]) / "runs" / "groups-e2e" / "nodes"
    logs = "".join(path.read_text() for path in sorted(nodes.glob("node-*.log")))
    assert "--labels rlhf-tasks/group=reward --resources '{\"reward\": 1}'" in logs
    assert "cluster ready: group trainer: 2 of 2 nodes; group reward: 1 of 1 nodes" in logs
    # preflight measured the link the weights would take, from the trainer's group into the reward group's node
    assert re.search(r"between groups: group trainer -> group reward: slowest node[01] -> node2 at [\d.]+ [GM]bit/s",
                     said), said[-6000:]
