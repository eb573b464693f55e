"""verl-ppo: verl's PPO trainer (`python3 -m verl.trainer.main_ppo`, Hydra overrides) for
verl 0.9.1, with the cluster shape, checkpoint directory, resume and logger filled in.

Rank 0 prepares the data with one of verl's `examples/data_preprocess` scripts into the
shared checkpoint directory, where the trainer (a Ray actor on any node) reads it. The
checks restate verl's own (cited where they are made); the overrides are composed against
verl's Hydra config in the tests."""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import Field, field_validator

from ..models import require_absolute
from .base import JobBase, RecipeOutput, Shape, StrictModel, hub_models, infeasible
from .metrics import VerlReader

VERL_VERSION = "0.9.1"
VERL_REPO = "https://github.com/volcengine/verl"

#: verl/trainer/ppo/core_algos.py: estimators whose baseline is the other samples of the same
#: prompt; compute_grpo_outcome_advantage gives a group of one mean 0 and std 1 (the raw score).
GROUP_ESTIMATORS = {"grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk", "gpg", "opo"}

#: Hydra keys that carry the cluster's shape or the run's state: never taken from extra_overrides.
OWNED = {"trainer.nnodes", "trainer.n_gpus_per_node", "trainer.default_local_dir", "trainer.resume_mode",
         "trainer.logger", "data.train_files", "data.val_files"}

#: What check says of verl's placement with node groups (verl 0.9.1, read in its wheel).
CONFINE_NOTE = ("verl places its resource pools on any GPU node: verl/trainer/ppo/v1/trainer_base.py "
                "_init_resource_pool_mgr builds {global_pool: [n_gpus_per_node] * nnodes} (and a reward_pool of GPU "
                "counts with reward.reward_model.enable_resource_pool), and verl/single_controller/ray/base.py "
                "ResourcePoolManager.create_resource_pool passes RayResourcePool no accelerator_type, so each pool is "
                "STRICT_PACK placement groups of {CPU, GPU: 1} bundles on whichever nodes have the GPUs free: no role "
                "(actor, rollout, reference, critic, reward model) can be confined to a group")

#: Kept out of the uploaded working_dir, besides the plan's defaults: Hydra's run directories.
EXCLUDES = ["outputs/", "multirun/", "*.log"]


def override_keys(overrides: list[str]) -> set[str]:
    """Keys set by Hydra overrides (`+key=v`, `++key=v`, `~key` included)."""
    return {item.split("=")[0].lstrip("+~") for item in overrides}


def check_divides(what: str, value: int, gpus: int, suggestion: str, args: tuple[str, ...]) -> None:
    if value % gpus:
        raise infeasible(f"{what} = {value} is not divisible by the cluster's {gpus} GPUs "
                         f"({value} % {gpus} = {value % gpus})", suggestion, args=args)


def check_tensor_parallel(tp: int, per_node: int) -> None:
    """vLLM's tensor parallel group must sit inside a node."""
    # verl/workers/rollout/vllm_rollout/vllm_async_server.py: "gpus_per_node should be divisible by
    # tensor_model_parallel_size"; verl/workers/engine_workers.py: "rollout world_size ... is not
    # divisible by infer_world_size".
    if tp > per_node or per_node % tp:
        raise infeasible(f"rollout tensor parallel size {tp} does not divide {per_node} GPUs per node",
                         f"use a rollout_tensor_parallel_size that divides {per_node}",
                         args=("rollout_tensor_parallel_size",))


class VerlPPOArgs(StrictModel):
    model: str = Field("Qwen/Qwen2.5-7B-Instruct", description="actor (and reference) model: Hugging Face name "
                       "or path")
    critic_model: str | None = Field(None, description="critic model (gae only); default: the actor model")
    estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                       "grpo_passk", "gpg", "opo"] = Field("gae", description="algorithm.adv_estimator: gae is "
                                                           "PPO with a critic, grpo needs rollout_n > 1")
    dataset: str | None = Field("gsm8k", pattern=r"^\w+$", description="verl's examples/data_preprocess/<dataset>.py, run on rank 0 "
                                "into <checkpoints>/data/<dataset>; null to give train_files and val_files")
    train_files: str | None = Field(None, description="training parquet (absolute); default: the prepared dataset")
    val_files: str | None = Field(None, description="validation parquet (absolute); default: the prepared dataset")
    verl_source: str = Field("/opt/verl", description="where rank 0 checks out verl's examples (cloned at "
                             f"v{VERL_VERSION} when missing)")
    train_batch_size: int = Field(1024, ge=1, description="prompts per step")
    max_prompt_length: int = Field(512, ge=1)
    max_response_length: int = Field(512, ge=1)
    rollout_n: int = Field(1, ge=1, description="responses per prompt")
    ppo_mini_batch_size: int = Field(256, ge=1, description="prompts per actor update")
    ppo_micro_batch_size_per_gpu: int = Field(16, ge=1)
    log_prob_micro_batch_size_per_gpu: int = Field(32, ge=1)
    critic_micro_batch_size_per_gpu: int = Field(32, ge=1)
    rollout_tensor_parallel_size: int = Field(2, ge=1, description="GPUs per vLLM replica; must divide GPUs per node")
    gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="vLLM's share of GPU memory")
    actor_lr: float = Field(1e-6, gt=0)
    critic_lr: float = Field(1e-5, gt=0)
    kl: Literal["none", "loss", "reward"] | None = Field(None, description="KL to the reference model: as an actor "
                                                        "loss (GRPO), as a reward penalty, or none; default: loss "
                                                        "for group estimators, none for gae")
    kl_coef: float = Field(0.001, ge=0, description="KL coefficient")
    total_epochs: int = Field(15, ge=1)
    save_freq: int = Field(20, description="checkpoint every this many steps (-1: never; resume needs checkpoints)")
    test_freq: int = Field(5, description="validate every this many steps (-1: never)")
    project_name: str = Field("verl_example_gsm8k", description="trainer.project_name (W&B project)")
    experiment_name: str = Field("qwen2.5-7b-ppo", description="trainer.experiment_name (W&B run)")
    extra_overrides: list[str] = Field([], description="more Hydra overrides for verl's ppo_trainer config; keys "
                                       "that carry the cluster's shape, checkpoints or logger are refused")

    _absolute = field_validator("train_files", "val_files", "verl_source")(classmethod(lambda cls, v: require_absolute(v, "relative paths resolve inside Ray's working_dir copy")))


def ask_verl(argv: list[str], extra_overrides: list[str]) -> list[str]:
    """verl's own Hydra config, composed with the overrides as `verl.trainer.main_ppo`'s @hydra.main
    composes them (struct mode: a key the config lacks is refused), where verl is installed here."""
    import importlib.util

    from ..errors import BadInput
    from . import installed

    what = "verl's Hydra config (verl/trainer/config/ppo_trainer.yaml)"
    where, version = installed.package("verl")
    if where is None:
        return [f"{what}: not checked: verl is not installed here (`pip install --no-deps verl=={VERL_VERSION} "
                f"hydra-core` puts its config here without its GPU dependencies)"]
    if version != VERL_VERSION:
        return [f"{what}: not checked: verl {version} is installed here, the recipe renders for verl {VERL_VERSION}"]
    if importlib.util.find_spec("hydra") is None:
        return [f"{what}: not checked: hydra-core, which composes it, is not installed here (pip install hydra-core)"]
    try:
        installed.hydra_compose(where / "trainer" / "config", "ppo_trainer", argv)
    except installed.Refused as exc:
        words = str(exc)
        mine = [i for i, item in enumerate(extra_overrides) if item.split("=")[0].lstrip("+~") in words]
        field = f"job.args.extra_overrides[{mine[0]}]" if mine else "job.args"
        hint = _near_key(where / "trainer" / "config", argv, extra_overrides[mine[0]]) if mine else ""
        raise BadInput(f"{field}: verl {version}'s Hydra compose refuses the overrides: "
                       + words.replace("\n", "\n  ") + hint) from None
    return [f"{what} of verl {version}, installed here: the overrides compose"]


def _near_key(config_dir, argv: list[str], refused: str) -> str:
    """'(did you mean ...?)' from the keys verl's config has beside the refused one."""
    from omegaconf import OmegaConf

    from ..models import did_you_mean
    from . import installed

    key = refused.split("=")[0].lstrip("+~")
    parent, _, leaf = key.rpartition(".")
    try:
        cfg = installed.hydra_compose(config_dir, "ppo_trainer", [a for a in argv if a != refused])
        node = OmegaConf.select(cfg, parent) if parent else cfg
    except Exception:  # the rest refused too: say only Hydra's words
        return ""
    keys = list(node.keys()) if OmegaConf.is_dict(node) else []
    hint = did_you_mean(leaf, keys, "its keys here") if keys else ""
    return f"\n  {parent + '.' if parent else ''}{leaf}: {hint}" if hint.startswith("(did") else ""


class VerlPPOJob(JobBase):
    """verl PPO/GRPO with the shape, checkpoints, resume and logger taken from the task."""

    recipe_summary = f"verl {VERL_VERSION} PPO / GRPO (verl.trainer.main_ppo), data prepared on rank 0"
    recipe_needs = f"verl {VERL_VERSION} with vllm on every node (verlai/verl image + pip install verl); git on " \
                   "rank 0 for the examples; GPUs; a shared checkpoints.path"

    recipe: Literal["verl-ppo"]
    args: VerlPPOArgs = VerlPPOArgs()

    def metrics_reader(self):
        return VerlReader()

    def ask_framework(self, argv: list[str]) -> list[str]:
        return self._placement + ask_verl(argv[3:], self.args.extra_overrides)

    def build(self, shape: Shape) -> RecipeOutput:
        a = self.args
        ckpt = shape.checkpoint_dir
        if ckpt is None:
            raise infeasible("verl needs a checkpoint directory", "set checkpoints.path", fields=("checkpoints.path",))
        if shape.gpus_per_node == 0:
            raise infeasible("verl trains on GPUs but the task has none", "set resources.gpus, e.g. H100:8",
                             fields=("resources.gpus",))
        gpus = shape.nodes * shape.gpus_per_node
        # check prints it with what it asked of verl (ask_framework follows build on the same job); shape_of counts
        # every GPU group at its fewest GPUs per node, since the pools may land on any of them
        self._placement = [CONFINE_NOTE + f" (they count {shape.nodes} node(s) x {shape.gpus_per_node} GPUs)"] \
            if shape.groups else []
        if a.estimator in GROUP_ESTIMATORS and a.rollout_n < 2:
            raise infeasible(f"{a.estimator} compares responses to the same prompt but rollout_n is {a.rollout_n}",
                             "set rollout_n to 2 or more (e.g. 5)", args=("rollout_n", "estimator"))
        # verl/utils/config.py validate_config: "real_train_batch_size ... must be divisible by
        # minimal possible batch size" (the GPU count for FSDP).
        check_divides(f"train_batch_size x rollout_n = {a.train_batch_size} x {a.rollout_n}",
                      a.train_batch_size * a.rollout_n, gpus, f"use a train_batch_size that makes this a multiple "
                      f"of {gpus}", ("train_batch_size", "rollout_n"))
        # verl/workers/config/actor.py ActorConfig.validate: "train_batch_size must be >= ppo_mini_batch_size".
        if a.train_batch_size < a.ppo_mini_batch_size:
            raise infeasible(f"train_batch_size {a.train_batch_size} < ppo_mini_batch_size {a.ppo_mini_batch_size}",
                             "lower ppo_mini_batch_size", args=("ppo_mini_batch_size", "train_batch_size"))
        # verl/workers/engine_workers.py TrainingWorker.train_mini_batch: the mini-batch (times
        # rollout.n) is split evenly over the data-parallel ranks.
        check_divides(f"ppo_mini_batch_size x rollout_n = {a.ppo_mini_batch_size} x {a.rollout_n}",
                      a.ppo_mini_batch_size * a.rollout_n, gpus, f"use a ppo_mini_batch_size that makes this a "
                      f"multiple of {gpus}", ("ppo_mini_batch_size", "rollout_n"))
        check_tensor_parallel(a.rollout_tensor_parallel_size, shape.gpus_per_node)
        clash = sorted(override_keys(a.extra_overrides) & OWNED)
        if clash:
            raise infeasible(f"extra_overrides set {clash}, which the recipe sets from the task",
                             "use the task's nodes, resources, checkpoints and secrets instead",
                             args=("extra_overrides",))

        prepare = []
        train, val = a.train_files, a.val_files
        if a.dataset:
            data = f"{ckpt}/data/{a.dataset}"
            train, val = train or f"{data}/train.parquet", val or f"{data}/test.parquet"
            src, out = shlex.quote(a.verl_source), shlex.quote(data)
            prepare = [
                f"test -d {src}/examples || git clone --depth 1 --branch v{VERL_VERSION} {VERL_REPO} {src}",
                f"test -f {out}/train.parquet || python3 {src}/examples/data_preprocess/{a.dataset}.py "
                f"--local_save_dir {out}",
            ]
        if not (train and val):
            raise infeasible("no training data: dataset is null and train_files or val_files is missing",
                             "set dataset (e.g. gsm8k) or both train_files and val_files",
                             args=("dataset", "train_files", "val_files"))

        kl = a.kl or ("loss" if a.estimator in GROUP_ESTIMATORS else "none")
        overrides = [
            f"algorithm.adv_estimator={a.estimator}",
            f"data.train_files={train}",
            f"data.val_files={val}",
            f"data.train_batch_size={a.train_batch_size}",
            f"data.max_prompt_length={a.max_prompt_length}",
            f"data.max_response_length={a.max_response_length}",
            "data.filter_overlong_prompts=True",
            "data.truncation=error",
            f"actor_rollout_ref.model.path={a.model}",
            f"actor_rollout_ref.actor.optim.lr={a.actor_lr}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu}",
            f"actor_rollout_ref.actor.use_kl_loss={kl == 'loss'}",
            f"actor_rollout_ref.actor.kl_loss_coef={a.kl_coef}",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.n={a.rollout_n}",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={a.rollout_tensor_parallel_size}",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={a.gpu_memory_utilization}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={a.log_prob_micro_batch_size_per_gpu}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={a.log_prob_micro_batch_size_per_gpu}",
            f"algorithm.use_kl_in_reward={kl == 'reward'}",
            f"algorithm.kl_ctrl.kl_coef={a.kl_coef}",
        ]
        if a.estimator == "gae":
            overrides += [
                f"critic.model.path={a.critic_model or a.model}",
                f"critic.optim.lr={a.critic_lr}",
                f"critic.ppo_micro_batch_size_per_gpu={a.critic_micro_batch_size_per_gpu}",
            ]
        overrides += [
            "trainer.logger=[console]",
            f"trainer.project_name={a.project_name}",
            f"trainer.experiment_name={a.experiment_name}",
            f"trainer.nnodes={shape.nodes}",
            f"trainer.n_gpus_per_node={shape.gpus_per_node}",
            f"trainer.total_epochs={a.total_epochs}",
            f"trainer.save_freq={a.save_freq}",
            f"trainer.test_freq={a.test_freq}",
            f"trainer.default_local_dir={ckpt}",
            f"trainer.resume_mode={'auto' if shape.resume else 'disable'}",
            *a.extra_overrides,
        ]
        return RecipeOutput(
            entrypoint=["python3", "-m", "verl.trainer.main_ppo", *overrides],
            prepare=prepare,
            # From verl's runtime_env.yaml, which the wheel does not ship (the rest verl sets itself).
            env={"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"},
            excludes=EXCLUDES,
            # a later override of the same key wins; verl's wandb.init takes its project from trainer.project_name
            wandb_args=["trainer.logger=[console,wandb]"] + (
                [f"trainer.project_name={shape.wandb.project}"] if shape.wandb and shape.wandb.project else []),
            summary={"checkpoints": ckpt, "train_files": train, "gpus": gpus},
            checkpoint_files=["global_step_*"],  # verl's trainer: <default_local_dir>/global_step_N
            models=hub_models(a.model, a.critic_model if a.estimator == "gae" else None),  # actor and reference; critic
        )
