"""Node groups (issue 46) on KubeRay: a worker group per node group, in KubeRay's own heterogeneous form
(v1.6.2's group `labels` and `resources`, common/pod.go), each its group's machine, image and placement. The
real operator runs such a render in tests/test_kuberay_options_cluster.py."""

from __future__ import annotations

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.spec import parse_task

from test_groups import check_exit

H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def task(**extra) -> dict:
    data = {"name": "grp", "preflight": "off",
            "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "echo hi"}},
            "placement": {"kuberay": {"node_selector": {"pool": "gpu"}, "tolerations": [{"key": "gpu"}]}},
            "groups": [{"name": "trainer", "nodes": 3, "resources": {"cpus": 4, "memory": "8GB", "gpus": "H100:8"},
                        "placement": {"kuberay": {"node_selector": H100}}},
                       {"name": "reward", "nodes": 1, "resources": {"cpus": 2, "memory": "4GB"}, "image": "rm:1",
                        "services": [{"name": "rm", "command": "sleep 1", "timeout": "7m"}]}]}
    data.update(extra)
    return data


def rayjob(data: dict) -> dict:
    provider = providers.get("kuberay")
    (text,) = provider.render(provider.plan(parse_task(data))).values()
    return next(doc for doc in yaml.safe_load_all(text) if doc["kind"] == "RayJob")


def env_of(spec: dict) -> dict:
    (container,) = spec["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_the_head_is_the_first_groups_first_node_and_each_group_a_worker_group_of_its_other_nodes(rlhf_home):
    cluster = rayjob(task())["spec"]["rayClusterSpec"]
    head, workers = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert head["labels"] == {"rlhf-tasks/group": "trainer"}
    assert head["resources"] == {"trainer": "8", "h100": "8", "cpu": "4"}
    assert [(w["groupName"], w["replicas"], w["minReplicas"], w["maxReplicas"]) for w in workers] == \
        [("trainer", 2, 2, 2), ("reward", 1, 1, 1)]
    trainer, reward = workers
    assert reward["labels"] == {"rlhf-tasks/group": "reward"} and reward["resources"] == {"reward": "1", "cpu": "2"}
    # the rank each pod's agent finds its group by: 0 the head, 1 the trainers' workers, 3 the reward group's
    assert [env_of(s)["RLHF_TASKS_RANK"] for s in (head, trainer, reward)] == ["0", "1", "3"]
    assert {env_of(s)["RLHF_TASKS_WORKER_REPLICAS"] for s in (head, trainer, reward)} == {"3"}


def test_each_group_is_its_own_machine_image_and_placement_over_the_tasks(rlhf_home):
    cluster = rayjob(task())["spec"]["rayClusterSpec"]
    head, (trainer, reward) = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    (h,), (t,), (r,) = (s["template"]["spec"]["containers"] for s in (head, trainer, reward))
    assert t["resources"]["limits"] == {"cpu": "4", "memory": "8G", "nvidia.com/gpu": "8"}
    assert h["resources"]["limits"]["nvidia.com/gpu"] == "8" and h["resources"]["limits"]["cpu"] == "3500m"
    assert r["resources"]["limits"] == {"cpu": "2", "memory": "4G"} and r["image"] == "rm:1"
    assert t["image"] == h["image"] == "rayproject/ray:2.60.0"
    # the group's node_selector key over the task's: the trainer's replaces it, the reward group keeps it
    assert head["template"]["spec"]["nodeSelector"] == trainer["template"]["spec"]["nodeSelector"] == H100
    assert reward["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert [t["key"] for t in reward["template"]["spec"]["tolerations"]] == ["gpu"]
    # the reward group's own service counts in its startup probe (7 minutes), not in the trainers'
    periods = [c["startupProbe"]["failureThreshold"] for c in (t, r)]
    assert periods[1] - periods[0] == 42, periods


def test_a_groups_cpus_are_rays_through_the_groups_resources_as_kuberay_takes_them(rlhf_home):
    """Without groups the task's CPUs go to rayStartParams' num-cpus; beside group resources KubeRay refuses
    that (utils/validation.go), so a group's CPUs are its resources' `cpu`."""
    spec = rayjob(task())["spec"]["rayClusterSpec"]
    assert [(g["resources"].get("cpu"), "num-cpus" in g["rayStartParams"])
            for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]] == [("4", False), ("4", False), ("2", False)]


def test_a_task_without_groups_keeps_one_worker_group(rlhf_home):
    data = task()
    del data["groups"]
    data.update(nodes=3, resources={"cpus": 2})
    (workers,) = rayjob(data)["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["groupName"] == "workers" and workers["replicas"] == 2 and "labels" not in workers


def test_a_groups_kuberay_options_are_read_with_the_providers_model_naming_the_group(tmp_path, capsys, rlhf_home):
    data = task()
    data["groups"][1]["placement"] = {"kuberay": {"node_selectr": {"a": "b"}}}
    code, out = check_exit(tmp_path, capsys, data, "--provider", "kuberay")
    assert code == 2 and "groups[1].placement.kuberay.node_selectr" in out, out
    data = task()
    data["groups"][1]["placement"] = {"slurmm": {}}
    code, out = check_exit(tmp_path, capsys, data, "--provider", "kuberay")
    assert code == 2 and "groups[1].placement.slurmm" in out, out


@pytest.mark.parametrize("selector, said", [
    ({}, "groups[0].placement.kuberay.node_selector"), (H100, None)])
def test_a_group_asking_gpus_by_memory_needs_its_own_gpu_label(selector, said, tmp_path, capsys, rlhf_home):
    data = task()
    data["groups"][0].update(resources={"cpus": 4, "gpus": "80GB:8"}, placement={"kuberay": {"node_selector": selector}})
    code, out = check_exit(tmp_path, capsys, data, "--provider", "kuberay")
    assert (code, said in out if said else True) == ((2, True) if said else (0, True)), out


def test_check_notes_a_groups_gpu_type_no_label_selects(tmp_path, capsys, rlhf_home):
    data = task()
    data["groups"][1]["resources"] = {"cpus": 2, "gpus": "L40S:1"}
    code, out = check_exit(tmp_path, capsys, data, "--provider", "kuberay")
    assert code == 0, out
    assert "groups[1].resources.gpus: the pods request 1 GPUs of any type; KubeRay cannot select L40S: add " \
           "groups[1].placement.kuberay.node_selector" in out, out
    assert "groups[0].resources.gpus" not in out, out
