"""Node groups (issue 46), framework roles on groups: OpenRLHF PPO's reward model served on a group of its own
(`job.args.reward_where: group NAME`): OpenRLHF 0.11.2's train_ppo_ray.py builds every role's placement group of
{"GPU": 1, "CPU": 1} bundles (strategy PACK) and never passes RayActorGroup its `resources` (trainer/ray/launcher.py),
so no flag confines a role to a group's nodes; the reward model alone leaves Ray, as openrlhf.cli.serve_rm behind
--reward.remote_url. Search-R1's retriever on a group of its own (`job.args.retriever_where`), and what check says
of verl's and Search-R1's fork's placement, which confines no role to a group."""

from __future__ import annotations

import pytest

from rlhf_tasks import providers
from rlhf_tasks.spec import parse_task

from test_groups import check_exit


def ppo(**args) -> dict:
    base = {"version": "0.11.2", "pretrain": "OpenRLHF/Llama-3-8b-sft-mixture",
            "reward_pretrain": "OpenRLHF/Llama-3-8b-rm-mixture", "prompt_data": "OpenRLHF/prompt-collection-v0.1",
            "colocate": "pairs", "actor_gpus": 4, "critic_gpus": 4, "vllm_tensor_parallel_size": 2}
    base.update(args)
    return {"name": "ppo-groups", "preflight": "off", "checkpoints": {"path": "/ck"},
            "groups": [{"name": "train", "nodes": 2, "resources": {"gpus": "A100-80GB:8"}},
                       {"name": "rm", "nodes": 1, "resources": {"gpus": "A10G:1"}}],
            "job": {"recipe": "openrlhf-ppo", "working_dir": None, "args": base}}


def plan(data):
    return providers.get("slurm").plan(parse_task(data))


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_the_reward_model_is_served_on_its_group_and_the_trainer_asks_it_over_http(rlhf_home):
    p = plan(ppo(reward_where="group rm"))
    argv = p.job.entrypoint
    assert flag(argv, "--reward.remote_url") == "http://{group_addr:rm}:5000/get_reward"
    assert "--reward.num_nodes" not in argv and "--reward.model_name_or_path" not in argv
    service = next(s for s in p.services if s.name == "reward-model")
    assert service.where == "group rm"
    assert "openrlhf.cli.serve_rm" in service.command and "--reward.model_name_or_path " \
        "OpenRLHF/Llama-3-8b-rm-mixture" in service.command and "--host {node_addr}" in service.command
    # the critic (with the reward model gone, colocated with none) and the vLLM engines count only the train group
    assert flag(argv, "--vllm.num_engines") == "4"


def test_flat_releases_name_serve_rms_flags_their_way(rlhf_home):
    p = plan(ppo(reward_where="group rm", version="0.8.11"))
    service = next(s for s in p.services if s.name == "reward-model")
    assert "--reward_pretrain OpenRLHF/Llama-3-8b-rm-mixture" in service.command
    assert flag(p.job.entrypoint, "--remote_rm_url") == "http://{group_addr:rm}:5000/get_reward"


def test_without_reward_where_the_roles_count_every_gpu_group_at_its_fewest_gpus(tmp_path, capsys, rlhf_home):
    """shape_of: the Ray roles may land on any GPU node, so they count the rm group's 1-GPU node too."""
    code, out = check_exit(tmp_path, capsys, ppo(), "--provider", "slurm")
    assert code == 2 and "no GPUs left for vLLM: actor 4 + critic 4 = 8 of 3 nodes x 1 GPUs" in out, out


@pytest.mark.parametrize("args, words", [
    ({"reward_where": "group rwd"}, "job.args.reward_where: infeasible allocation: the task has no group 'rwd'"),
    ({"reward_where": "group train"}, "job.args.reward_where: infeasible allocation: group train is the trainer's"),
    ({"reward_where": "group rm", "reward_pretrain": None, "reward_url": "http://x/r"},
     "job.args.reward_where: infeasible allocation: reward_url is a reward served elsewhere"),
    ({"reward_where": "group rm", "actor_gpus": 8, "critic_gpus": 8, "vllm_engines": 2},
     "job.args.actor_gpus, job.args.critic_gpus, job.args.vllm_engines, job.args.vllm_tensor_parallel_size: "
     "infeasible allocation: the roles need actor 8 + critic 8 + vLLM 2 x TP 2 = 20 GPUs but the cluster has "
     "2 nodes x 8 GPUs = 16"),
])
def test_a_reward_group_that_cannot_work_is_refused_naming_the_argument(tmp_path, capsys, rlhf_home, args, words):
    code, out = check_exit(tmp_path, capsys, ppo(**args), "--provider", "slurm")
    assert code == 2 and words in out, out


def test_check_says_what_openrlhf_cannot_confine(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, ppo(reward_where="group rm"), "--provider", "slurm")
    assert code == 0, out
    assert "OpenRLHF places its Ray roles on any GPU node" in out and "reward model: served on group rm" in out, out


@pytest.mark.parametrize("task, arg", [(lambda: ppo(reward_where="group rm"), "reward_where"),
                                       (lambda: search(retriever_where="group retr"), "retriever_where")])
def test_a_task_without_groups_has_no_group_to_serve_on(tmp_path, capsys, rlhf_home, task, arg):
    data = task()
    del data["groups"]
    data.update(nodes=2, resources={"gpus": "A100-80GB:8"})
    code, out = check_exit(tmp_path, capsys, data, "--provider", "slurm")
    assert code == 2 and f"job.args.{arg}" in out and "it has no groups" in out, out



# --- Search-R1's retriever on a group of its own (job.args.retriever_where) -----------------------------------
# Search-R1's verl fork (github.com/PeterGriffinJin/Search-R1 at a14dc3a): verl/trainer/main_ppo.py builds
# resource_pool_spec {global_pool: [n_gpus_per_node] * nnodes}, and verl/single_controller/ray/base.py
# RayResourcePool.get_placement_groups makes one STRICT_PACK placement group of {"CPU", "GPU": 1} bundles per
# node: GPU counts with no node constraint, so its trainer workers may land on any GPU node.

def search(retriever: dict | None = None, **args) -> dict:
    base = {"faiss_gpu": False}
    base.update(args)
    groups = [{"name": "train", "nodes": 2, "resources": {"gpus": "H100:8"}}]
    if retriever is not None:
        groups.append({"name": "retr", "nodes": 1, "resources": retriever})
    return {"name": "search-groups", "preflight": "off", "checkpoints": {"path": "/ck", "resume": "never"},
            "groups": groups, "job": {"recipe": "search-r1", "working_dir": None, "args": base}}


def hydra(argv) -> dict:
    return dict(item.split("=", 1) for item in argv[3:])


def test_the_retriever_runs_on_its_cpu_group_and_the_trainer_asks_it_there(rlhf_home):
    p = plan(search({"cpus": 16}, retriever_where="group retr"))
    (service,) = p.services
    assert service.where == "group retr" and "--faiss_gpu" not in service.command
    # ready when it answers on the address the trainer asks, not only on the node's loopback
    assert service.ready.http == "http://{node_addr}:8000/retrieve"
    values = hydra(p.job.entrypoint)
    assert values["retriever.url"] == "http://{group_addr:retr}:8000/retrieve"
    assert values["trainer.nnodes"] == "2" and values["trainer.n_gpus_per_node"] == "8"


def test_a_gpu_retriever_group_is_not_counted_by_the_trainer(rlhf_home):
    """without_group: the trainer counts the train group's 2 x 8, not every GPU group at its fewest (3 x 1)."""
    p = plan(search({"gpus": "L4:1"}, retriever_where="group retr", faiss_gpu=True))
    (service,) = p.services
    assert service.where == "group retr" and "--faiss_gpu" in service.command
    values = hydra(p.job.entrypoint)
    assert values["trainer.nnodes"] == "2" and values["trainer.n_gpus_per_node"] == "8"


def test_every_node_stays_the_default_with_groups(rlhf_home):
    p = plan(search({"gpus": "L4:4"}, train_batch_size=528))  # a multiple of 3 x 4
    (service,) = p.services
    assert service.where == "every_node" and service.ready.http == "http://127.0.0.1:8000/retrieve"
    values = hydra(p.job.entrypoint)
    assert values["retriever.url"] == "http://127.0.0.1:8000/retrieve"
    assert values["trainer.nnodes"] == "3" and values["trainer.n_gpus_per_node"] == "4"  # every GPU group, fewest


@pytest.mark.parametrize("data, words", [
    (search({"cpus": 16}, retriever_where="group rtr"),
     "job.args.retriever_where: infeasible allocation: the task has no group 'rtr' (its groups: train, retr)"),
    (search({"cpus": 16}, retriever_where="group train"),
     "job.args.retriever_where: infeasible allocation: group train is the trainer's"),
    (search({"cpus": 16}, retriever_where="group retr", faiss_gpu=True),
     "job.args.retriever_where, job.args.faiss_gpu: infeasible allocation: group retr has no GPUs"),
    (search({"cpus": 16}, faiss_gpu=True),
     "job.args.retriever_where, job.args.faiss_gpu: infeasible allocation: group retr has no GPUs"),
    (search({"gpus": "H100:8"}, retriever_where="group retr", train_batch_size=520),
     "job.args.train_batch_size, job.args.n_agent: infeasible allocation: train_batch_size x n_agent = 520 x 1 = "
     "520 is not divisible by the cluster's 16 GPUs"),
])
def test_a_retriever_group_that_cannot_work_is_refused_naming_the_argument(tmp_path, capsys, rlhf_home, data, words):
    code, out = check_exit(tmp_path, capsys, data, "--provider", "slurm")
    assert code == 2 and words in out, out




def test_retriever_where_is_a_place_or_a_group(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, search({"cpus": 16}, retriever_where="head"), "--provider", "slurm")
    assert code == 2 and "job.args.retriever_where" in out, out


def test_check_says_where_the_retriever_and_the_trainer_run(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, search({"gpus": "L4:8"}, retriever_where="group retr"),
                           "--provider", "slurm")
    assert code == 0, out
    assert "retriever: on group retr (every node of it), the trainer asking http://{group_addr:retr}:8000" in out, out
    assert "Search-R1's verl fork places its trainer workers on any GPU node" in out, out
    assert "(they count 2 node(s) x 8 GPUs)" in out and "group retr's GPUs are the retriever's, not Ray's: its nodes join Ray with none" in out, out


# --- verl: its resource pools are GPU counts, placed on any node ------------------------------------------------

def verl(**args) -> dict:
    return {"name": "verl-groups", "preflight": "off", "checkpoints": {"path": "/ck"},
            "groups": [{"name": "train", "nodes": 2, "resources": {"gpus": "H100:8"}},
                       {"name": "more", "nodes": 1, "resources": {"gpus": "L40S:4"}},
                       {"name": "cpu", "nodes": 1, "resources": {"cpus": 8}}],
            "job": {"recipe": "verl-ppo", "working_dir": None, "args": {"train_batch_size": 1200, "ppo_mini_batch_size": 240, **args}}}  # x 12 GPUs


def test_verl_counts_every_gpu_group_at_its_fewest_gpus(rlhf_home):
    values = hydra(plan(verl()).job.entrypoint)
    assert values["trainer.nnodes"] == "3" and values["trainer.n_gpus_per_node"] == "4"


def test_check_says_verl_confines_no_role_to_a_group(tmp_path, capsys, rlhf_home):
    code, out = check_exit(tmp_path, capsys, verl(), "--provider", "slurm")
    assert code == 0, out
    assert "verl places its resource pools on any GPU node" in out and "_init_resource_pool_mgr" in out, out
    assert "(they count 3 node(s) x 4 GPUs)" in out, out


def test_check_says_nothing_of_groups_for_a_task_without_them(tmp_path, capsys, rlhf_home):
    data = verl()
    del data["groups"]
    data.update(nodes=2, resources={"gpus": "H100:8"})
    code, out = check_exit(tmp_path, capsys, data, "--provider", "slurm")
    assert code == 0 and "on any GPU node" not in out, out
