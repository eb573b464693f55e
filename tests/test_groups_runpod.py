"""Node groups (issue 46) on RunPod: pods per group in one Global Networking group, each its group's GPU type and
count, image and disk, its RAY_WORKER the rank its agent finds its group by (agent/contract.py group_of); an
Instant Cluster, one GPU type on every node (CreateClusterRequest.compute), refused for groups of mixed types."""

from __future__ import annotations

import json

from rlhf_tasks import providers
from rlhf_tasks.spec import parse_task

import pytest

from rlhf_tasks.providers.runpod.render import DEFAULT_IMAGE as DEFAULT

from test_groups import check_exit
from test_runpod_provider import KEY, home, standin  # noqa: F401 (fixtures: the strict stand-in)


def task(**extra) -> dict:
    data = {"name": "grp", "preflight": "off", "network": "runpod-global",
            "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "echo hi"}},
            "groups": [{"name": "trainer", "nodes": 2, "resources": {"gpus": "H100:8", "disk": "200GB"}},
                       {"name": "reward", "nodes": 2, "resources": {"gpus": "L40S:1"}, "image": "rm:1"},
                       {"name": "retriever", "nodes": 1, "resources": {"cpus": 4}}]}
    data.update(extra)
    return data


def requests(data: dict) -> dict:
    provider = providers.get("runpod")
    plan = provider.plan(parse_task(data))
    return json.loads(provider.render(plan)["grp.runpod.json"])


def test_each_groups_pods_get_its_gpu_type_count_image_and_their_ranks_in_its_range(rlhf_home):
    doc = requests(task())
    pods = [doc["head"], *doc["workers"]]
    assert [p["name"] for p in pods] == ["grp-head", "grp-worker-1", "grp-worker-2", "grp-worker-3", "grp-worker-4"]
    assert [(p["gpu"]["id"], p["gpu"]["count"]) for p in pods] == [
        ("NVIDIA H100 80GB HBM3", 8), ("NVIDIA H100 80GB HBM3", 8), ("NVIDIA L40S", 1), ("NVIDIA L40S", 1),
        ("NVIDIA A40", 1)]
    assert [p["env"]["RAY_WORKER"] for p in pods] == ["0", "1", "2", "3", "4"]
    assert {p["env"]["EXPECTED_WORKERS"] for p in pods} == {"4"}
    assert "HEAD_POD_ID" not in pods[0]["env"] and all(p["env"]["HEAD_POD_ID"] == "${HEAD_POD_ID}" for p in pods[1:])
    assert [p["image"] for p in pods][2:4] == ["rm:1", "rm:1"] and pods[0]["image"].startswith("runpod/pytorch")
    assert [p.get("disk") for p in pods] == [200, 200, None, None, None]
    assert all(p["globalNetworking"] is True for p in pods)
    assert "groups retriever have no resources.gpus" in doc["note"]


def test_a_task_without_groups_renders_one_gpu_type_for_every_pod(rlhf_home):
    data = task()
    del data["groups"]
    data.update(nodes=2, resources={"gpus": "H100:8"})
    doc = requests(data)
    assert [p["gpu"] for p in (doc["head"], *doc["workers"])] == [{"id": "NVIDIA H100 80GB HBM3", "count": 8}] * 2


def test_an_instant_cluster_of_groups_of_mixed_gpu_types_is_refused_naming_the_group(rlhf_home, tmp_path, capsys):
    code, out = check_exit(tmp_path, capsys, task(network="runpod-cluster"), "--provider", "runpod")
    assert code == 2
    assert "groups[1].resources.gpus" in out and "one GPU type" in out and "runpod-global" in out


def test_an_instant_cluster_of_groups_of_one_gpu_type_is_one_cluster_of_it(rlhf_home):
    data = task(network="runpod-cluster")
    data["groups"] = [{"name": "a", "nodes": 2, "resources": {"gpus": "H100:8"}},
                      {"name": "b", "nodes": 1, "resources": {"gpus": "H100:8"}}]
    body = requests(data)["cluster"]
    assert body["compute"] == {"gpuTypeId": "NVIDIA H100 80GB HBM3", "gpuCountPerPod": 8, "podCount": 3}


def test_launch_creates_each_groups_pods_in_one_data_center_and_prices_each_group_by_its_type(standin, home, capsys):
    """Against the strict stand-in: the create requests per group (GPU type, count, image, RAY_WORKER the group's
    ranks, globalNetworking), every pod in the head's data center, and the cap's price each group's own."""
    from rlhf_tasks.providers.runpod import catalog, pods
    from rlhf_tasks.providers.runpod.api import RunPodClient
    from rlhf_tasks import state

    client = RunPodClient(KEY, base_url=standin.url)
    data = task(name="rp-groups")
    data["groups"] = [{"name": "trainer", "nodes": 2, "resources": {"gpus": "A40:1"}},
                      {"name": "reward", "nodes": 1, "resources": {"gpus": "A40:2"}, "image": "rm:1"}]
    provider = providers.get("runpod")
    plan = provider.plan(parse_task(data))
    fit = catalog.fit_groups(client, plan)
    assert [g[:4] for g in fit["groups"]] == [("trainer", 2, "NVIDIA A40", 1), ("reward", 1, "NVIDIA A40", 2)]
    each = {name: price for name, _, _, _, price in fit["groups"]}
    assert fit["total"] == pytest.approx(2 * each["trainer"] + each["reward"]) and each["reward"] == 2 * each["trainer"]
    catalog.announce(plan, fit, None)
    out = capsys.readouterr().out
    assert "group trainer: 2 pod(s) x 1x NVIDIA A40" in out and "group reward: 1 pod(s) x 2x NVIDIA A40" in out
    requests = json.loads(provider.render(plan)["rp-groups.runpod.json"])
    before = state.before_launch(plan.name, state.run_dir(plan.name) / "runpod")
    state.save(plan.name, {"provider": "runpod", "pods": []})
    with pods.Launching(client, plan.name, before) as launching:
        members = pods.create(client, plan, requests, {}, fit["datacenters"], launching)
    creates = [r.body for r in standin.requests if r.method == "POST" and r.path == "/v2/pods"]
    assert [(b["name"], b["gpu"], b["image"], b["env"]["RAY_WORKER"], b["globalNetworking"]) for b in creates] == [
        ("rp-groups-head", {"id": "NVIDIA A40", "count": 1}, DEFAULT, "0", True),
        ("rp-groups-worker-1", {"id": "NVIDIA A40", "count": 1}, DEFAULT, "1", True),
        ("rp-groups-worker-2", {"id": "NVIDIA A40", "count": 2}, "rm:1", "2", True)]
    head_id = members[0]["id"]
    assert [b["env"].get("HEAD_POD_ID") for b in creates] == [None, head_id, head_id]
    assert len({m["dataCenterId"] for m in members}) == 1
    client.close()
