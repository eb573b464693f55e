"""Node groups (issue 46, item 5): each group's price per node (`groups[i].price_per_hour`), the cluster's their
sum, which the head's cap counts (placement.max_cost), and what `check` says of the split: each group's price and
what it saves against every node at the dearest group's price (one node type for all roles)."""

from __future__ import annotations

import json

import pytest

from rlhf_tasks import providers
from rlhf_tasks.providers.dstack.offers import max_price
from rlhf_tasks.spec import parse_task

from test_groups import check_exit, grouped, problems


def priced(trainer=24.0, reward=4.0, **extra) -> dict:
    data = grouped(**extra)
    data["groups"][0]["price_per_hour"] = trainer
    data["groups"][1]["price_per_hour"] = reward
    return data


def test_the_cluster_costs_the_groups_sum_and_the_head_counts_it(rlhf_home):
    plan = providers.get("slurm").plan(parse_task(priced(placement={"max_cost": 26.0})))
    assert plan.task_price == 52.0 and plan.node_price_bound == 24.0
    budget = json.loads(plan.to_json())["budget"]  # what the head agent reads and counts its cap against
    assert budget["price_per_hour"] == 52.0 and budget["max_cost"] == 26.0


def test_check_prints_each_groups_price_and_what_the_split_saves(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, priced(placement={"max_cost": 26.0}), "--provider", "slurm")
    assert code == 0, out
    assert "group     trainer: 2 node(s) x no GPU, 2 CPU(s) each, $24.00/h each" in out, out
    assert ("$52.00/h for the cluster (groups[i].price_per_hour per node: trainer 2 x $24.00 + reward 1 x $4.00; "
            "every node at trainer's $24.00/h would be $72.00/h: the groups save $20.00/h (28%)") in out, out
    assert "the head stops the job at $26.00 (placement.max_cost, after 0 h 30 m)" in out, out


def test_groups_of_one_price_save_nothing_and_say_no_saving(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, priced(reward=24.0), "--provider", "slurm")
    assert code == 0, out
    assert "trainer 2 x $24.00 + reward 1 x $24.00)" in out and "groups save" not in out, out


@pytest.mark.parametrize("change, field, words", [
    (lambda d: d["groups"][1].pop("price_per_hour"), "groups[1].price_per_hour",
     "group reward has no price per node, and another group has one"),
    (lambda d: d.update(placement={"price_per_hour": 50.0}), "placement.price_per_hour",
     "the groups give their prices per node (groups[i].price_per_hour) and the cluster's is their sum"),
])
def test_a_partial_or_doubled_price_is_refused_naming_the_field(change, field, words, tmp_path, capsys, rlhf_home):
    data = priced()
    change(data)
    assert field in problems(data) and words in problems(data)
    code, out = check_exit(tmp_path, capsys, data, "--provider", "slurm")
    assert code == 2 and field in out, out


def test_a_cap_without_prices_asks_for_each_groups(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, grouped(placement={"max_cost": 10.0}), "--provider", "slurm")
    assert code == 2, out
    assert "placement.max_cost" in out and "each group's price_per_hour (US dollars per hour for each of its nodes)" \
        in out, out


def test_a_task_without_groups_keeps_its_price_split_over_its_nodes(rlhf_home):
    data = {"name": "flat", "nodes": 4, "preflight": "off", "placement": {"price_per_hour": 10.0},
            "job": grouped()["job"]}
    plan = providers.get("slurm").plan(parse_task(data))
    assert plan.task_price == 10.0 and plan.node_price_bound == 2.5 and max_price(plan) == 2.5


def test_dstacks_bound_on_each_instance_is_the_dearest_groups_price_per_node(rlhf_home):
    """dstack's max_price filters every instance's offer (offers.max_price): with groups, no node may cost more than
    the dearest group's node, and the cheaper group's nodes are not held to its price (dstack has one bound)."""
    plan = providers.get("slurm").plan(parse_task(priced(trainer=24.00001)))
    assert max_price(plan) == 24.0001


def test_runpod_counts_its_own_price_and_says_the_groups_are_ignored(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, priced(), "--provider", "runpod")
    assert code == 0, out
    assert "groups[i].price_per_hour: ignored on runpod: RunPod's own price is counted" in out, out
