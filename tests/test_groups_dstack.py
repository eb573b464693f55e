"""Node groups (issue 46) on dstack: the task's `groups:` as dstack 0.22.5's own (core/models/configurations.py
NodeGroup: name, nodes, resources, commands, ports), one per group in the task's order, judged by dstack's own
parser; the fleet that fits them all; what dstack keeps for the run (the image, its user, the SSH fleet, one
max_price), refused per group naming the field; dstack's no-offer answer naming the group. The real dstack
server runs such a task on hosts that differ in tests/test_dstack_cluster.py
(test_the_tasks_working_dir_reaches_the_job)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.agent.contract import group_of, read_contract
from rlhf_tasks.errors import BadInput
from rlhf_tasks.providers.dstack.dstack_api import plan_summary
from rlhf_tasks.spec import parse_task

from conftest import need
from test_groups import check_exit


def task(**extra) -> dict:
    data = {"name": "grp", "preflight": "off",
            "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "echo hi"}},
            "groups": [{"name": "trainer", "nodes": 2, "resources": {"cpus": 4, "memory": "64GiB", "gpus": "H100:8",
                                                                     "shm_size": "16GiB"}},
                       {"name": "reward", "nodes": 1, "resources": {"cpus": 2, "exact": ["cpus"]}}]}
    data.update(extra)
    return data


def rendered(data: dict) -> tuple[dict, dict]:
    """The task configuration and the fleet, as rendered (data)."""
    provider = providers.get("dstack")
    files = provider.render(provider.plan(parse_task(data)))
    return yaml.safe_load(files["grp.dstack.yml"]), yaml.safe_load(files["grp-fleet.dstack.yml"])


def test_each_group_is_a_dstack_node_group_in_the_tasks_order_with_its_own_resources(rlhf_home):
    config, _ = rendered(task())
    assert [(g["name"], g["nodes"]) for g in config["groups"]] == [("trainer", 2), ("reward", 1)]
    trainer, reward = config["groups"]
    assert trainer["resources"] == {"shm_size": "16GB", "memory": "64GB..", "disk": "50GB..", "gpu": "H100:8",
                                    "cpu": "4.."}
    assert reward["resources"] == {"disk": "50GB..", "cpu": "2"}  # resources.exact: exactly 2
    # dstack refuses top-level commands and ports beside groups, and takes nodes from them
    assert not {"nodes", "commands", "ports", "resources"} & set(config), config


def test_only_the_first_group_forwards_the_dashboard_port(rlhf_home):
    config, _ = rendered(task())
    assert [g.get("ports") for g in config["groups"]] == [[8265], None]


def test_every_group_runs_the_node_agent_under_set_e(rlhf_home):
    config, _ = rendered(task())
    for group in config["groups"]:
        (script,) = group["commands"]
        assert script.startswith("set -e\n") and "rlhf_tasks/agent/__main__.py --plan" in script, script


def test_dstacks_job_numbers_are_the_plans_ranks_so_each_node_finds_its_group(rlhf_home):
    """dstack numbers a run's jobs across its groups in their order (configurators/task.py get_job_specs) and
    gives each DSTACK_NODE_RANK = its job number, DSTACK_NODES_NUM = the run's job count: the agent's contract
    reads them, and job 2 (the reward group's first) is rank 2 of the plan's reward group."""
    provider = providers.get("dstack")
    plan = provider.plan(parse_task(task()))
    assert [(g.name, g.first_rank) for g in plan.groups] == [("trainer", 0), ("reward", 2)]
    plan_data = yaml.safe_load(plan.to_json())
    env = {"DSTACK_NODE_RANK": "2", "DSTACK_NODES_NUM": "3", "DSTACK_MASTER_NODE_IP": "10.0.0.1",
           "DSTACK_NODES_IPS": "10.0.0.1\n10.0.0.2\n10.0.0.3", "DSTACK_RUN_NAME": "grp", "DSTACK_GPUS_PER_NODE": "0"}
    info = read_contract(plan_data["contract"], env)
    assert (info.rank, info.nodes, info.head) == (2, 3, "10.0.0.1")
    assert group_of(plan_data, info.rank)["name"] == "reward"


def _dstack_parse():
    try:
        from dstack._internal.core.models.configurations import parse_apply_configuration
    except ImportError:
        need(False, "the dstack package (pip install 'rlhf-tasks[dstack]')")
    return parse_apply_configuration


def test_dstacks_own_parser_takes_the_groups_and_counts_every_node(rlhf_home):
    parse = _dstack_parse()
    config, fleet = rendered(task(image="rlhf/trainer:1", placement={"dstack": {"user": "root"}}))
    parsed = parse(config)
    assert [g.name for g in parsed.node_groups] == ["trainer", "reward"] and parsed.nodes_num == 3
    assert parsed.image == "rlhf/trainer:1" and parsed.nodes is None
    assert str(parsed.node_groups[1].resources.cpu.count) == "2"  # exactly 2: dstack's own Range
    assert parsed.node_groups[0].resources.cpu.count.min == 4 and parsed.node_groups[0].resources.cpu.count.max is None
    assert parse(fleet).nodes.max == 3


def test_a_groups_cpu_architecture_is_its_resources(rlhf_home):
    data = task(image="rlhf/multi-arch:1", placement={"dstack": {"user": "root", "cpu_arch": "x86"}})
    data["groups"][1]["placement"] = {"dstack": {"cpu_arch": "arm"}}
    config, _ = rendered(data)
    assert [g["resources"]["cpu"] for g in config["groups"]] == ["x86:4..", "arm:2"]
    parsed = _dstack_parse()(config)
    assert [g.resources.cpu.arch.value for g in parsed.node_groups] == ["x86", "arm"]


def test_the_cloud_fleet_fits_every_group_and_max_price_bounds_each_instance(rlhf_home):
    """The fleet asks no resources (dstack combines a fleet's with each job's: a fleet without any is unconstrained,
    server/services/fleets.py get_fleet_requirements) and holds every group's nodes; dstack's one max_price per
    instance is the cluster's price over all of them."""
    config, fleet = rendered(task(placement={"price_per_hour": 9.0}))
    assert fleet["nodes"] == {"min": 0, "max": 3} and "resources" not in fleet, fleet
    assert config["max_price"] == fleet["max_price"] == 3.0


def test_check_says_one_max_price_holds_every_group(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, task(placement={"price_per_hour": 9.0}), "--provider", "dstack")
    assert code == 0, out
    assert "dstack's max_price is one bound on every instance of the run, each node group's alike" in out, out
    assert "$3/h, the cluster's $9/h over its 3 nodes" in out, out


def test_groups_priced_each_bound_every_instance_at_the_dearest_groups_node(tmp_path, capsys, rlhf_home):
    data = task()
    data["groups"][0]["price_per_hour"], data["groups"][1]["price_per_hour"] = 24.0, 1.5
    config, fleet = rendered(data)
    assert config["max_price"] == fleet["max_price"] == 24.0
    code, out = check_exit(tmp_path, capsys, data, "--provider", "dstack")
    assert code == 0, out
    assert "groups[i].price_per_hour: dstack's max_price is one bound on every instance of the run " \
        "(offers.max_price): $24/h, the dearest group's node" in out, out
    assert "$49.50/h for the cluster (groups[i].price_per_hour per node: trainer 2 x $24.00 + reward 1 x $1.50" in out


def test_an_ssh_fleet_with_groups_is_the_tasks_hosts(rlhf_home):
    ssh = {"hosts": ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "user": "root", "identity_file": "~/.ssh/id_rsa"}
    config, fleet = rendered(task(placement={"dstack": {"ssh": ssh}}))
    assert fleet["ssh_config"]["hosts"] == ssh["hosts"] and config["fleets"] == ["grp-fleet"]
    assert len(config["groups"]) == 2


@pytest.mark.parametrize("index, change, said", [
    (1, {"image": "rm:1"}, "groups[1].image: rm:1 is not the image of group trainer (trainer:1): dstack 0.22.5 runs "
                           "every node group's jobs in the task configuration's one image"),
    (1, {"placement": {"dstack": {"ssh": {"hosts": ["h"], "user": "root", "identity_file": "k"}}}},
     "groups[1].placement.dstack.ssh: the fleet's hosts are the run's"),
    (0, {"placement": {"dstack": {"user": "1000"}}}, "groups[0].placement.dstack.user: dstack's `user:` is the task "
                                                     "configuration's"),
    (1, {"placement": {"dstack": {"registry_auth": {"username": "u", "password_secret": "P"}}}},
     "groups[1].placement.dstack.registry_auth: dstack's `registry_auth:`"),
    (1, {"placement": {"dstack": {"cpu_arc": "arm"}}}, "groups[1].placement.dstack.cpu_arc"),
    (1, {"resources": {"gpus": "H1000:8"}}, "groups[1].resources.gpus: H1000:8: dstack 0.22.5 renders GPU name "
                                           "'H1000', which no dstack offer carries"),
])
def test_what_dstack_keeps_for_the_run_is_refused_per_group_naming_the_field(index, change, said, tmp_path, capsys,
                                                                            rlhf_home):
    data = task(image="trainer:1")
    data["groups"][index].update(change)
    code, out = check_exit(tmp_path, capsys, data, "--provider", "dstack")
    assert code == 2 and said in out, out


def test_a_groups_cpu_architecture_needs_an_image(tmp_path, capsys, rlhf_home):
    data = task()
    data["groups"][1]["placement"] = {"dstack": {"cpu_arch": "arm"}}
    code, out = check_exit(tmp_path, capsys, data, "--provider", "dstack")
    assert code == 2 and "groups[1].placement.dstack.cpu_arch: it is for a custom image" in out, out


def test_the_groups_one_image_is_the_runs(rlhf_home):
    data = task()
    for group in data["groups"]:
        group["image"] = "rlhf/same:1"
    config, _ = rendered(data)
    assert config["image"] == "rlhf/same:1"


def test_dstacks_plan_names_each_jobs_group(rlhf_home):
    """dstack_api.py's plan: each job's node group as dstack's JobSpec names it (node_group_name)."""
    def job_plan(name, group, offers):
        spec = SimpleNamespace(job_name=name, node_group_name=group, requirements=SimpleNamespace(
            pretty_format=lambda resources_only: f"{group}'s resources"))
        return SimpleNamespace(job_spec=spec, offers=[object()] * offers, total_offers=offers, max_price=None)
    plans = [job_plan("grp-0-0", "trainer", 1), job_plan("grp-0-1", "trainer", 1), job_plan("grp-0-2", "reward", 0)]
    client = SimpleNamespace(runs=SimpleNamespace(get_run_plan=lambda **kw: SimpleNamespace(job_plans=plans)))
    configuration = SimpleNamespace(model_copy=lambda deep: SimpleNamespace(env=None, files=None))
    jobs = plan_summary(client, configuration)["jobs"]
    assert [(j["group"], j["offers"]) for j in jobs] == [("trainer", 1), ("trainer", 1), ("reward", 0)]


def test_no_offer_for_a_group_names_it_before_anything_is_submitted(rlhf_home):
    provider = providers.get("dstack")
    plan = provider.plan(parse_task(task()))
    answer = {"jobs": [{"group": "trainer", "offers": 3, "requirements": "cpu=4.. gpu=H100:8"},
                       {"group": "trainer", "offers": 3, "requirements": "cpu=4.. gpu=H100:8"},
                       {"group": "reward", "offers": 0, "requirements": "cpu=2"}], "fleets": ["grp-fleet"]}
    with pytest.raises(BadInput) as caught:
        provider.refuse_without_offers(plan, answer, "grp.dstack.yml")
    said = str(caught.value)
    assert "no offer for 1 of its 3 jobs (group reward, groups[1].resources: cpu=2) on the fleets grp-fleet" in said
    assert "then change groups[1].resources (amounts are minimums unless in resources.exact)" in said, said
