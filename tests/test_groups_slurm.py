"""Node groups (issue 46) on Slurm: a heterogeneous job (sbatch(1)'s `#SBATCH hetjob` between components), one
component per group in the task's order, each its machine and its placement.slurm keys over the task's; one
step of agents over every component (`srun --het-group`), and the contract Slurm 22.05 gives that step (seen
on the tests' Slurm). tests/test_slurm_provider.py runs such a job on the real Slurm."""

from __future__ import annotations

import json
import re

import pytest

from rlhf_tasks import providers
from rlhf_tasks.agent.contract import read_contract
from rlhf_tasks.spec import parse_task

from test_groups import check_exit


def task(**extra) -> dict:
    data = {"name": "grp", "preflight": "off", "checkpoints": {"path": "/shared/ckpt"},
            "placement": {"max_duration": "2h", "slurm": {"partition": "gpu", "account": "proj"}},
            "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "echo hi"}},
            "groups": [{"name": "trainer", "nodes": 2, "resources": {"cpus": 4, "memory": "8GiB", "gpus": "H100:8"},
                        "placement": {"slurm": {"gpu_type": "h100", "constraint": "ib"}}},
                       {"name": "reward", "nodes": 1, "resources": {"cpus": 2},
                        "placement": {"slurm": {"partition": "cpu", "sbatch": ["--comment=rm"]}}}]}
    data.update(extra)
    return data


def script(data: dict) -> str:
    provider = providers.get("slurm")
    (text,) = provider.render(provider.plan(parse_task(data))).values()
    return text


def sbatch(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_one_component_per_group_the_jobs_own_options_in_the_first():
    lines = sbatch(script(task()))
    split = lines.index("hetjob")
    first, second = lines[:split], lines[split + 1:]
    assert first == ["--job-name=grp", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=4",
                     "--gpus-per-node=h100:8", "--mem=8G", "--exclusive", "--time=0-02:00:00", "--output=%x-%j.out",
                     "--export=ALL", "--no-requeue", "--partition=gpu", "--account=proj", "--constraint=ib"]
    # the group's partition over the task's, the task's account kept, its own sbatch; no GPUs, no constraint
    assert second == ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", "--exclusive", "--partition=cpu",
                      "--account=proj", "--comment=rm"]
    assert lines.count("hetjob") == 1


def test_one_step_of_agents_over_every_component():
    text = script(task())
    (step,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert step.startswith("srun --het-group=0-1 --kill-on-bad-exit=1 --whole"), step
    assert "--nodes=" not in step


def test_the_contract_reads_the_head_from_the_first_components_hosts(monkeypatch):
    """In the step, SLURM_NODEID counts component by component and SLURM_JOB_NODELIST is sorted by name: rank 0
    (on node1, the first component's) must find itself the head, not node0 (the second's)."""
    provider = providers.get("slurm")
    plan = provider.plan(parse_task(task()))
    contract = json.loads(plan.to_json())["contract"]
    env = {"SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[0-2]",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "node[1-2]", "SLURM_JOB_NODELIST_HET_GROUP_1": "node0"}

    def scontrol(argv, **kw):  # `scontrol show hostnames LIST`, in the order given
        assert argv[:3] == ["scontrol", "show", "hostnames"], argv
        hosts = []
        for part in re.findall(r"node\[[^]]*\]|node\d+", argv[3]):
            m = re.match(r"node\[(\d+)-(\d+)\]", part)
            hosts += [f"node{i}" for i in range(int(m[1]), int(m[2]) + 1)] if m else [part]
        return type("P", (), {"returncode": 0, "stdout": "\n".join(hosts) + "\n", "stderr": ""})()
    info = read_contract(contract, env, run=scontrol)
    assert (info.rank, info.nodes, info.head, info.peer) == (0, 3, "node1", "node2")


def test_a_task_without_groups_renders_one_component():
    data = task()
    del data["groups"]
    data.update(nodes=2, resources={"cpus": 4})
    text = script(data)
    assert "hetjob" not in text and "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in text


@pytest.mark.parametrize("change, said", [
    ({"placement": {"slurm": {"partitoin": "x"}}}, "groups[1].placement.slurm.partitoin"),
    ({"placement": {"slurm": {"sbatch": ["--nodes=4"]}}}, "groups[1].placement.slurm.sbatch[0]: --nodes=4 fights "
                                                            "the script's own #SBATCH --nodes=1 (from groups[1].nodes)"),
    ({"resources": {"gpus": "80GB:1"}}, "groups[1].resources.gpus: 80GB:1: Slurm asks for GPUs by the type names"),
    ({"image": "other:1"}, "groups: the groups name 2 images"),
])
def test_a_groups_faults_are_named_with_its_fields(change, said, tmp_path, capsys, rlhf_home):
    data = task()
    data["groups"][1].update(change)
    code, out = check_exit(tmp_path, capsys, data, "--provider", "slurm")
    assert code == 2 and said in out, out


def test_check_notes_a_groups_gpu_type_slurm_is_not_told(tmp_path, capsys, rlhf_home):
    data = task()
    data["groups"][1]["resources"] = {"cpus": 2, "gpus": "L40S:1"}
    code, out = check_exit(tmp_path, capsys, data, "--provider", "slurm")
    assert code == 0, out
    assert "groups[1].resources.gpus: the script asks Slurm for 1 GPU(s) of any type per node" in out
    assert "give groups[1].placement.slurm.gpu_type" in out and "groups[0].resources.gpus" not in out, out


def test_in_a_container_the_host_list_is_every_components_in_their_order():
    """No scontrol in the image: the script expands the hosts once, component by component, so that item 0 is the
    head (the first component's first host) for the container's contract."""
    data = task(image="verlai/verl:latest")
    data["placement"]["slurm"]["container"] = "pyxis"
    text = script(data)
    assert ('RLHF_TASKS_HOSTS=$(scontrol show hostnames '
            '"$SLURM_JOB_NODELIST_HET_GROUP_0,$SLURM_JOB_NODELIST_HET_GROUP_1" | paste -sd, -)') in text, text[:3000]
