"""Node groups (issue 46), a served group: a group whose GPUs a recipe serves outside Ray (openrlhf-ppo's
reward_where, search-r1's retriever_where on a GPU group) joins Ray with no GPUs (`ray start --num-gpus 0`; on
KubeRay its worker group's `resources: {GPU: "0"}`), so that no placement group of the framework's ({GPU: 1}
bundles on any node) puts an actor or a vLLM engine on the GPUs the served model uses; preflight's NCCL
all_reduce runs among the nodes Ray has GPUs on."""

from __future__ import annotations

import argparse
import json
import sys
import types

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.agent import preflight
from rlhf_tasks.agent.contract import NodeInfo
from rlhf_tasks.agent.raynode import ray_start_command
from rlhf_tasks.spec import parse_task

from test_groups import check_exit
from test_groups_recipes import ppo, search


#: openrlhf-ppo with its reward model a Ray role (reward_where: ray), small enough for every GPU group's 1 GPU
IN_RAY = dict(actor_gpus=1, critic_gpus=1, vllm_tensor_parallel_size=1)


def plan(data, provider="slurm"):
    return providers.get(provider).plan(parse_task(data))


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_recipe_names_the_groups_it_serves_outside_ray(rlhf_home):
    from rlhf_tasks.plan import shape_of

    for data, served in [(ppo(reward_where="group rm"), ["rm"]), (ppo(**IN_RAY), []),
                         (search({"gpus": "L4:1"}, retriever_where="group retr", faiss_gpu=True), ["retr"]),
                         (search({"cpus": 16}, retriever_where="group retr"), []),  # no GPUs to keep from Ray
                         (search({"gpus": "L4:4"}, train_batch_size=528), [])]:       # a retriever on every node
        task = parse_task(data)
        out = task.job.build(shape_of(task, checkpoint_dir="/ck", resume=False))
        assert out.served_groups == served, (data["job"]["args"], out.served_groups)


def test_the_plan_gives_a_served_group_no_ray_gpus_and_the_others_theirs(rlhf_home):
    train, rm = plan(ppo(reward_where="group rm")).groups
    assert (train.ray_gpus, rm.ray_gpus) == (None, 0)
    assert [g.ray_gpus for g in plan(ppo(**IN_RAY)).groups] == [None, None]
    assert json.loads(plan(ppo(reward_where="group rm")).to_json())["groups"][1]["ray_gpus"] == 0


def test_a_served_groups_nodes_start_ray_with_no_gpus_and_the_others_with_theirs(rlhf_home):
    p = json.loads(plan(ppo(reward_where="group rm")).to_json())  # train: ranks 0-1 (8 GPUs each), rm: rank 2
    head = ray_start_command(p, NodeInfo(0, 3, "10.0.0.1", "10.0.0.1"), head=True)
    worker = ray_start_command(p, NodeInfo(1, 3, "10.0.0.1", "10.0.0.2"), head=False)
    served = ray_start_command(p, NodeInfo(2, 3, "10.0.0.1", "10.0.0.3"), head=False)
    assert (flag(head, "--num-gpus"), flag(worker, "--num-gpus"), flag(served, "--num-gpus")) == ("8", "8", "0")
    assert flag(served, "--labels") == "rlhf-tasks/group=rm"  # still its group's label and resources
    unserved = json.loads(plan(ppo(**IN_RAY)).to_json())
    assert flag(ray_start_command(unserved, NodeInfo(2, 3, "10.0.0.1", "10.0.0.3"), head=False), "--num-gpus") == "1"


def test_a_cpu_groups_nodes_leave_ray_to_count_their_gpus(rlhf_home):
    """gpus_per_node 0 and not served: no --num-gpus (Ray counts what the machine has), as before."""
    p = json.loads(plan(search({"cpus": 16}, retriever_where="group retr")).to_json())
    assert "--num-gpus" not in ray_start_command(p, NodeInfo(2, 3, "10.0.0.1", "10.0.0.3"), head=False)


def rayjob(data: dict) -> dict:
    provider = providers.get("kuberay")
    (text,) = provider.render(provider.plan(parse_task(data))).values()
    return next(doc for doc in yaml.safe_load_all(text) if doc["kind"] == "RayJob")


def test_kuberay_gives_a_served_worker_group_zero_gpus_in_its_group_resources(rlhf_home):
    """KubeRay v1.6.2's updateRayStartParamsResources (common/pod.go) maps a group resource whose key ends in
    "gpu" to num-gpus, and addWellKnownAcceleratorResources then leaves num-gpus from the limits alone."""
    cluster = rayjob(ppo(reward_where="group rm"))["spec"]["rayClusterSpec"]
    head, (train, rm) = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert rm["groupName"] == "rm" and rm["resources"] == {"rm": "1", "a10g": "1", "GPU": "0"}
    assert "GPU" not in head["resources"] and "GPU" not in train["resources"]
    assert "num-gpus" not in rm["rayStartParams"]  # beside group resources KubeRay refuses it (utils/validation.go)
    (container,) = rm["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"  # the pod still has its GPU, for serve_rm
    (_, unserved) = rayjob(ppo(**IN_RAY))["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert "GPU" not in unserved["resources"]


def test_check_says_the_served_groups_gpus_are_not_rays(tmp_path, capsys, rlhf_home):
    for provider in ("slurm", "kuberay"):
        code, out = check_exit(tmp_path, capsys, ppo(reward_where="group rm"), "--provider", provider)
        assert code == 0, out
        assert "group rm's GPUs are the reward model's, not Ray's: its nodes join Ray with none (ray start " \
               "--num-gpus 0), so no Ray role or vLLM engine lands there" in out, out
    code, out = check_exit(tmp_path, capsys, search({"gpus": "L4:8"}, retriever_where="group retr"),
                           "--provider", "slurm")
    assert code == 0, out
    assert "group retr's GPUs are the retriever's, not Ray's: its nodes join Ray with none (ray start " \
           "--num-gpus 0), so no trainer worker lands there" in out, out
    assert "Ray may place" not in out, out


# --- preflight: NCCL among the nodes Ray has GPUs on ------------------------------------------------------------

class FakeRay(types.ModuleType):
    """What step_allreduce asks of Ray: free GPUs, probe actors pinned to nodes, their answers."""

    def __init__(self, free_gpus: float):
        super().__init__("ray")
        self.free_gpus, self.pinned, self.allreduce = free_gpus, [], []

    def available_resources(self):
        return {"GPU": self.free_gpus}

    def remote(self, **options):
        fake = self

        class Actor:
            def __init__(self, node_id):
                self.node_id = node_id
                self.torch_info = self.free_port = self
                self.allreduce = types.SimpleNamespace(remote=lambda *a: fake.allreduce.append(a) or {
                    "sizes": [{"bytes": 1 << 20, "bus_bits_per_s": 1e9}]})

            def remote(self, *args):
                return 29500

        class Probe:
            def options(self, scheduling_strategy):
                return types.SimpleNamespace(remote=lambda: fake.pinned.append(scheduling_strategy.node_id)
                                             or Actor(scheduling_strategy.node_id))
        return lambda cls: Probe()


def allreduce_on(gpus, monkeypatch, free=None):
    fake = FakeRay(sum(1 for g in gpus if g) if free is None else free)
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.NodeAffinitySchedulingStrategy = lambda node_id, soft: types.SimpleNamespace(node_id=node_id)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.util", types.ModuleType("ray.util"))
    monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", strategies)
    check = preflight.Preflight(argparse.Namespace(wait_nodes=0, timeout=60))
    check.nodes = [{"label": "node%d" % i, "node_id": "id%d" % i, "address": "10.0.0.%d" % (i + 1), "gpus": g,
                    "group": "rm" if not g else "train"} for i, g in enumerate(gpus)]
    check.actors = [None] * len(gpus)
    monkeypatch.setattr(check, "gather", lambda step, refs, who, deadline: refs)
    return check, fake


def test_nccl_runs_among_the_nodes_ray_has_gpus_on_and_says_which_it_left_out(monkeypatch):
    check, fake = allreduce_on([8, 8, 0], monkeypatch)
    assert check.nccl_nodes() == [0, 1]
    check.step_allreduce("nccl")
    assert fake.pinned == ["id0", "id1"]
    assert [(a[1], a[3], a[4]) for a in fake.allreduce] == [("10.0.0.1", 0, 2), ("10.0.0.1", 1, 2)]  # master, rank, world
    assert check.collectives["nccl"]["nodes"] == 2
    assert any("NCCL among the 2 nodes Ray has GPUs on" in note and "node2" in note for note in check.notes), check.notes


def test_nccl_is_not_checked_where_fewer_than_two_nodes_have_gpus_or_they_are_busy(monkeypatch):
    check, _ = allreduce_on([8, 0], monkeypatch)
    assert check.nccl_nodes() == []
    check, fake = allreduce_on([8, 8, 0], monkeypatch, free=1)
    check.step_allreduce("nccl")
    assert not fake.pinned and any("NCCL not checked: no free GPU on every node Ray has GPUs on" in n
                                   for n in check.notes), check.notes


def test_every_node_with_gpus_is_nccls_as_before(monkeypatch):
    check, fake = allreduce_on([8, 8, 8], monkeypatch)
    check.step_allreduce("nccl")
    assert fake.pinned == ["id0", "id1", "id2"] and not check.notes


@pytest.mark.cluster
def test_the_real_operator_starts_a_served_groups_ray_with_no_gpus_and_another_gpu_groups_with_its_own(
        kube_cluster, ns, tmp_path):
    """KubeRay v1.6.2 itself writes each pod's `ray start` (KUBERAY_GEN_RAY_START_CMD, in the pod it creates):
    the served group's `resources: {GPU: "0"}` is `--num-gpus=0` though its container asks for a GPU, and an
    unserved GPU group's is its limits' `--num-gpus=1`. The pods stay Pending (the played nodes have no GPUs):
    what is read is the operator's own command, not a run."""
    import testbed as tbmod
    from test_kuberay_cluster import kubectl_json

    data = {"name": "served", "preflight": "off", "wait": {"head": "3m", "nodes": "3m"},
            "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "echo hi"}},
            "groups": [{"name": "trainer", "nodes": 1, "resources": {"cpus": 1}},
                       {"name": "rm", "nodes": 1, "resources": {"cpus": 1, "gpus": "L40S:1"}},
                       {"name": "gpu", "nodes": 1, "resources": {"cpus": 1, "gpus": "L40S:1"}}]}
    provider = providers.get("kuberay")
    p = provider.plan(parse_task(data))
    p = p.replace(groups=[p.groups[0], p.groups[1].model_copy(update={"ray_gpus": 0}), p.groups[2]])
    (text,) = provider.render(p).values()
    path = tmp_path / "served.rayjob.yaml"
    path.write_text(text)
    kube_cluster.cp.kubectl("-n", ns, "apply", "-f", str(path))

    def commands():
        found = {}
        for pod in (kubectl_json(kube_cluster, ns, "pods") or {"items": []})["items"]:
            group = pod["metadata"].get("labels", {}).get("ray.io/group")
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}
            if group and "KUBERAY_GEN_RAY_START_CMD" in env:
                found[group] = env["KUBERAY_GEN_RAY_START_CMD"]
        return found if {"rm", "gpu"} <= set(found) else None
    found = tbmod.poll(commands, 120, "the operator's worker pods of groups rm and gpu")
    assert "--num-gpus=0 " in found["rm"] and "--resources='{\"l40s\":1,\"rm\":1}'" in found["rm"], found
    assert "--num-gpus=1 " in found["gpu"], found


def test_doctor_says_where_a_groups_nodes_give_ray_other_gpus_than_the_plan_says(monkeypatch, rlhf_home):
    """A served group's node with GPUs in Ray is one a framework's placement group may fill; a GPU group's node
    with fewer than its GPUs lacks some (each group's own count, as the plan's ray_gpus and gpus_per_node say)."""
    from rlhf_tasks import doctor

    p = plan(ppo(reward_where="group rm"))

    def node(i, group, gpus):
        return {"node_ip": "10.0.0.%d" % i, "labels": {"rlhf-tasks/group": group},
                "resources_total": {"CPU": 8.0, group: float(max(gpus, 1)), **({"GPU": float(gpus)} if gpus else {})}}
    monkeypatch.setattr(doctor, "http_request", lambda url, headers=None, timeout=None: (200 if headers else 401, b""))
    seen = {"nodes": [node(1, "train", 8), node(2, "train", 8), node(3, "rm", 0)]}
    monkeypatch.setattr(doctor, "alive_nodes", lambda address, token: seen["nodes"])
    checks = {c.name: c for c in doctor.access_checks(doctor.Target("ppo-groups", "http://d", "t", p))}
    assert checks["GPUs per group"].ok, checks["GPUs per group"].detail
    seen["nodes"] = [node(1, "train", 8), node(2, "train", 4), node(3, "rm", 1)]
    checks = {c.name: c for c in doctor.access_checks(doctor.Target("ppo-groups", "http://d", "t", p))}
    detail = checks["GPUs per group"].detail
    assert not checks["GPUs per group"].ok
    assert "10.0.0.2 (group train) registered 4 GPUs, not 8" in detail, detail
    assert "10.0.0.3 (group rm) registered 1 GPUs, not 0 (the recipe serves them outside Ray)" in detail, detail
