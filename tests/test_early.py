"""Preflight's checks run by the node agents as each node comes up (issue 31): real sockets on
loopback addresses, the agents' own probe servers and the head's EarlyChecks; no Ray."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from rlhf_tasks.agent import early, preflight
from rlhf_tasks.agent.schedule import REACH_DISTANCES, REACH_SAMPLE_ROUNDS, partners, schedule

TOKEN = "t0k"


def wait(check, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("not so within %.0fs" % timeout)


def servers(count, env=None):
    return [early.ProbeServer("127.0.0.%d" % (rank + 1), dict(env or {}), rank, TOKEN) for rank in range(count)]


def checks_for(tmp_path, count, budget=0.05):
    return early.EarlyChecks(str(tmp_path / early.EARLY_FILE), count, TOKEN, budget, 1 << 22,
                             partners(count, schedule(count, REACH_DISTANCES, REACH_SAMPLE_ROUNDS)),
                             schedule(count, (1, 2), 2))


def test_each_node_is_checked_as_it_arrives_so_the_last_leaves_only_its_own_share(tmp_path):
    probes = servers(4, {"GLOO_SOCKET_IFNAME": "lo"})
    checks = checks_for(tmp_path, 4)
    for probe in probes[:3]:
        checks.add(probe.hello())
    # Before the last node is there, everything among the first three is measured: 3 pairs both ways, 6 connections.
    record = wait(lambda: (lambda r: r if r and len(r["pairs"]) == 6 and len(r["reach"]) == 6 else None)(
        early.read(checks.path)))
    assert not record["complete"] and record["pairs_pending"] == 3
    assert all(p["bits_per_s"] > 0 and not p.get("error") for p in record["pairs"])
    assert {(p["src"], p["dst"]) for p in record["pairs"]} == {(a, b) for a in range(3) for b in range(3) if a != b}
    checks.add(probes[3].hello())
    record = wait(lambda: (lambda r: r if r and r["complete"] else None)(early.read(checks.path)))
    late = [p for p in record["pairs"] if 3 in (p["src"], p["dst"])]
    assert len(record["pairs"]) == 12 and len(late) == 6 and min(p["round"] for p in late) > 1
    assert len(record["reach"]) == 12 and not any(why for *_, why in record["reach"])
    assert record["nodes"]["3"]["info"]["gloo_if"]["iface"] == "lo" and record["nodes"]["3"]["info"]["rank"] == "3"


def test_a_node_whose_probe_cannot_listen_on_its_collective_address_is_an_error_naming_it(tmp_path):
    probes = servers(2)
    checks = checks_for(tmp_path, 2)
    hello = probes[1].hello()
    hello["info"]["gloo_if"]["address"] = "192.0.2.1"  # an address this machine does not have
    checks.add(probes[0].hello())
    checks.add(hello)
    record = wait(lambda: (lambda r: r if r and (r["complete"] or r["errors"]) else None)(early.read(checks.path)))
    assert record["errors"] and "node1's probe at 127.0.0.2" in record["errors"][0] and not record["complete"]


def test_the_probe_server_and_the_beacon_refuse_another_clusters_token(tmp_path):
    probe = servers(1)[0]
    with pytest.raises(OSError, match="not the cluster's token"):
        early.call(probe.address, probe.port, "wrong", "listen", [probe.address])
    assert early.call(probe.address, probe.port, TOKEN, "listen", [probe.address])[probe.address] > 0
    checks = checks_for(tmp_path, 2)
    checks.add(dict(probe.hello(), token="wrong"))
    assert checks.nodes == {}


def test_preflight_falls_back_to_its_own_probes_for_a_node_that_never_announced_itself(tmp_path):
    path = tmp_path / early.EARLY_FILE
    path.write_text(json.dumps({"nodes_expected": 2, "complete": True, "errors": [],
                                "nodes": {"0": {"address": "10.0.0.1"}, "1": {"address": "10.0.0.2"}}}))
    driver = preflight.Preflight(argparse.Namespace(wait_nodes=0, timeout=30, early=str(path)))
    driver.nodes = [{"label": "10.0.0.1"}, {"label": "10.0.0.3"}]  # Ray's view: 10.0.0.3 started elsewhere
    assert driver.early_record() is None
    driver.nodes = [{"label": "10.0.0.1"}, {"label": "10.0.0.2"}]
    assert driver.early_record()["complete"]
