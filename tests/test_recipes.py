"""Framework recipes: shape flags filled from the cluster, each allocation check failing and
passing, flag dialects, services, resume and logger wiring, the task catalogue."""

from __future__ import annotations

import pytest

from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks import providers
from rlhf_tasks.recipes import JOB_MODELS, recipe_name
from rlhf_tasks.recipes.base import Shape
from rlhf_tasks.recipes.openrlhf import parse_version
from rlhf_tasks.spec import load_task, parse_task

from conftest import ROOT

MODELS = {recipe_name(model): model for model in JOB_MODELS}
OPENRLHF = {"pretrain": "actor", "reward_pretrain": "rm", "prompt_data": "prompts"}
TASKS = {name: ROOT / "tasks" / f"{name}.yaml" for name in (
    "openrlhf-ppo-llama3-8b", "openrlhf-hybrid-70b", "openrlhf-m-grpo-qwen2.5-vl-3b", "verl-ppo-gsm8k",
    "search-r1-ppo-qwen2.5-7b")}


def build(recipe: str, args: dict, nodes=2, gpus=8, ckpt="/ckpt", resume=True):
    job = MODELS[recipe].model_validate({"recipe": recipe, "args": args})
    return job.build(Shape(nodes=nodes, gpus_per_node=gpus, checkpoint_dir=ckpt, resume=resume))


def flag(argv: list[str], name: str):
    """The value after a flag (True for a switch, None when absent)."""
    if name not in argv:
        return None
    index = argv.index(name)
    following = argv[index + 1] if index + 1 < len(argv) else "--"
    return True if following.startswith("--") else following


def overrides(argv: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in argv[3:])


# --- every allocation check: a passing configuration and the change that breaks it --------

SHAPE_KEYS = {"nodes", "gpus", "ckpt", "resume"}

CASES = [
    # (id, recipe, a passing configuration (args and shape), the change that fails, message)
    ("no-gpus", "openrlhf-ppo", {**OPENRLHF, "colocate": "all"}, {"gpus": 0}, "has none"),
    ("actor-gpus-needed", "openrlhf-ppo", {**OPENRLHF, "actor_gpus": 4}, {"actor_gpus": None}, "needs actor_gpus"),
    ("whole-nodes", "openrlhf-ppo", {**OPENRLHF, "colocate": "all", "nodes": 4, "actor_gpus": 16},
     {"actor_gpus": 12}, "12 GPUs: more than one node's 8 and not whole nodes"),
    ("actor-ref-colocated", "openrlhf-ppo",
     {**OPENRLHF, "colocate": "none", "actor_gpus": 4, "ref_gpus": 2, "critic_gpus": 2, "vllm_engines": 0},
     {"colocate": "pairs"}, "actor (4 GPUs) and ref (2 GPUs) are colocated"),
    ("critic-reward-colocated", "openrlhf-ppo", {**OPENRLHF, "actor_gpus": 4, "critic_gpus": 4},
     {"reward_gpus": 2}, "critic (4 GPUs) and reward (2 GPUs) are colocated"),
    ("colocate-all-same-gpus", "openrlhf-ppo", {**OPENRLHF, "colocate": "all"}, {"critic_gpus": 8},
     "actor (16 GPUs) and critic (8 GPUs) are colocated"),
    ("engines-fill-actor", "openrlhf-ppo", {**OPENRLHF, "colocate": "all", "vllm_tensor_parallel_size": 2},
     {"vllm_engines": 3}, "3 engines x TP 2 = 6 != actor 16"),
    ("tp-divides-node", "openrlhf-ppo", {**OPENRLHF, "colocate": "all", "vllm_tensor_parallel_size": 2},
     {"vllm_tensor_parallel_size": 3, "actor_gpus": 6}, "tensor parallel size 3 does not divide 8"),
    ("total-gpus", "openrlhf-ppo",
     {**OPENRLHF, "actor_gpus": 4, "vllm_engines": 4, "vllm_tensor_parallel_size": 2},
     {"actor_gpus": 8, "colocate": "none"},
     "actor 8 + ref 8 + critic 8 + reward 8 + vLLM 4 x TP 2 = 40 GPUs but the cluster has 2 nodes x 8 GPUs = 16"),
    ("room-for-vllm", "openrlhf-ppo", {**OPENRLHF, "actor_gpus": 4, "critic_gpus": 8}, {"actor_gpus": 8},
     "no GPUs left for vLLM: actor 8 + critic 8 = 16"),
    ("group-needs-samples", "openrlhf-ppo",
     {**OPENRLHF, "colocate": "all", "estimator": "group_norm", "n_samples_per_prompt": 8},
     {"n_samples_per_prompt": 1}, "n_samples_per_prompt is 1"),
    ("sleep-needs-colocate-all", "openrlhf-ppo", {**OPENRLHF, "colocate": "all", "sleep": True},
     {"colocate": "pairs", "actor_gpus": 4}, "sleep modes"),
    ("packing-needs-vllm", "openrlhf-ppo", {**OPENRLHF, "colocate": "all", "packing_samples": True},
     {"colocate": "pairs", "actor_gpus": 4, "critic_gpus": 4, "vllm_engines": 0}, "packing_samples needs vLLM"),
    ("micro-batches-per-actor", "openrlhf-ppo", {**OPENRLHF, "colocate": "all", "micro_rollout_batch_size": 16},
     {"rollout_batch_size": 64}, "64 / 16 = 4 micro-batches for 16 actor GPUs"),
    ("legacy-rollout-divisible", "openrlhf-ppo",
     {**OPENRLHF, "colocate": "all", "rollout_batch_size": 1000, "version": "0.8.11"}, {"version": "0.6.1"},
     "rollout_batch_size 1000 is not divisible by the actor's 16 GPUs"),
    ("legacy-zero3-needs-vllm", "openrlhf-ppo",
     {**OPENRLHF, "actor_gpus": 4, "critic_gpus": 4, "vllm_engines": 0, "version": "0.6.1", "zero_stage": 2},
     {"zero_stage": 3}, "ZeRO-3 needs vLLM"),
    ("legacy-actor-engines-divide", "openrlhf-ppo",
     {**OPENRLHF, "actor_gpus": 4, "critic_gpus": 4, "vllm_engines": 4, "version": "0.6.1"}, {"vllm_engines": 3},
     "actor's 4 GPUs and 3 vLLM engines must divide one another"),
    ("legacy-actor-critic-divide", "openrlhf-ppo",
     {**OPENRLHF, "colocate": "none", "actor_gpus": 4, "ref_gpus": 1, "critic_gpus": 2, "reward_gpus": 1,
      "vllm_engines": 4, "version": "0.6.1"}, {"critic_gpus": 3}, "4 GPUs are not divisible by the critic's 3"),
    ("openrlhf-checkpoints", "openrlhf-ppo", {**OPENRLHF, "colocate": "all"}, {"ckpt": None}, "checkpoint directory"),
    ("openrlhf-m-whole-nodes", "openrlhf-m-grpo", {"gpus": 2}, {"actor_gpus": 3}, "3 GPUs: more than one node's 2"),
    ("openrlhf-m-legacy-divisible", "openrlhf-m-grpo", {"gpus": 2}, {"rollout_batch_size": 126},
     "rollout_batch_size 126 is not divisible by the actor's 4 GPUs"),
    ("verl-gpus", "verl-ppo", {}, {"gpus": 0}, "has none"),
    ("verl-checkpoints", "verl-ppo", {}, {"ckpt": None}, "checkpoint directory"),
    ("verl-batch-divisible", "verl-ppo", {}, {"train_batch_size": 1000},
     "train_batch_size x rollout_n = 1000 x 1 = 1000 is not divisible by the cluster's 16 GPUs"),
    ("verl-mini-batch", "verl-ppo", {"train_batch_size": 256}, {"train_batch_size": 128},
     "train_batch_size 128 < ppo_mini_batch_size 256"),
    ("verl-mini-batch-divisible", "verl-ppo", {"ppo_mini_batch_size": 240}, {"ppo_mini_batch_size": 250},
     "ppo_mini_batch_size x rollout_n = 250 x 1 = 250 is not divisible"),
    ("verl-tp-divides-node", "verl-ppo", {"rollout_tensor_parallel_size": 4}, {"rollout_tensor_parallel_size": 3},
     "rollout tensor parallel size 3 does not divide 8"),
    ("verl-grpo-needs-n", "verl-ppo", {"estimator": "grpo", "rollout_n": 5}, {"rollout_n": 1}, "rollout_n is 1"),
    ("verl-owned-override", "verl-ppo", {"extra_overrides": ["trainer.val_before_train=False"]},
     {"extra_overrides": ["+trainer.nnodes=4"]}, "extra_overrides set ['trainer.nnodes']"),
    ("verl-data", "verl-ppo", {"dataset": None, "train_files": "/d/train.parquet", "val_files": "/d/test.parquet"},
     {"val_files": None}, "no training data"),
    ("search-r1-resume", "search-r1", {"resume": False}, {"resume": True}, "cannot resume"),
    ("search-r1-grpo-needs-n", "search-r1", {"resume": False, "estimator": "grpo", "n_agent": 5}, {"n_agent": 1},
     "n_agent is 1"),
    ("search-r1-batch-divisible", "search-r1", {"resume": False}, {"train_batch_size": 500},
     "train_batch_size x n_agent = 500 x 1 = 500 is not divisible"),
    ("search-r1-split-per-gpu", "search-r1", {"resume": False, "nodes": 4, "critic_micro_batch_size": 32},
     {"critic_micro_batch_size": 16}, "critic_micro_batch_size 16 is split over 32 GPUs: 16 // 32 = 0"),
    ("search-r1-tp-divides-node", "search-r1", {"resume": False, "rollout_tensor_parallel_size": 2},
     {"rollout_tensor_parallel_size": 3}, "rollout tensor parallel size 3 does not divide 8"),
]


#: The task fields each failing case names first (the arguments in its arithmetic).
FIELDS = {
    "no-gpus": "resources.gpus",
    "actor-gpus-needed": "job.args.actor_gpus, job.args.colocate",
    "whole-nodes": "job.args.actor_gpus",
    "actor-ref-colocated": "job.args.ref_gpus, job.args.actor_gpus, job.args.colocate",
    "critic-reward-colocated": "job.args.reward_gpus, job.args.critic_gpus, job.args.colocate",
    "colocate-all-same-gpus": "job.args.critic_gpus, job.args.actor_gpus, job.args.colocate",
    "engines-fill-actor": "job.args.vllm_engines, job.args.vllm_tensor_parallel_size, job.args.actor_gpus",
    "tp-divides-node": "job.args.vllm_tensor_parallel_size",
    "total-gpus": "job.args.actor_gpus, job.args.ref_gpus, job.args.critic_gpus, job.args.reward_gpus, "
                  "job.args.vllm_engines, job.args.vllm_tensor_parallel_size",
    "room-for-vllm": "job.args.actor_gpus, job.args.critic_gpus, job.args.vllm_engines",
    "group-needs-samples": "job.args.n_samples_per_prompt, job.args.estimator",
    "sleep-needs-colocate-all": "job.args.sleep, job.args.colocate",
    "packing-needs-vllm": "job.args.packing_samples, job.args.vllm_engines",
    "micro-batches-per-actor": "job.args.n_samples_per_prompt, job.args.rollout_batch_size, "
                               "job.args.micro_rollout_batch_size, job.args.actor_gpus",
    "legacy-rollout-divisible": "job.args.rollout_batch_size, job.args.actor_gpus",
    "legacy-zero3-needs-vllm": "job.args.zero_stage, job.args.vllm_engines",
    "legacy-actor-engines-divide": "job.args.vllm_engines, job.args.actor_gpus",
    "legacy-actor-critic-divide": "job.args.critic_gpus, job.args.actor_gpus",
    "openrlhf-checkpoints": "checkpoints.path",
    "openrlhf-m-whole-nodes": "job.args.actor_gpus",
    "openrlhf-m-legacy-divisible": "job.args.rollout_batch_size, job.args.actor_gpus",
    "verl-gpus": "resources.gpus",
    "verl-checkpoints": "checkpoints.path",
    "verl-batch-divisible": "job.args.train_batch_size, job.args.rollout_n",
    "verl-mini-batch": "job.args.ppo_mini_batch_size, job.args.train_batch_size",
    "verl-mini-batch-divisible": "job.args.ppo_mini_batch_size, job.args.rollout_n",
    "verl-tp-divides-node": "job.args.rollout_tensor_parallel_size",
    "verl-grpo-needs-n": "job.args.rollout_n, job.args.estimator",
    "verl-owned-override": "job.args.extra_overrides",
    "verl-data": "job.args.dataset, job.args.train_files, job.args.val_files",
    "search-r1-resume": "checkpoints.resume",
    "search-r1-grpo-needs-n": "job.args.n_agent, job.args.estimator",
    "search-r1-batch-divisible": "job.args.train_batch_size, job.args.n_agent",
    "search-r1-split-per-gpu": "job.args.critic_micro_batch_size",
    "search-r1-tp-divides-node": "job.args.rollout_tensor_parallel_size",
}


def build_case(recipe: str, config: dict):
    shape = {k: v for k, v in config.items() if k in SHAPE_KEYS}
    args = {k: v for k, v in config.items() if k not in SHAPE_KEYS}
    return build(recipe, args, **shape)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_allocation_check_passes_then_fails_with_the_arithmetic(case):
    case_id, recipe, passing, change, message = case
    assert build_case(recipe, passing).entrypoint[0] == "python3"
    with pytest.raises(BadInput) as info:
        build_case(recipe, {**passing, **change})
    text = str(info.value)
    assert text.startswith(f"{FIELDS[case_id]}: infeasible allocation:"), text
    assert message in text and "\n  suggestion: " in text, text
    # Every argument named exists in the recipe (OpenRLHF-M is built on openrlhf-ppo's checks).
    args_model = MODELS[recipe].model_fields["args"].annotation
    named = [f.removeprefix("job.args.") for f in FIELDS[case_id].split(", ") if f.startswith("job.args.")]
    assert set(named) <= set(args_model.model_fields), named


def test_infeasible_allocation_names_the_task_file_and_the_argument(tmp_path, capsys, rlhf_home):
    bad = tmp_path / "verl.yaml"
    bad.write_text(TASKS["verl-ppo-gsm8k"].read_text().replace("rollout_tensor_parallel_size: 2",
                                                                "rollout_tensor_parallel_size: 3"))
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert (f"{bad}: job.args.rollout_tensor_parallel_size: infeasible allocation: rollout tensor parallel size 3 "
            "does not divide 8 GPUs per node") in err, err


def test_infeasible_task_exits_2_before_anything(tmp_path, capsys, rlhf_home):
    text = TASKS["openrlhf-ppo-llama3-8b"].read_text().replace("critic_gpus: 4", "critic_gpus: 8\n    vllm_engines: 4")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["render", str(bad), "--provider", "dstack", "-o", str(tmp_path / "out" / "x")]) == 2
    err = capsys.readouterr().err
    assert "infeasible allocation" in err and "actor 4 + critic 8 + vLLM 4 x TP 2 = 20 GPUs" in err, err
    assert not (tmp_path / "out").exists()


# --- OpenRLHF: dialects, shapes, logger, resume ------------------------------------------


@pytest.mark.parametrize("version,dotted,legacy_flags", [
    ("0.11.2", True, []), ("0.10.2", True, []), ("0.10.1", False, []),
    ("0.9.1", False, ["--bf16", "--prompt_max_len"]), ("0.8.11", False, ["--bf16", "--prompt_max_len"]),
    ("0.6.1", False, ["--bf16", "--flash_attn", "--prompt_max_len"]),
])
def test_openrlhf_dialect_follows_version(version, dotted, legacy_flags):
    argv = build("openrlhf-ppo", {**OPENRLHF, "colocate": "all", "version": version}).entrypoint
    assert flag(argv, "--actor.num_nodes" if dotted else "--actor_num_nodes") == "2"
    assert flag(argv, "--actor_num_nodes" if dotted else "--actor.num_nodes") is None
    assert all(flag(argv, name) for name in legacy_flags)
    if parse_version(version) >= (0, 9, 8):
        assert flag(argv, "--data.max_len" if dotted else "--max_len") == "2048"


def test_openrlhf_version_is_validated():
    for bad in ("0.5.9", "latest", "1"):
        with pytest.raises(ValueError):
            build("openrlhf-ppo", {**OPENRLHF, "version": bad})


def test_openrlhf_roles_and_engines_fill_the_cluster():
    argv = build("openrlhf-ppo", {**OPENRLHF, "actor_gpus": 4, "critic_gpus": 4, "vllm_tensor_parallel_size": 2}).entrypoint
    assert [flag(argv, f"--{r}.num_gpus_per_node") for r in ("actor", "ref", "critic", "reward")] == ["4"] * 4
    assert flag(argv, "--vllm.num_engines") == "4"  # the 8 GPUs the roles leave, at TP 2
    assert flag(argv, "--train.colocate_actor_ref") and flag(argv, "--train.colocate_critic_reward")
    # 24 GPUs: DeepSpeed's batch (train = micro 8 x accumulation x 24) needs a train_batch_size of 192 or more
    whole = build("openrlhf-ppo", {**OPENRLHF, "colocate": "all", "train_batch_size": 192}, nodes=3).entrypoint
    assert (flag(whole, "--actor.num_nodes"), flag(whole, "--actor.num_gpus_per_node")) == ("3", "8")
    assert flag(whole, "--vllm.num_engines") == "24" and flag(whole, "--train.colocate_all")


def test_openrlhf_remote_reward_and_grpo_drop_the_critic_and_reward_roles():
    out = build("openrlhf-ppo", {"pretrain": "a", "prompt_data": "p", "reward_url": "http://{head_addr}:5000/r",
                                 "estimator": "group_norm", "n_samples_per_prompt": 8, "colocate": "all"})
    argv = out.entrypoint
    assert flag(argv, "--reward.remote_url") == "http://{head_addr}:5000/r"
    assert not any(a.startswith(("--critic.", "--reward.num")) for a in argv)
    assert out.summary["roles"] == {"actor": 16, "ref": 16}


def test_openrlhf_args_are_consistent():
    with pytest.raises(ValueError, match="exactly one of reward_pretrain"):
        build("openrlhf-ppo", {"pretrain": "a", "prompt_data": "p"})
    with pytest.raises(ValueError, match="exactly one of reward_pretrain"):
        build("openrlhf-ppo", {**OPENRLHF, "reward_url": "http://x/r"})
    with pytest.raises(ValueError, match="dr_grpo needs OpenRLHF 0.7.0"):
        build("openrlhf-ppo", {**OPENRLHF, "estimator": "dr_grpo", "version": "0.6.1"})


@pytest.mark.parametrize("version,value_network,universal", [
    ("0.11.2", "--critic.save_value_network", "--ds.use_universal_ckpt"),
    ("0.10.1", "--save_value_network", "--use_ds_universal_ckpt"),
    ("0.6.3", "--save_value_network", "--universal_ckpt"),  # renamed --use_ds_universal_ckpt in 0.6.4
])
def test_openrlhf_checkpoint_options_in_each_dialect(version, value_network, universal):
    args = {**OPENRLHF, "actor_gpus": 4, "critic_gpus": 4, "version": version}
    argv = build("openrlhf-ppo", args).entrypoint
    assert value_network not in argv and universal not in argv
    argv = build("openrlhf-ppo", {**args, "save_value_network": True, "use_ds_universal_ckpt": True}).entrypoint
    assert flag(argv, value_network) is True and flag(argv, universal) is True


def test_openrlhf_checkpoint_options_the_task_cannot_use_are_refused_with_why():
    with pytest.raises(ValueError, match=r"use_ds_universal_ckpt: OpenRLHF's universal checkpoint loading came in "
                                         r"0.6.3 \(--universal_ckpt\); version is 0.6.1"):
        build("openrlhf-ppo", {**OPENRLHF, "colocate": "all", "version": "0.6.1", "use_ds_universal_ckpt": True})
    with pytest.raises(BadInput, match=r"job.args.save_value_network, job.args.estimator: .*saves the critic, and "
                                       r"estimator group_norm trains none"):
        build("openrlhf-ppo", {**OPENRLHF, "colocate": "all", "estimator": "group_norm", "n_samples_per_prompt": 4,
                               "save_value_network": True})
    with pytest.raises(BadInput, match=r"extra_args set \['--critic.save_value_network'\]"):
        build("openrlhf-ppo", {**OPENRLHF, "actor_gpus": 4, "critic_gpus": 4, "save_value_network": True,
                               "extra_args": ["--critic.save_value_network"]})
    # given as a flag the way a task could before (extra_args), it still is
    argv = build("openrlhf-ppo", {**OPENRLHF, "actor_gpus": 4, "critic_gpus": 4,
                                  "extra_args": ["--critic.save_value_network"]}).entrypoint
    assert argv.count("--critic.save_value_network") == 1


@pytest.mark.parametrize("version,key,load,ckpt", [("0.11.2", "--logger.wandb.key", "--ckpt.load_enable", "--ckpt.path"),
                                                   ("0.8.11", "--use_wandb", "--load_checkpoint", "--ckpt_path")])
def test_openrlhf_wandb_and_resume(version, key, load, ckpt):
    out = build("openrlhf-ppo", {**OPENRLHF, "colocate": "all", "version": version, "wandb_project": "p"})
    assert out.wandb_args[:2] == [key, "WANDB_API_KEY"] and "p" in out.wandb_args
    assert key not in out.entrypoint  # logging only when the key is provided
    assert flag(out.entrypoint, load) and flag(out.entrypoint, ckpt) == "/ckpt/ckpt"
    fresh = build("openrlhf-ppo", {**OPENRLHF, "colocate": "all", "version": version}, resume=False)
    assert flag(fresh.entrypoint, load) is None


def test_openrlhf_extra_args_pass_through_but_not_shape_flags():
    argv = build("openrlhf-ppo", {**OPENRLHF, "colocate": "all", "extra_args": ["--ds.zpg", "8"]}).entrypoint
    assert argv[-2:] == ["--ds.zpg", "8"]
    for owned in (["--actor.num_nodes", "1"], ["--vllm.num_engines=2"], ["--ckpt.path", "/x"]):
        with pytest.raises(BadInput, match="extra_args set"):
            build("openrlhf-ppo", {**OPENRLHF, "colocate": "all", "extra_args": owned})


def test_openrlhf_m_verifier_is_a_head_service_checked_by_post():
    out = build("openrlhf-m-grpo", {}, gpus=2)
    argv = out.entrypoint
    assert flag(argv, "--remote_rm_url") == "http://{head_addr}:5000/get_reward"
    assert flag(argv, "--advantage_estimator") == "group_norm" and flag(argv, "--colocate_all_models")
    assert flag(argv, "--vllm_num_engines") == "4" and flag(argv, "--actor_num_nodes") == "2"
    (service,) = out.services
    assert service.where == "head" and "openrlhf.models.remote_rm.math_verifier" in service.command
    ready = service.ready
    assert ready.method == "POST" and ready.http == "http://{node_addr}:5000/get_reward"
    assert set(ready.json_body) == {"query", "prompts"}
    assert out.prepare[0].startswith("test -f /ckpt/data/VerMulti/mathv60k_message.jsonl || ")
    assert "downloaders/download_mathv60k.py --root_dir /ckpt/data/VerMulti" in out.prepare[0]


# --- verl and Search-R1 ------------------------------------------------------------------


def test_verl_shape_checkpoints_resume_and_logger():
    out = build("verl-ppo", {})
    values = overrides(out.entrypoint)
    assert out.entrypoint[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    assert (values["trainer.nnodes"], values["trainer.n_gpus_per_node"]) == ("2", "8")
    assert values["trainer.default_local_dir"] == "/ckpt" and values["trainer.resume_mode"] == "auto"
    assert values["trainer.logger"] == "[console]" and out.wandb_args == ["trainer.logger=[console,wandb]"]
    assert values["data.train_files"] == "/ckpt/data/gsm8k/train.parquet"
    assert "critic.model.path" in values and values["actor_rollout_ref.actor.use_kl_loss"] == "False"
    assert out.prepare[1] == ("test -f /ckpt/data/gsm8k/train.parquet || python3 /opt/verl/examples/data_preprocess/"
                              "gsm8k.py --local_save_dir /ckpt/data/gsm8k")
    assert "outputs/" in out.excludes
    fresh = overrides(build("verl-ppo", {}, resume=False).entrypoint)
    assert fresh["trainer.resume_mode"] == "disable"
    grpo = overrides(build("verl-ppo", {"estimator": "grpo", "rollout_n": 5}).entrypoint)
    assert "critic.model.path" not in grpo and grpo["actor_rollout_ref.actor.use_kl_loss"] == "True"


def test_verl_paths_must_be_absolute():
    with pytest.raises(ValueError, match="absolute"):
        build("verl-ppo", {"train_files": "data/train.parquet"})


def test_search_r1_retriever_on_every_node_checked_by_a_query():
    out = build("search-r1", {}, resume=False)
    (service,) = out.services
    assert service.where == "every_node" and "search_r1/search/retrieval_server.py" in service.command
    assert service.ready.http == "http://127.0.0.1:8000/retrieve" and service.ready.method == "POST"
    assert set(service.ready.json_body) == {"queries", "topk", "return_scores"}
    values = overrides(out.entrypoint)
    assert values["retriever.url"] == "http://127.0.0.1:8000/retrieve"
    assert values["trainer.default_local_dir"] == "/ckpt" and values["trainer.nnodes"] == "2"
    assert out.env["VLLM_ATTENTION_BACKEND"] == "XFORMERS"
    assert all(step.startswith("test -f /ckpt/") for step in out.prepare)  # idempotent on a restart


@pytest.mark.parametrize("name,limit", [("search-r1-ppo-qwen2.5-7b", 65535), ("openrlhf-m-grpo-qwen2.5-vl-3b", 65536),
                                        ("verl-ppo-gsm8k", None), ("openrlhf-ppo-llama3-8b", None)])
def test_a_recipe_declares_the_open_files_limit_its_framework_needs(name, limit, capsys):
    """Search-R1's multi-node guide runs `ulimit -n 65535`, OpenRLHF-M's RunPod guides `ulimit -n 65536`; verl's
    PPO and OpenRLHF's guides set none. The plan carries it to every node's agent, and `check` says it."""
    task = load_task(TASKS[name])
    assert providers.get("dstack").plan(task).open_files == limit
    assert main(["check", str(TASKS[name]), "--provider", "dstack"]) == 0
    out = capsys.readouterr().out
    if limit:
        assert (f"  open_files {limit} (the {task.job.recipe} recipe's): every node's agent raises its soft limit "
                "to it before Ray starts, and stops where the node's hard limit is lower") in out
    else:
        assert "open_files" not in out


def test_job_open_files_overrides_the_recipes():
    data = load_task(TASKS["search-r1-ppo-qwen2.5-7b"]).model_dump(mode="json", exclude_unset=True, by_alias=True)
    data["job"]["open_files"] = 32768
    assert providers.get("dstack").plan(parse_task(data)).open_files == 32768
    data["job"].update(recipe="command", args={"entrypoint": "true"}, open_files=100000)
    assert providers.get("dstack").plan(parse_task(data)).open_files == 100000  # any recipe's job can ask
    with pytest.raises(BadInput, match="job.open_files"):
        parse_task({**data, "job": {**data["job"], "open_files": 0}})


# --- the catalogue -------------------------------------------------------------------------


@pytest.mark.parametrize("name", TASKS)
def test_catalogue_task_plan(name):
    task = load_task(TASKS[name])
    plan = providers.get("dstack").plan(task)
    assert {"WANDB_API_KEY", "HF_TOKEN"} <= set(plan.secrets) and task.image
    assert plan.checkpoint_dir == f"/checkpoints/{task.name}"
    assert plan.job.wandb_args and not any("WANDB_API_KEY=" in a for a in plan.job.entrypoint)


def test_recipes_command_lists_recipes_and_tasks(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for recipe in ("openrlhf-ppo", "openrlhf-m-grpo", "verl-ppo", "search-r1"):
        assert f"\n{recipe}: " in out
    for path in TASKS.values():
        assert f"tasks/{path.name}" in out


def test_unknown_recipe_argument_names_its_path():
    data = {"name": "x", "nodes": 1, "job": {"recipe": "verl-ppo", "args": {"trainbatch": 1}}}
    with pytest.raises(BadInput, match="job.args.trainbatch"):
        parse_task(data, "t.yaml")
