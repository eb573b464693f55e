"""Node groups (issue 46), preflight between groups: the slowest stream from the trainer's group (the first) into
each other group is what a weight sync to it waits for; said with the sync's time, and below
preflight.min_bandwidth a failure naming both groups (within a group a slow link stays a warning)."""

from __future__ import annotations

import argparse

import pytest

from rlhf_tasks.agent import preflight
from rlhf_tasks.agent.grouplinks import group_links


def nodes(*groups):
    return [{"name": "node%d" % i, "label": "node%d" % i, "rank": i, "group": g} for i, g in enumerate(groups)]


def pair(src, dst, mbit):
    return {"src": "node%d" % src, "dst": "node%d" % dst, "src_index": src, "dst_index": dst,
            "bits_per_s": mbit * 1e6, "bytes": 1, "seconds": 1.0}


PAIRS = [pair(0, 1, 900), pair(1, 0, 900), pair(0, 2, 400), pair(2, 0, 50), pair(1, 2, 300), pair(2, 1, 40),
         pair(0, 3, 800), pair(1, 3, 700)]


def test_each_groups_link_is_the_slowest_stream_from_the_first_group_into_it():
    links = group_links(nodes("trainer", "trainer", "reward", "ref"), PAIRS)
    assert [(l["src_group"], l["dst_group"], l["pair"]["src"], l["pair"]["dst"]) for l in links] == [
        ("trainer", "reward", "node1", "node2"), ("trainer", "ref", "node1", "node3")]
    assert group_links(nodes("a", "a", None, "b"), PAIRS) == [] and group_links(nodes("a", "a", "a", "a"), PAIRS) == []


def verdict(groups, threshold_mbit, capsys):
    check = preflight.Preflight.__new__(preflight.Preflight)
    check.args = argparse.Namespace(min_bandwidth_bits=threshold_mbit * 1e6, model="Qwen/Qwen2.5-7B",
                                    weight_bytes=15e9)
    check.nodes, check.pairs, check.collectives, check.warnings = nodes(*groups), PAIRS, {}, []
    check.bandwidth_verdict()
    return check.warnings, capsys.readouterr().out


def test_below_the_threshold_between_groups_fails_naming_them_with_the_weight_syncs_time(capsys):
    with pytest.raises(preflight.Failed) as failed:
        verdict(("trainer", "trainer", "reward", "ref"), 350, capsys)
    assert failed.value.step == "groups"
    assert "group trainer -> group reward: slowest node1 -> node2 at 300 Mbit/s, below the 350 Mbit/s" in str(failed.value)
    assert "one bf16 copy of Qwen/Qwen2.5-7B (~15 GB) takes ~" in str(failed.value)


def test_above_it_the_groups_links_are_said_and_a_slow_link_inside_a_group_stays_a_warning(capsys):
    # node2 -> node1 at 40 Mbit/s is inside group trainer (and a reverse link): a warning, not the groups' failure
    warnings, out = verdict(("trainer", "trainer", "trainer", "ref"), 100, capsys)
    assert "between groups: group trainer -> group ref: slowest node1 -> node3 at 700 Mbit/s" in out, out
    assert warnings and warnings[0].startswith("low bandwidth:")
