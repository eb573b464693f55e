"""The commands recipes render, checked by the frameworks themselves (tests/frameworks.py):
verl's Hydra config composes them, OpenRLHF's own argument parser and start-up assertions
accept them, in the dialect of each release; a misspelled key or a renamed flag fails."""

from __future__ import annotations

import importlib.util

import pytest

from rlhf_tasks import providers
from rlhf_tasks.recipes import JOB_MODELS, recipe_name
from rlhf_tasks.recipes.base import Shape
from rlhf_tasks.recipes.verl import VERL_VERSION
from rlhf_tasks.spec import load_task

import frameworks
from conftest import ROOT, need

MODELS = {recipe_name(model): model for model in JOB_MODELS}
TASKS = sorted((ROOT / "tasks").glob("*.yaml"))

#: OpenRLHF releases the parser is taken from: current, the last with flat flags, the 0.8
#: line the flat-flag docs describe, and the release OpenRLHF-M forked (its parser is
#: 0.6.1's plus four multimodal flags the recipe does not set).
OPENRLHF = {"current": "0.11.2", "last flat": "0.10.1", "legacy": "0.8.11", "OpenRLHF-M base": "0.6.1.post1"}


def catalogue(*recipes: str) -> list:
    """(task, plan) of the catalogue tasks that use these recipes."""
    tasks = [task for task in map(load_task, TASKS) if task.job.recipe in recipes]
    assert tasks, f"no catalogue task uses {recipes}"
    return [(task, providers.get("dstack").plan(task)) for task in tasks]


def rendered(recipe: str, args: dict, nodes=2, gpus=8, resume=True) -> list[str]:
    job = MODELS[recipe].model_validate({"recipe": recipe, "args": args})
    out = job.build(Shape(nodes=nodes, gpus_per_node=gpus, checkpoint_dir="/ckpt", resume=resume))
    return out.entrypoint[3:] + out.wandb_args


@pytest.fixture(scope="module")
def hydra():
    need(importlib.util.find_spec("hydra") is not None, "hydra-core is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def verl_config(hydra):
    config, why = frameworks.verl_config_dir(VERL_VERSION)
    need(config is not None, f"verl {VERL_VERSION} config: {why}")
    return config


@pytest.fixture(scope="module")
def openrlhf():
    mains = {}

    def main(version):
        if version not in mains:
            mains[version] = frameworks.openrlhf_main(version)
        compiled, why = mains[version]
        need(compiled is not None, f"openrlhf {version}: {why}")
        return compiled
    return main


# --- verl ------------------------------------------------------------------------------------


def test_verl_catalogue_tasks_compose(verl_config):
    from omegaconf import OmegaConf

    for _, plan in catalogue("verl-ppo"):
        cfg = frameworks.compose(verl_config, "ppo_trainer", plan.job.entrypoint[3:] + plan.job.wandb_args)
        OmegaConf.resolve(cfg)
        assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (plan.nodes, plan.gpus_per_node)
        assert cfg.trainer.default_local_dir == plan.checkpoint_dir and cfg.trainer.resume_mode == "auto"
        assert list(cfg.trainer.logger) == ["console", "wandb"]


@pytest.mark.parametrize("args,resume", [({"estimator": "grpo", "rollout_n": 5}, False),
                                         ({"kl": "reward", "extra_overrides": ["trainer.val_before_train=False"]}, True)])
def test_verl_variants_compose(verl_config, args, resume):
    overrides = rendered("verl-ppo", args, resume=resume)[:-1]  # without wandb: console only
    cfg = frameworks.compose(verl_config, "ppo_trainer", overrides)
    assert list(cfg.trainer.logger) == ["console"]
    assert cfg.trainer.resume_mode == ("auto" if resume else "disable")


def test_verl_misspelled_key_fails(verl_config):
    from hydra.errors import ConfigCompositionException

    overrides = rendered("verl-ppo", {"extra_overrides": ["trainer.val_befor_train=False"]})
    with pytest.raises(ConfigCompositionException, match="val_befor_train"):
        frameworks.compose(verl_config, "ppo_trainer", overrides)


# --- Search-R1 (its config copied in tests/frameworks.py: Search-R1 is not on PyPI) ---------


@pytest.mark.parametrize("args", [None, {"estimator": "grpo", "n_agent": 5}])
def test_search_r1_composes(hydra, tmp_path, args):
    from omegaconf import OmegaConf

    overrides = (catalogue("search-r1")[0][1].job.entrypoint[3:] + ["trainer.logger=[console,wandb]"] if args is None
                 else rendered("search-r1", args, resume=False))
    cfg = frameworks.compose(frameworks.search_r1_config_dir(tmp_path), "ppo_trainer", overrides)
    OmegaConf.resolve(cfg)
    assert cfg.retriever.url == "http://127.0.0.1:8000/retrieve" and cfg.trainer.default_local_dir.startswith("/")


def test_search_r1_misspelled_key_fails(hydra, tmp_path):
    from hydra.errors import ConfigCompositionException

    overrides = rendered("search-r1", {"extra_overrides": ["retriever.top_k=5"]}, resume=False)
    with pytest.raises(ConfigCompositionException, match="top_k"):
        frameworks.compose(frameworks.search_r1_config_dir(tmp_path), "ppo_trainer", overrides)


# --- OpenRLHF ------------------------------------------------------------------------------


def test_openrlhf_catalogue_tasks_parse(openrlhf):
    for task, plan in catalogue("openrlhf-ppo", "openrlhf-m-grpo"):
        # OpenRLHF-M's trainer is the 0.6.1 it forked
        version = task.job.args.version if task.job.recipe == "openrlhf-ppo" else OPENRLHF["OpenRLHF-M base"]
        args = frameworks.openrlhf_parse(openrlhf(version), plan.job.entrypoint[3:] + plan.job.wandb_args)
        shape = (args.actor.num_nodes, args.actor.num_gpus_per_node) if hasattr(args, "actor") else \
            (args.actor_num_nodes, args.actor_num_gpus_per_node)
        assert shape[0] * shape[1] == plan.job.summary["roles"]["actor"], task.name


SETUPS = {
    "ppo-pairs": {"actor_gpus": 4, "critic_gpus": 4, "vllm_tensor_parallel_size": 2, "packing_samples": True},
    "ppo-hybrid": {"colocate": "all", "sleep": True, "vllm_tensor_parallel_size": 4, "vllm_gpu_memory_utilization": 0.5},
    "ppo-separate": {"colocate": "none", "actor_gpus": 4, "critic_gpus": 2, "ref_gpus": 2, "reward_gpus": 2,
                     "vllm_engines": 4, "label_key": "answer", "temperature": 0.9},
    "grpo-remote": {"colocate": "all", "estimator": "group_norm", "n_samples_per_prompt": 8, "reward_pretrain": None,
                    "reward_url": "http://{head_addr}:5000/get_reward", "use_kl_loss": True, "kl_estimator": "k3"},
}


@pytest.mark.parametrize("release", OPENRLHF)
@pytest.mark.parametrize("setup", SETUPS)
def test_openrlhf_setups_parse_in_each_release(openrlhf, release, setup):
    version = OPENRLHF[release]
    argv = rendered("openrlhf-ppo", {"pretrain": "a", "reward_pretrain": "rm", "prompt_data": "p",
                                     "version": version, **SETUPS[setup]})
    frameworks.openrlhf_parse(openrlhf(version), argv)


@pytest.mark.parametrize("rendered_for,parsed_by", [("0.11.2", "0.8.11"), ("0.8.11", "0.11.2"), ("0.10.1", "0.10.2")])
def test_openrlhf_flags_of_the_wrong_dialect_are_rejected(openrlhf, rendered_for, parsed_by):
    argv = rendered("openrlhf-ppo", {"pretrain": "a", "reward_pretrain": "rm", "prompt_data": "p",
                                     "colocate": "all", "version": rendered_for})
    with pytest.raises(frameworks.Rejected, match="unrecognized arguments"):
        frameworks.openrlhf_parse(openrlhf(parsed_by), argv)


def test_openrlhf_start_up_assertions_run(openrlhf):
    """The harness runs OpenRLHF's own assertions: a hand-edited hybrid command whose vLLM
    engines do not fill the actor's GPUs fails there, as it fails the recipe's check."""
    argv = rendered("openrlhf-ppo", {"pretrain": "a", "reward_pretrain": "rm", "prompt_data": "p", "colocate": "all"})
    frameworks.openrlhf_parse(openrlhf(OPENRLHF["current"]), argv)
    argv[argv.index("--vllm.num_engines") + 1] = "3"
    with pytest.raises(frameworks.Rejected, match="must be equal to vllm_num_engines"):
        frameworks.openrlhf_parse(openrlhf(OPENRLHF["current"]), argv)


@pytest.mark.parametrize("release", ["current", "last flat", "legacy"])
def test_openrlhf_checkpoint_options_parse_as_each_release_takes_them(openrlhf, release):
    """save_value_network and use_ds_universal_ckpt reach train_ppo_ray's own args under its own names."""
    version = OPENRLHF[release]
    argv = rendered("openrlhf-ppo", {"pretrain": "a", "reward_pretrain": "rm", "prompt_data": "p", "version": version,
                                     "actor_gpus": 4, "critic_gpus": 4, "save_value_network": True,
                                     "use_ds_universal_ckpt": True})
    args = frameworks.openrlhf_parse(openrlhf(version), argv)
    saved, universal = ((args.critic.save_value_network, args.ds.use_universal_ckpt) if hasattr(args, "critic") else
                        (args.save_value_network, args.use_ds_universal_ckpt))
    assert saved is True and universal is True


def test_openrlhf_m_base_has_save_value_network_and_no_universal_checkpoints(openrlhf):
    """The 0.6.1 OpenRLHF-M forked parses --save_value_network; the recipe refuses use_ds_universal_ckpt there
    before its parser would (it has no such flag)."""
    version = OPENRLHF["OpenRLHF-M base"]
    base = {"pretrain": "a", "reward_pretrain": "rm", "prompt_data": "p", "version": version, "actor_gpus": 4,
            "critic_gpus": 4}
    args = frameworks.openrlhf_parse(openrlhf(version), rendered("openrlhf-ppo", {**base, "save_value_network": True}))
    assert args.save_value_network is True
    with pytest.raises(ValueError, match="universal checkpoint loading came in 0.6.3"):
        rendered("openrlhf-ppo", {**base, "use_ds_universal_ckpt": True})
    argv = rendered("openrlhf-ppo", {**base, "version": "0.8.11", "use_ds_universal_ckpt": True})
    with pytest.raises(frameworks.Rejected, match="unrecognized arguments: --use_ds_universal_ckpt"):
        frameworks.openrlhf_parse(openrlhf(version), argv[:argv.index("--use_ds_universal_ckpt") + 1])
