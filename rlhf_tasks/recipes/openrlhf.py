"""openrlhf-ppo: OpenRLHF's Ray trainer (`python3 -m openrlhf.cli.train_ppo_ray`) for PPO,
GRPO and REINFORCE++. Every role's node and GPU flags and the vLLM engine count are
filled from the cluster and checked before anything is rented.

OpenRLHF renamed every flag in 0.10.2 (`--actor_num_nodes` became `--actor.num_nodes`);
`version` picks the dialect, so one task runs on the flat flags of the published docs
and OpenRLHF-M as well as on the dotted flags of current releases. The checks below
restate OpenRLHF's own assertions (`openrlhf/cli/train_ppo_ray.py`, 0.6.1 to 0.11.2).
"""

from __future__ import annotations

import re
import shlex
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import (WHERE_PATTERN, JobBase, RecipeOutput, Service, Shape, StrictModel, hub_models, infeasible,
                   role_group, served_line, without_group)
from .metrics import OpenRLHFReader

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:\.post\d+)?$")

DOTTED_SINCE = (0, 10, 2)  # train_ppo_ray.py of 0.10.1 still has --actor_num_nodes, 0.10.2 --actor.num_nodes
#: train_ppo_ray.py's DeepSpeed universal checkpoint flag (DeepSpeed's checkpoint.load_universal): none in 0.6.2,
#: --universal_ckpt in 0.6.3, renamed --use_ds_universal_ckpt in 0.6.4 (OpenRLHF commit 8ff7397), dotted in 0.10.2.
UNIVERSAL_SINCE, UNIVERSAL_RENAMED = (0, 6, 3), (0, 6, 4)

#: dotted flag (>= 0.10.2) -> flat flag (<= 0.10.1 and OpenRLHF-M), for every flag a recipe sets.
FLAT = {
    "--actor.num_nodes": "--actor_num_nodes",
    "--actor.num_gpus_per_node": "--actor_num_gpus_per_node",
    "--ref.num_nodes": "--ref_num_nodes",
    "--ref.num_gpus_per_node": "--ref_num_gpus_per_node",
    "--critic.num_nodes": "--critic_num_nodes",
    "--critic.num_gpus_per_node": "--critic_num_gpus_per_node",
    "--reward.num_nodes": "--reward_num_nodes",
    "--reward.num_gpus_per_node": "--reward_num_gpus_per_node",
    "--vllm.num_engines": "--vllm_num_engines",
    "--vllm.tensor_parallel_size": "--vllm_tensor_parallel_size",
    "--vllm.gpu_memory_utilization": "--vllm_gpu_memory_utilization",
    "--vllm.sync_backend": "--vllm_sync_backend",
    "--vllm.enable_sleep": "--vllm_enable_sleep",
    "--vllm.enforce_eager": "--enforce_eager",
    "--vllm.enable_prefix_caching": "--enable_prefix_caching",
    "--ds.enable_sleep": "--deepspeed_enable_sleep",
    "--train.colocate_all": "--colocate_all_models",
    "--train.colocate_actor_ref": "--colocate_actor_ref",
    "--train.colocate_critic_reward": "--colocate_critic_reward",
    "--actor.model_name_or_path": "--pretrain",
    "--reward.model_name_or_path": "--reward_pretrain",
    "--critic.model_name_or_path": "--critic_pretrain",
    "--reward.remote_url": "--remote_rm_url",
    "--data.prompt_dataset": "--prompt_data",
    "--data.input_key": "--input_key",
    "--data.label_key": "--label_key",
    "--data.apply_chat_template": "--apply_chat_template",
    "--data.max_samples": "--max_samples",
    "--data.max_len": "--max_len",
    "--rollout.max_new_tokens": "--max_new_tokens",
    "--rollout.batch_size": "--rollout_batch_size",
    "--rollout.micro_batch_size": "--micro_rollout_batch_size",
    "--rollout.n_samples_per_prompt": "--n_samples_per_prompt",
    "--rollout.temperature": "--temperature",
    "--train.batch_size": "--train_batch_size",
    "--train.micro_batch_size": "--micro_train_batch_size",
    "--train.max_epochs": "--max_epochs",
    "--train.num_episodes": "--num_episodes",
    "--algo.advantage.estimator": "--advantage_estimator",
    "--algo.kl.init_coef": "--init_kl_coef",
    "--algo.kl.use_loss": "--use_kl_loss",
    "--algo.kl.estimator": "--kl_estimator",
    "--actor.adam.lr": "--actor_learning_rate",
    "--critic.adam.lr": "--critic_learning_rate",
    "--actor.gradient_checkpointing_enable": "--gradient_checkpointing",
    "--ds.zero_stage": "--zero_stage",
    "--ds.adam_offload": "--adam_offload",
    "--ds.packing_samples": "--packing_samples",
    "--reward.normalize_enable": "--normalize_reward",
    "--ckpt.output_dir": "--save_path",
    "--ckpt.path": "--ckpt_path",
    "--ckpt.save_steps": "--save_steps",
    "--ckpt.load_enable": "--load_checkpoint",
    "--ckpt.save_hf": "--save_hf_ckpt",
    "--critic.save_value_network": "--save_value_network",
    "--ds.use_universal_ckpt": "--use_ds_universal_ckpt",  # --universal_ckpt in 0.6.3 (_Argv.name)
    "--logger.wandb.key": "--use_wandb",
    "--logger.wandb.project": "--wandb_project",
    "--logger.wandb.org": "--wandb_org",
    "--logger.wandb.group": "--wandb_group",
}

#: Flags that carry the cluster's shape or the run's state: never taken from extra_args.
OWNED = [
    f"--{role}.{key}" for role in ("actor", "ref", "critic", "reward") for key in ("num_nodes", "num_gpus_per_node")
] + ["--vllm.num_engines", "--vllm.tensor_parallel_size", "--train.colocate_all", "--train.colocate_actor_ref",
     "--train.colocate_critic_reward", "--ckpt.output_dir", "--ckpt.path", "--ckpt.load_enable", "--logger.wandb.key"]

#: Estimators with a per-prompt group baseline: with one sample per prompt every advantage
#: is 0 (train_ppo_ray.py, __main__: "requires n_samples_per_prompt > 1").
GROUP_ESTIMATORS = {"rloo", "reinforce_baseline", "group_norm", "dr_grpo"}


def parse_version(text: str) -> tuple[int, int, int]:
    match = _VERSION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not an OpenRLHF version (use e.g. 0.11.2 or 0.8.11)")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


class OpenRLHFArgs(StrictModel):
    version: str = Field("0.11.2", description="OpenRLHF version on the nodes; picks the flag names: dotted "
                         "(--actor.num_nodes) since 0.10.2, flat (--actor_num_nodes) before, as in OpenRLHF-M")
    pretrain: str = Field(description="actor model: Hugging Face name or path")
    reward_pretrain: str | None = Field(None, description="reward model; leave out when reward_url is set")
    reward_url: str | None = Field(None, description="remote reward endpoint instead of a reward model; "
                                   "{head_addr} is replaced by the head's private address")
    reward_where: str = Field("ray", pattern=rf"^(ray|{WHERE_PATTERN})$", description=(
        "where the reward model runs: ray (a Ray role of train_ppo_ray, on any GPU node), or `group NAME`: served "
        "by openrlhf.cli.serve_rm on every node of that node group, the trainer asking it over HTTP "
        "(--reward.remote_url): the only role OpenRLHF lets out of Ray's placement"))
    reward_port: int = Field(5000, ge=1024, le=65535, description="serve_rm's port on the reward group's nodes")
    critic_pretrain: str | None = Field(None, description="critic model (gae only); default: the reward model, "
                                        "or the actor with a remote reward")
    prompt_data: str = Field(description="prompt dataset: Hugging Face name or path")
    input_key: str = Field("input", description="dataset field holding the prompt")
    label_key: str | None = Field(None, description="dataset field handed to a remote reward as the label")
    apply_chat_template: bool = Field(False, description="format prompts with the tokenizer's chat template")
    max_samples: int | None = Field(None, ge=1, description="use at most this many prompts")
    estimator: Literal["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo"] = Field(
        "gae", description="advantage estimator: gae is PPO (with a critic), group_norm is GRPO")
    colocate: Literal["all", "pairs", "none"] = Field(
        "pairs", description="all: every model and the vLLM engines share the actor's GPUs (hybrid engine); "
        "pairs: actor with reference, critic with reward model; none: every role on GPUs of its own")
    actor_gpus: int | None = Field(None, ge=1, description="GPUs of the actor; default with colocate all: every "
                                   "GPU of the cluster. At most one node's GPUs, or whole nodes")
    ref_gpus: int | None = Field(None, ge=1, description="GPUs of the reference model; default: actor_gpus")
    critic_gpus: int | None = Field(None, ge=1, description="GPUs of the critic (gae only); default: actor_gpus")
    reward_gpus: int | None = Field(None, ge=1, description="GPUs of the reward model; default: critic_gpus")
    vllm_engines: int | None = Field(None, ge=0, description="vLLM engines; default: fill the actor's GPUs "
                                     "(colocate all) or the GPUs the roles leave free; 0 generates without vLLM")
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM engine; must divide GPUs per node")
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM's share of GPU memory "
                                                      "(0.5 when colocated)")
    vllm_sync_backend: Literal["nccl", "gloo"] | None = Field(None, description="weight sync from DeepSpeed to vLLM")
    enforce_eager: bool = Field(False, description="disable CUDA graphs in vLLM")
    enable_prefix_caching: bool = Field(False, description="vLLM prefix caching")
    sleep: bool = Field(False, description="vLLM and DeepSpeed sleep modes (colocate all only): each frees its GPU "
                        "memory while the other works")
    n_samples_per_prompt: int = Field(1, ge=1, description="samples per prompt (> 1 for group estimators)")
    rollout_batch_size: int = Field(1024, ge=1, description="prompts per rollout")
    micro_rollout_batch_size: int = Field(16, ge=1, description="rollout batch per GPU")
    train_batch_size: int = Field(128, ge=1, description="global training batch")
    micro_train_batch_size: int = Field(8, ge=1, description="training batch per GPU")
    max_epochs: int = Field(1, ge=1)
    num_episodes: int = Field(1, ge=1)
    prompt_max_len: int = Field(1024, ge=1, description="tokens of a prompt")
    generate_max_len: int = Field(1024, ge=1, description="tokens generated per sample")
    temperature: float | None = Field(None, gt=0, description="sampling temperature")
    actor_learning_rate: float = Field(5e-7, gt=0)
    critic_learning_rate: float = Field(9e-6, gt=0)
    init_kl_coef: float = Field(0.01, ge=0, description="KL coefficient; 0 runs without a reference model")
    use_kl_loss: bool = Field(False, description="KL as a loss term (GRPO) instead of a reward penalty")
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(None, description="KL estimator (k3 with use_kl_loss)")
    zero_stage: Literal[0, 1, 2, 3] = Field(3, description="DeepSpeed ZeRO stage")
    adam_offload: bool = Field(False, description="keep Adam states in CPU memory")
    gradient_checkpointing: bool = True
    packing_samples: bool = Field(False, description="pack samples (needs vLLM)")
    normalize_reward: bool = False
    save_steps: int = Field(20, description="checkpoint every this many steps (-1: only at the end; "
                            "a resumed run restarts from the last checkpoint)")
    save_hf: bool = Field(False, description="also save Hugging Face weights with each checkpoint")
    save_value_network: bool = Field(False, description="also save the trained critic (gae only), as Hugging Face "
                                     "weights beside the final model (<checkpoints>/final_critic): "
                                     "--critic.save_value_network, --save_value_network before 0.10.2")
    use_ds_universal_ckpt: bool = Field(False, description="load DeepSpeed universal checkpoints (DeepSpeed's "
                                        "checkpoint.load_universal: a checkpoint converted with ds_to_universal, "
                                        "e.g. to resume on another number of GPUs): --ds.use_universal_ckpt, "
                                        "--use_ds_universal_ckpt before 0.10.2; OpenRLHF 0.6.3 and later")
    wandb_project: str | None = Field(None, description="W&B project (logging is on when WANDB_API_KEY is given)")
    extra_args: list[str] = Field([], description="more train_ppo_ray flags in the dialect of `version`; flags "
                                  "that carry the cluster's shape or checkpoints are refused")

    @field_validator("version")
    @classmethod
    def _known_version(cls, value):
        if parse_version(value) < (0, 6, 1):
            raise ValueError(f"{value}: rlhf-tasks supports OpenRLHF 0.6.1 and later")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if (self.reward_pretrain is None) == (self.reward_url is None):
            raise ValueError("set exactly one of reward_pretrain (a reward model) and reward_url (a remote reward)")
        if self.estimator == "dr_grpo" and parse_version(self.version) < (0, 7, 0):
            raise ValueError(f"dr_grpo needs OpenRLHF 0.7.0 or later (version is {self.version})")
        if self.use_ds_universal_ckpt and parse_version(self.version) < UNIVERSAL_SINCE:
            raise ValueError(f"use_ds_universal_ckpt: OpenRLHF's universal checkpoint loading came in 0.6.3 "
                             f"(--universal_ckpt); version is {self.version}, whose train_ppo_ray has no such flag: "
                             f"pin 0.6.3 or later, or leave use_ds_universal_ckpt out")
        return self


class _Argv:
    """train_ppo_ray flags in one dialect; flags are written dotted and renamed for old releases."""

    def __init__(self, version: tuple[int, int, int]):
        self.dotted = version >= DOTTED_SINCE
        self.version = version
        self.argv: list[str] = []

    def name(self, flag: str) -> str:
        if flag == "--ds.use_universal_ckpt" and self.version < UNIVERSAL_RENAMED:
            return "--universal_ckpt"
        return flag if self.dotted else FLAT[flag]

    def set(self, flag: str, value=True) -> None:
        if value is None or value is False:
            return
        self.argv += [self.name(flag)] if value is True else [self.name(flag), str(value)]


def _whole_nodes(role: str, gpus: int, per_node: int) -> tuple[int, int]:
    """A role's GPUs as (nodes, GPUs per node): part of one node, or whole nodes."""
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        raise infeasible(f"{role} needs {gpus} GPUs: more than one node's {per_node} and not whole nodes "
                         f"({gpus} = {gpus // per_node} x {per_node} + {gpus % per_node})",
                         f"give the {role} at most {per_node} GPUs or a multiple of {per_node}", args=(f"{role}_gpus",))
    return gpus // per_node, per_node


def _allocate(a: OpenRLHFArgs, shape: Shape) -> tuple[dict[str, int], int]:
    """GPUs per role and the vLLM engine count, checked against the cluster."""
    per_node, total = shape.gpus_per_node, shape.nodes * shape.gpus_per_node
    if per_node == 0:
        raise infeasible("OpenRLHF trains on GPUs but the task has none", "set resources.gpus, e.g. H100:8",
                         fields=("resources.gpus",))
    actor = a.actor_gpus or (total if a.colocate == "all" else None)
    if actor is None:
        raise infeasible(f"colocate: {a.colocate} needs actor_gpus", "set actor_gpus (and critic_gpus for gae), "
                         "or colocate: all to give every model all GPUs", args=("actor_gpus", "colocate"))
    roles = {"actor": actor}
    if a.init_kl_coef > 0:
        roles["ref"] = a.ref_gpus or actor
    if a.estimator == "gae":
        roles["critic"] = a.critic_gpus or actor
    if a.reward_url is None:
        roles["reward"] = a.reward_gpus or roles.get("critic", actor)
    for role, gpus in roles.items():
        _whole_nodes(role, gpus, per_node)

    # train(): "num_nodes and num_gpus_per_node must be the same when colocate actor and ref model"
    # and "... when colocate critic and reward model"; with colocate_all every model takes its
    # bundles from the actor's placement group, so each needs exactly the actor's GPUs.
    if a.colocate == "all":
        colocated = [("actor", role) for role in roles if role != "actor"]
    elif a.colocate == "pairs":
        colocated = [("actor", "ref"), ("critic", "reward")]
    else:
        colocated = []
    for first, second in colocated:
        if first in roles and second in roles and roles[first] != roles[second]:
            raise infeasible(f"{first} ({roles[first]} GPUs) and {second} ({roles[second]} GPUs) are colocated, "
                             "so they must have the same GPUs", f"set {second}_gpus to {roles[first]}, "
                             "or colocate: none", args=(f"{second}_gpus", f"{first}_gpus", "colocate"))
    sharing = {second for first, second in colocated if first in roles}
    groups = {role: gpus for role, gpus in roles.items() if role not in sharing}
    used, label = sum(groups.values()), " + ".join(f"{role} {gpus}" for role, gpus in groups.items())
    role_args = tuple(f"{role}_gpus" for role in groups)

    tp = a.vllm_tensor_parallel_size
    engines = a.vllm_engines
    if a.colocate == "all":
        engines = actor // tp if engines is None else engines
        # train(): "actor_num_nodes * actor_num_gpus_per_node must be equal to vllm_num_engines *
        # vllm_tensor_parallel_size" when colocate_all_models.
        if engines * tp != actor:
            raise infeasible(f"with colocate all the vLLM engines must fill the actor's GPUs exactly: "
                             f"{engines} engines x TP {tp} = {engines * tp} != actor {actor}",
                             f"set vllm_engines to {max(actor // tp, 1)} and actor_gpus to a multiple of {tp}",
                             args=("vllm_engines", "vllm_tensor_parallel_size", "actor_gpus"))
    else:
        engines = max(total - used, 0) // tp if engines is None else engines
        if engines == 0 and a.vllm_engines is None:
            raise infeasible(f"no GPUs left for vLLM: {label} = {used} of {shape.nodes} nodes x {per_node} GPUs",
                             "give the roles fewer GPUs, colocate: all, or vllm_engines: 0 to generate without vLLM",
                             args=(*role_args, "vllm_engines"))
        used, label = used + engines * tp, f"{label} + vLLM {engines} x TP {tp}"
    if engines and per_node % tp:
        # get_bundle_indices (openrlhf/trainer/ray/utils.py) hands each engine its bundles node by
        # node: an engine whose TP group does not divide a node straddles two nodes.
        raise infeasible(f"vLLM tensor parallel size {tp} does not divide {per_node} GPUs per node",
                         f"use a vllm_tensor_parallel_size that divides {per_node}",
                         args=("vllm_tensor_parallel_size",))
    if used > total:
        raise infeasible(f"the roles need {label} = {used} GPUs but the cluster has "
                         f"{shape.nodes} nodes x {per_node} GPUs = {total}",
                         "give the roles fewer GPUs, colocate them (colocate: pairs or all), or add nodes",
                         args=(*role_args, *(("vllm_engines", "vllm_tensor_parallel_size") if engines else ())))
    return roles, engines


def _check_training(a: OpenRLHFArgs, version: tuple[int, int, int], roles: dict[str, int], engines: int) -> None:
    """OpenRLHF's start-up assertions that depend on the allocation."""
    actor = roles["actor"]
    if a.estimator in GROUP_ESTIMATORS and a.n_samples_per_prompt < 2:
        raise infeasible(f"{a.estimator} compares samples of the same prompt but n_samples_per_prompt is "
                         f"{a.n_samples_per_prompt}", "set n_samples_per_prompt to 2 or more (e.g. 8)",
                         args=("n_samples_per_prompt", "estimator"))
    if a.sleep and a.colocate != "all":
        # __main__: "Set args.vllm_enable_sleep to False when args.colocate_all_models is disabled."
        raise infeasible("sleep modes only work when every model shares the GPUs", "set colocate: all, or sleep: false",
                         args=("sleep", "colocate"))
    if a.save_value_network and "critic" not in roles:
        # train(): the critic is saved only `if args.critic_pretrain and args.save_value_network` (0.6.1 to 0.11.2).
        raise infeasible(f"save_value_network saves the critic, and estimator {a.estimator} trains none (only gae "
                         "has a critic)", "leave save_value_network out, or use estimator: gae",
                         args=("save_value_network", "estimator"))
    if a.packing_samples and engines == 0:
        raise infeasible("packing_samples needs vLLM engines (\"Only support `--packing_samples` with vLLM.\")",
                         "set vllm_engines above 0, or packing_samples: false",
                         args=("packing_samples", "vllm_engines"))
    # __main__ (0.8.0+): "The number of sample batches must be greater than or equal to the
    # effective number of actor processes."
    batches = a.n_samples_per_prompt * a.rollout_batch_size // a.micro_rollout_batch_size
    if batches < actor:
        raise infeasible(f"n_samples_per_prompt x rollout_batch_size / micro_rollout_batch_size = "
                         f"{a.n_samples_per_prompt} x {a.rollout_batch_size} / {a.micro_rollout_batch_size} = "
                         f"{batches} micro-batches for {actor} actor GPUs", "raise rollout_batch_size or lower "
                         "micro_rollout_batch_size",
                         args=("n_samples_per_prompt", "rollout_batch_size", "micro_rollout_batch_size", "actor_gpus"))
    if version < (0, 7, 1):
        # _validate_args() of OpenRLHF <= 0.7.0, the base of OpenRLHF-M.
        if a.rollout_batch_size % actor:
            raise infeasible(f"rollout_batch_size {a.rollout_batch_size} is not divisible by the actor's {actor} "
                             "GPUs", f"use a multiple of {actor}", args=("rollout_batch_size", "actor_gpus"))
        if a.zero_stage == 3 and engines == 0:
            raise infeasible("ZeRO-3 needs vLLM engines in OpenRLHF < 0.7.1", "set vllm_engines, or zero_stage: 2",
                             args=("zero_stage", "vllm_engines"))
        if engines and actor % engines and engines % actor:
            raise infeasible(f"the actor's {actor} GPUs and {engines} vLLM engines must divide one another",
                             f"use a vllm_engines that divides {actor} or is a multiple of it",
                             args=("vllm_engines", "actor_gpus"))
        if "critic" in roles and actor % roles["critic"]:
            raise infeasible(f"the actor's {actor} GPUs are not divisible by the critic's {roles['critic']}",
                             f"give the critic a divisor of {actor} GPUs", args=("critic_gpus", "actor_gpus"))
    _check_deepspeed_batch(a, roles)


def _extra_value(extra_args: list[str], flags: tuple[str, ...], default: int) -> int:
    """An integer flag's value as given in extra_args (`--ds.ring_attn_size 2` or `=2`), else the default."""
    for i, arg in enumerate(extra_args):
        name, eq, value = arg.partition("=")
        if name in flags:
            value = value if eq else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            return int(value) if value.isdigit() else default
    return default


def _check_deepspeed_batch(a: OpenRLHFArgs, roles: dict[str, int]) -> None:
    """DeepSpeed's batch arithmetic for every role it runs (the actor and critic it trains, the
    reference and reward models it evaluates: OpenRLHF gives each the same batch sizes).

    OpenRLHF's DeepspeedStrategy (utils/deepspeed/deepspeed.py, get_ds_train_config and
    get_ds_eval_config, 0.6.1 to 0.11.2) hands DeepSpeed train_batch_size x ring_attn_size x
    ds tensor_parallel_size and micro_train_batch_size; DeepSpeed (runtime/config.py,
    _set_batch_related_parameters) takes gradient_accumulation_steps = train // micro // world size
    and _batch_assertion refuses a train batch that is not micro x accumulation x world size, and
    an accumulation of 0. With dynamic batches OpenRLHF sets micro and accumulation to 1 instead."""
    extra = a.extra_args
    if {"--train.dynamic_batch_enable", "--use_dynamic_batch"} & {arg.split("=")[0] for arg in extra}:
        return
    factor = (_extra_value(extra, ("--ds.ring_attn_size", "--ring_attn_size"), 1)
              * _extra_value(extra, ("--ds.tensor_parallel_size", "--ds_tensor_parallel_size"), 1))
    train, micro = a.train_batch_size * factor, a.micro_train_batch_size
    scaled = f"{a.train_batch_size} x {factor}" if factor > 1 else f"{a.train_batch_size}"
    for role, world in roles.items():
        accumulation = train // micro // world
        if accumulation == 0 or train != micro * accumulation * world:
            fitting = micro * world // factor if micro * world % factor == 0 else micro * world
            words = (f"Gradient accumulation steps: 0 has to be greater than 0" if accumulation == 0 else
                     f"train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size"
                     f"{train} != {micro} * {accumulation} * {world}")
            raise infeasible(
                f"DeepSpeed refuses the {role}'s batch on its {world} GPUs: train_batch_size {scaled} must be "
                f"micro_train_batch_size x gradient accumulation x world size ({micro} x {world} x a whole number "
                f"of at least 1); DeepSpeed's words: \"{words}\"",
                f"use a train_batch_size that is a multiple of {fitting} (micro_train_batch_size x the {role}'s "
                f"GPUs), or change micro_train_batch_size",
                args=("train_batch_size", "micro_train_batch_size", f"{role}_gpus"))


#: What check says of OpenRLHF's placement with node groups (train_ppo_ray.py and trainer/ray/launcher.py, 0.11.2).
CONFINE_NOTE = ("OpenRLHF places its Ray roles on any GPU node: train_ppo_ray builds each role's placement group of "
                "{GPU: 1, CPU: 1} bundles (PACK) and passes RayActorGroup no custom resources, so no flag confines "
                "the actor, reference, critic or vLLM to a group")


def _reward_group(a: OpenRLHFArgs, shape: Shape, version: tuple[int, int, int]):
    """With reward_where: group NAME, the serve_rm service on that group, the remote URL the trainer asks, and the
    shape of the other GPU groups the Ray roles count; else (None, None, shape)."""
    name = role_group(a.reward_where, shape, "reward_where", "reward model")
    if name is None:
        return None, None, shape
    if a.reward_pretrain is None:
        raise infeasible("reward_url is a reward served elsewhere: there is no reward model to serve on a group",
                         "set reward_pretrain instead of reward_url, or leave reward_where out", args=("reward_where",))
    rest = without_group(shape, name, "reward_where", "reward model")
    dotted = version >= DOTTED_SINCE
    # openrlhf/cli/serve_rm.py: --reward.model_name_or_path and --data.max_len (--reward_pretrain, --max_len before
    # 0.10.2), --host, --port; POST /get_reward {"query": [...]}
    model, max_len = ("--reward.model_name_or_path", "--data.max_len") if dotted else ("--reward_pretrain", "--max_len")
    command = shlex.join(["python3", "-m", "openrlhf.cli.serve_rm", model, a.reward_pretrain,
                          max_len, str(a.prompt_max_len + a.generate_max_len), "--port", str(a.reward_port)])
    service = Service.model_validate({
        "name": "reward-model", "where": a.reward_where,
        "command": f"{command} --host {{node_addr}}",
        "ready": {"http": f"http://{{node_addr}}:{a.reward_port}/get_reward", "method": "POST",
                  "json": {"query": ["ready"]}},
        "timeout": "30m",
    })
    return service, f"http://{{group_addr:{name}}}:{a.reward_port}/get_reward", rest


def openrlhf_command(a: OpenRLHFArgs, shape: Shape) -> RecipeOutput:
    """The train_ppo_ray command for this cluster, after every check."""
    if shape.checkpoint_dir is None:
        raise infeasible("OpenRLHF needs a checkpoint directory", "set checkpoints.path", fields=("checkpoints.path",))
    version = parse_version(a.version)
    served, served_url, shape = _reward_group(a, shape, version)
    served_model = a.reward_pretrain if served is not None else None
    if served is not None:
        a = a.model_copy(update={"reward_pretrain": None, "reward_url": served_url})
    roles, engines = _allocate(a, shape)
    _check_training(a, version, roles, engines)
    cmd = _Argv(version)
    for role, gpus in roles.items():
        nodes, per_node = _whole_nodes(role, gpus, shape.gpus_per_node)
        cmd.set(f"--{role}.num_nodes", nodes)
        cmd.set(f"--{role}.num_gpus_per_node", per_node)
    cmd.set("--vllm.num_engines", engines)
    cmd.set("--vllm.tensor_parallel_size", a.vllm_tensor_parallel_size)
    cmd.set("--train.colocate_all", a.colocate == "all")
    cmd.set("--train.colocate_actor_ref", a.colocate == "pairs" and "ref" in roles)
    cmd.set("--train.colocate_critic_reward", a.colocate == "pairs" and {"critic", "reward"} <= set(roles))
    cmd.set("--vllm.gpu_memory_utilization", a.vllm_gpu_memory_utilization)
    cmd.set("--vllm.sync_backend", a.vllm_sync_backend)
    cmd.set("--vllm.enforce_eager", a.enforce_eager)
    cmd.set("--vllm.enable_prefix_caching", a.enable_prefix_caching)
    cmd.set("--vllm.enable_sleep", a.sleep)
    cmd.set("--ds.enable_sleep", a.sleep)
    cmd.set("--actor.model_name_or_path", a.pretrain)
    cmd.set("--reward.model_name_or_path", a.reward_pretrain)
    cmd.set("--reward.remote_url", a.reward_url)
    cmd.set("--critic.model_name_or_path", a.critic_pretrain if "critic" in roles else None)
    cmd.set("--data.prompt_dataset", a.prompt_data)
    cmd.set("--data.input_key", a.input_key)
    cmd.set("--data.label_key", a.label_key)
    cmd.set("--data.apply_chat_template", a.apply_chat_template)
    cmd.set("--data.max_samples", a.max_samples)
    if cmd.dotted or version >= (0, 9, 8):  # --prompt_max_len/--generate_max_len were replaced in 0.9.8
        cmd.set("--data.max_len", a.prompt_max_len + a.generate_max_len)
        cmd.set("--rollout.max_new_tokens", a.generate_max_len)
    else:
        cmd.argv += ["--prompt_max_len", str(a.prompt_max_len), "--generate_max_len", str(a.generate_max_len)]
    cmd.set("--rollout.batch_size", a.rollout_batch_size)
    cmd.set("--rollout.micro_batch_size", a.micro_rollout_batch_size)
    cmd.set("--rollout.n_samples_per_prompt", a.n_samples_per_prompt)
    cmd.set("--rollout.temperature", a.temperature)
    cmd.set("--train.batch_size", a.train_batch_size)
    cmd.set("--train.micro_batch_size", a.micro_train_batch_size)
    cmd.set("--train.max_epochs", a.max_epochs)
    cmd.set("--train.num_episodes", a.num_episodes)
    cmd.set("--algo.advantage.estimator", a.estimator)
    cmd.set("--algo.kl.init_coef", a.init_kl_coef)
    cmd.set("--algo.kl.use_loss", a.use_kl_loss)
    cmd.set("--algo.kl.estimator", a.kl_estimator)
    cmd.set("--actor.adam.lr", a.actor_learning_rate)
    cmd.set("--critic.adam.lr", a.critic_learning_rate if "critic" in roles else None)
    cmd.set("--ds.zero_stage", a.zero_stage)
    cmd.set("--ds.adam_offload", a.adam_offload)
    cmd.set("--actor.gradient_checkpointing_enable", a.gradient_checkpointing)
    cmd.set("--ds.packing_samples", a.packing_samples)
    cmd.set("--reward.normalize_enable", a.normalize_reward)
    # bf16 and FlashAttention are the defaults since 0.9.2 and 0.8.10; before, they were opt-in.
    if version < (0, 9, 2):
        cmd.argv.append("--bf16")
    if version < (0, 8, 10):
        cmd.argv.append("--flash_attn")
    ckpt = shape.checkpoint_dir
    cmd.set("--ckpt.output_dir", f"{ckpt}/final")
    cmd.set("--ckpt.path", f"{ckpt}/ckpt")
    cmd.set("--ckpt.save_steps", a.save_steps)
    cmd.set("--ckpt.save_hf", a.save_hf)
    cmd.set("--critic.save_value_network", a.save_value_network)
    cmd.set("--ds.use_universal_ckpt", a.use_ds_universal_ckpt)
    cmd.set("--ckpt.load_enable", shape.resume)  # loads only when a checkpoint exists

    owned = {cmd.name(flag) for flag in OWNED} | {arg for arg in cmd.argv if arg.startswith("--")}
    clash = sorted({arg.split("=")[0] for arg in a.extra_args} & owned)
    if clash:
        raise infeasible(f"extra_args set {clash}, which the recipe sets from the task",
                         "use the recipe's arguments (or the task's checkpoints) instead", args=("extra_args",))

    # The key stays in the environment (a secret on every node): OpenRLHF calls wandb.login(key=...)
    # only when wandb has no key yet, so any value turns logging on without writing the key down.
    wandb = _Argv(version)
    wandb.set("--logger.wandb.key", "WANDB_API_KEY")
    told = shape.wandb
    wandb.set("--logger.wandb.project", (told.project if told else None) or a.wandb_project)
    wandb.set("--logger.wandb.org", told.entity if told else None)  # wandb.init(entity=..., group=...): 0.6.1 to 0.11.2
    wandb.set("--logger.wandb.group", told.group if told else None)
    return RecipeOutput(
        entrypoint=["python3", "-m", "openrlhf.cli.train_ppo_ray", *cmd.argv, *a.extra_args],
        wandb_args=wandb.argv,
        summary={"roles": roles, "vllm_engines": engines, "flags": "dotted" if cmd.dotted else "flat",
                 "checkpoints": f"{ckpt}/ckpt",
                 **({"placement": _placement_lines(a, shape)} if shape.groups else {})},
        services=[served] if served else [],
        served_groups=[served.where.removeprefix("group ")] if served else [],
        checkpoint_files=["ckpt/_actor/global_step*"],  # strategy.save_ckpt(<ckpt_path>/_actor, tag=global_stepN)
        models=hub_models(a.pretrain, a.reward_pretrain, served_model, a.critic_pretrain if "critic" in roles else None),
        hub_reads=hub_models(a.prompt_data),  # blending_datasets loads a hub dataset by name at run time
    )


def _placement_lines(a: OpenRLHFArgs, shape: Shape) -> list[str]:
    """What check says of where each role runs with node groups."""
    lines = [CONFINE_NOTE + f" (they count {shape.nodes} node(s) x {shape.gpus_per_node} GPUs)"]
    if a.reward_where != "ray":
        lines.append(f"reward model: served on {a.reward_where} (openrlhf.cli.serve_rm, --reward.remote_url); "
                     + served_line(a.reward_where.removeprefix("group "), "reward model", "Ray role or vLLM engine"))
    return lines


def ask_openrlhf(argv: list[str], version: str, extra_args: list[str]) -> list[str]:
    """OpenRLHF's own argument parser and start-up assertions (train_ppo_ray.py's __main__ block, read
    from the installed release: recipes.installed), run on the whole command, where the release the task
    pins (job.args.version) is installed here."""
    from ..errors import BadInput
    from ..models import did_you_mean
    from . import installed

    what = "OpenRLHF's argument parser (openrlhf/cli/train_ppo_ray.py)"
    where, found = installed.package("openrlhf")
    if where is None:
        return [f"{what}: not checked: openrlhf is not installed here (`pip install --no-deps openrlhf=={version}` "
                f"puts its code here without vllm)"]
    if found != version:
        return [f"{what}: not checked: openrlhf {found} is installed here, the task pins {version} (job.args.version)"]
    try:
        installed.openrlhf_parse(installed.openrlhf_main(installed.installed_reader(where), found), argv)
    except installed.Refused as exc:
        words = str(exc)
        unknown = words.partition("unrecognized arguments:")[2].split()
        mine = [i for i, arg in enumerate(extra_args) if arg in unknown or arg.split("=")[0] in unknown]
        field = f"job.args.extra_args[{mine[0]}]" if mine else "job.args"
        flag = next((arg for arg in unknown if arg.startswith("--")), None)
        hint = did_you_mean(flag, [o for o in exc.options if o.startswith("--")], "") if flag and exc.options else ""
        hint = f" {hint}" if hint.startswith("(did") else ""
        raise BadInput(f"{field}: OpenRLHF {found}'s train_ppo_ray refuses the command: {words}{hint}") from None
    return [f"{what} of openrlhf {found}, installed here: the command parses and passes its start-up checks"]


class OpenRLHFPPOJob(JobBase):
    """OpenRLHF's Ray PPO trainer with every shape flag taken from the task."""

    recipe_summary = "OpenRLHF Ray PPO / GRPO / REINFORCE++ (train_ppo_ray), flat or dotted flags by version"
    recipe_needs = "openrlhf[vllm] of `version` on every node (setup or image); GPUs; a shared checkpoints.path"

    recipe: Literal["openrlhf-ppo"]
    args: OpenRLHFArgs

    def metrics_reader(self):
        version = parse_version(self.args.version)
        # what its Episode bar counts, which gives the total its Global step lines lack (metrics.OpenRLHFReader);
        # releases between those read: the bar's own advance tells
        counts = "prompts" if version >= (0, 9, 10) else "batches" if (0, 8, 11) <= version <= (0, 9, 0) else None
        return OpenRLHFReader(rollout_batch_size=self.args.rollout_batch_size, bar_counts=counts)

    def ask_framework(self, argv: list[str]) -> list[str]:
        return self._placement + ask_openrlhf(argv[3:], self.args.version, self.args.extra_args)

    def build(self, shape: Shape) -> RecipeOutput:
        out = openrlhf_command(self.args, shape)
        # check prints these with what it asked of OpenRLHF (ask_framework follows build on the same job)
        self._placement = (out.summary or {}).get("placement", [])
        return out
