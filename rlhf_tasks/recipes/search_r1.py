"""search-r1: Search-R1's PPO/GRPO (its own fork of verl, `python3 -m verl.trainer.main_ppo`)
with the retriever it searches through running on every node, or on a node group of its own
(`retriever_where: group NAME`, a CPU group for a CPU index).

The multi-node guide launches the same retriever on every node and points the trainer at
127.0.0.1:8000, so every rollout worker queries its own node; on a group, the trainer asks that
group's node at {group_addr:NAME}. Here each retriever is ready
only when it answers a real query; rank 0 downloads the index, corpus and NQ data once
into the shared checkpoint directory before any retriever starts. Search-R1's fork
predates verl's resume_mode and checks batches differently from verl 0.9, hence its own
checks (cited from the fork's files)."""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import Field, field_validator

from ..models import require_absolute
from .base import (WHERE_PATTERN, GroupShape, JobBase, RecipeOutput, Service, Shape, StrictModel, hub_models, infeasible,
                   role_group, served_line, without_group)
from .metrics import VerlReader
from .verl import EXCLUDES, check_divides, check_tensor_parallel, override_keys

#: search_r1/search/retrieval_server.py: uvicorn on 0.0.0.0:8000 (fixed), POST /retrieve.
RETRIEVER_AT = "http://{host}:8000/retrieve"
RETRIEVER_URL = RETRIEVER_AT.format(host="127.0.0.1")
#: The retriever's encoder (the guide's retrieval_launch.sh): every node's retriever loads it from the hub.
RETRIEVER_ENCODER = "intfloat/e5-base-v2"

#: Search-R1's verl/trainer/config/ppo_trainer.yaml keys the recipe fills from the task.
OWNED = {"trainer.nnodes", "trainer.n_gpus_per_node", "trainer.default_local_dir", "trainer.logger",
         "data.train_files", "data.val_files", "retriever.url"}

#: What check says of the fork's placement with node groups (github.com/PeterGriffinJin/Search-R1 at a14dc3a).
CONFINE_NOTE = ("Search-R1's verl fork places its trainer workers on any GPU node: verl/trainer/main_ppo.py's "
                "resource_pool_spec is {global_pool: [n_gpus_per_node] * nnodes} and verl/single_controller/ray/"
                "base.py RayResourcePool.get_placement_groups makes one STRICT_PACK placement group of {CPU, GPU: 1} "
                "bundles per node, with no node constraint")


class SearchR1Args(StrictModel):
    model: str = Field("Qwen/Qwen2.5-7B", description="base model to train (actor and critic)")
    estimator: Literal["gae", "grpo"] = Field("gae", description="gae is PPO with a critic; grpo needs n_agent > 1")
    n_agent: int = Field(1, ge=1, description="rollouts per prompt (actor_rollout_ref.rollout.n_agent; 5 for grpo)")
    repo_dir: str = Field("/workspace/Search-R1", description="Search-R1 checkout on every node, installed with "
                          "`pip install -e .` (its verl fork provides the trainer)")
    retriever_python: str = Field("python3", description="Python that runs the retriever (the guide uses a separate "
                                  "environment with faiss-gpu, e.g. /opt/conda/envs/retriever/bin/python)")
    index_dir: str | None = Field(None, description="e5 index and wiki-18 corpus, downloaded on rank 0 (absolute, "
                                  "shared by all nodes); default: <checkpoints>/search-r1/index")
    data_dir: str | None = Field(None, description="NQ search data, prepared on rank 0 (absolute); default: "
                                 "<checkpoints>/data/nq_search")
    faiss_gpu: bool = Field(True, description="retriever index on the GPUs (faster; its memory is outside Ray's "
                            "accounting, so keep gpu_memory_utilization moderate); false on a CPU group")
    retriever_where: str = Field("every_node", pattern=rf"^(every_node|{WHERE_PATTERN})$", description=(
        "where the retriever runs: every_node (each node's trainer workers ask their own at 127.0.0.1:8000), or "
        "`group NAME` (every node of that node group, not the first; the trainer asks its node at "
        "{group_addr:NAME}); the trainer then counts the other GPU groups"))
    topk: int = Field(3, ge=1, description="passages per search")
    max_turns: int = Field(4, ge=1, description="search turns per rollout")
    train_batch_size: int = Field(512, ge=1)
    val_batch_size: int = Field(256, ge=1)
    max_prompt_length: int = Field(4096, ge=1)
    max_response_length: int = Field(500, ge=1)
    max_start_length: int = Field(2048, ge=1)
    max_obs_length: int = Field(500, ge=1)
    ppo_mini_batch_size: int = Field(256, ge=1, description="global; the fork divides it by the GPU count")
    ppo_micro_batch_size: int = Field(64, ge=1, description="global; the fork divides it by the GPU count")
    log_prob_micro_batch_size: int = Field(128, ge=1, description="global; the fork divides it by the GPU count")
    critic_micro_batch_size: int = Field(16, ge=1, description="global; the fork divides it by the GPU count")
    rollout_tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM engine; must divide GPUs per node")
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    actor_lr: float = Field(1e-6, gt=0)
    actor_warmup_ratio: float = Field(0.285, ge=0, le=1)
    critic_lr: float = Field(1e-5, gt=0)
    critic_warmup_ratio: float = Field(0.015, ge=0, le=1)
    kl_coef: float = Field(0.001, ge=0)
    total_epochs: int = Field(15, ge=1)
    total_training_steps: int | None = Field(1005, ge=1)
    save_freq: int = Field(100)
    test_freq: int = Field(100)
    project_name: str = Field("Search-R1")
    experiment_name: str = Field("nq-search-r1-ppo-qwen2.5-7b-em")
    extra_overrides: list[str] = Field([], description="more Hydra overrides for Search-R1's ppo_trainer config")

    _absolute = field_validator("repo_dir", "index_dir", "data_dir")(classmethod(lambda cls, v: require_absolute(v)))


class SearchR1Job(JobBase):
    """Search-R1 PPO/GRPO with a retriever on every node or on a node group."""

    recipe_summary = "Search-R1 PPO / GRPO (its verl fork) with a retrieval server on every node"
    recipe_needs = ("Search-R1 checked out at repo_dir and installed on every node; a retriever environment "
                    "(faiss, fastapi, uvicorn); GPUs; a shared checkpoints.path; checkpoints.resume: never")

    recipe: Literal["search-r1"]
    args: SearchR1Args = SearchR1Args()

    def metrics_reader(self):
        return VerlReader(total=self.args.total_training_steps)

    def ask_framework(self, argv: list[str]) -> list[str]:
        return self._placement + ["Search-R1's Hydra config: not checked: Search-R1 is not on PyPI (the nodes install its verl fork "
                "from its repository)"]

    def build(self, shape: Shape) -> RecipeOutput:
        a = self.args
        ckpt = shape.checkpoint_dir
        if ckpt is None:
            raise infeasible("Search-R1 needs a checkpoint directory", "set checkpoints.path",
                             fields=("checkpoints.path",))
        if shape.resume:
            raise infeasible("Search-R1's trainer cannot resume: its verl fork has no resume_mode and starts from "
                             "step 0 on every run", "set checkpoints.resume: never", fields=("checkpoints.resume",))
        if shape.gpus_per_node == 0:
            raise infeasible("Search-R1 trains on GPUs but the task has none", "set resources.gpus, e.g. H100:8",
                             fields=("resources.gpus",))
        group, shape = _retriever_group(a, shape)
        # check prints these with what it asked (ask_framework follows build on the same job)
        self._placement = _placement_lines(group, shape) if shape.groups else []
        url = RETRIEVER_AT.format(host=f"{{group_addr:{group.name}}}") if group else RETRIEVER_URL
        gpus = shape.nodes * shape.gpus_per_node
        if a.estimator == "grpo" and a.n_agent < 2:
            raise infeasible(f"grpo compares rollouts of the same prompt but n_agent is {a.n_agent}",
                             "set n_agent to 2 or more (the guide uses 5)", args=("n_agent", "estimator"))
        # verl/trainer/ppo/ray_trainer.py (fork) _balance_batch splits the batch into equal
        # parts per GPU (get_seqlen_balanced_partitions with equal_size=True).
        check_divides(f"train_batch_size x n_agent = {a.train_batch_size} x {a.n_agent}",
                      a.train_batch_size * a.n_agent, gpus, f"use a train_batch_size that makes this a multiple "
                      f"of {gpus}", ("train_batch_size", "n_agent"))
        # verl/workers/fsdp_workers.py (fork): these global sizes are divided by the world size
        # (`//=`), so below the GPU count they become 0.
        sizes = {"ppo_mini_batch_size": a.ppo_mini_batch_size, "ppo_micro_batch_size": a.ppo_micro_batch_size,
                 "log_prob_micro_batch_size": a.log_prob_micro_batch_size}
        if a.estimator == "gae":
            sizes["critic_micro_batch_size"] = a.critic_micro_batch_size
        for name, size in sizes.items():
            if size < gpus:
                raise infeasible(f"{name} {size} is split over {gpus} GPUs: {size} // {gpus} = 0 per GPU",
                                 f"set {name} to at least {gpus}", args=(name,))
        check_tensor_parallel(a.rollout_tensor_parallel_size, shape.gpus_per_node)
        clash = sorted(override_keys(a.extra_overrides) & OWNED)
        if clash:
            raise infeasible(f"extra_overrides set {clash}, which the recipe sets from the task",
                             "use the task's nodes, resources, checkpoints and secrets instead",
                             args=("extra_overrides",))

        index_dir = a.index_dir or f"{ckpt}/search-r1/index"
        data_dir = a.data_dir or f"{ckpt}/data/nq_search"
        index, data, repo = shlex.quote(index_dir), shlex.quote(data_dir), shlex.quote(a.repo_dir)
        prepare = [
            f"test -f {index}/e5_Flat.index || (cd {repo} && python3 scripts/download.py --save_path {index} && "
            f"cat {index}/part_* > {index}/e5_Flat.index.tmp && mv {index}/e5_Flat.index.tmp {index}/e5_Flat.index)",
            f"test -f {index}/wiki-18.jsonl || gzip -d {index}/wiki-18.jsonl.gz",
            f"test -f {data}/train.parquet || (cd {repo} && python3 scripts/data_process/nq_search.py "
            f"--local_dir {data})",
        ]
        retriever = Service.model_validate({
            "name": "retriever",
            "where": a.retriever_where,
            "command": (f"cd {repo} && {a.retriever_python} search_r1/search/retrieval_server.py "
                        f"--index_path {index}/e5_Flat.index --corpus_path {index}/wiki-18.jsonl --topk {a.topk} "
                        f"--retriever_name e5 --retriever_model {RETRIEVER_ENCODER}"
                        + (" --faiss_gpu" if a.faiss_gpu else "")),
            # on a group: ready when it answers on the address the trainer asks
            "ready": {"http": RETRIEVER_AT.format(host="{node_addr}") if group else RETRIEVER_URL, "method": "POST",
                      "json": {"queries": ["Who wrote Hamlet?"], "topk": a.topk, "return_scores": True}},
            "timeout": "30m",  # loading the ~60 GB flat index
        })
        overrides = [
            f"data.train_files={data_dir}/train.parquet",
            f"data.val_files={data_dir}/test.parquet",
            "data.train_data_num=null",
            "data.val_data_num=null",
            f"data.train_batch_size={a.train_batch_size}",
            f"data.val_batch_size={a.val_batch_size}",
            f"data.max_prompt_length={a.max_prompt_length}",
            f"data.max_response_length={a.max_response_length}",
            f"data.max_start_length={a.max_start_length}",
            f"data.max_obs_length={a.max_obs_length}",
            "data.shuffle_train_dataloader=True",
            f"algorithm.adv_estimator={a.estimator}",
            f"actor_rollout_ref.model.path={a.model}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.model.use_remove_padding=True",
            f"actor_rollout_ref.actor.optim.lr={a.actor_lr}",
            f"actor_rollout_ref.actor.optim.lr_warmup_steps_ratio={a.actor_warmup_ratio}",
            f"actor_rollout_ref.actor.use_kl_loss={a.estimator == 'grpo'}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size={a.ppo_micro_batch_size}",
            "actor_rollout_ref.actor.state_masking=true",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size={a.log_prob_micro_batch_size}",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={a.rollout_tensor_parallel_size}",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={a.gpu_memory_utilization}",
            f"actor_rollout_ref.rollout.n_agent={a.n_agent}",
            "actor_rollout_ref.rollout.temperature=1",
            "actor_rollout_ref.rollout.top_p=1.0",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size={a.log_prob_micro_batch_size}",
            f"algorithm.kl_ctrl.kl_coef={a.kl_coef}",
            "algorithm.no_think_rl=false",
        ]
        if a.estimator == "gae":
            overrides += [
                f"critic.model.path={a.model}",
                "critic.model.enable_gradient_checkpointing=true",
                "critic.model.use_remove_padding=True",
                f"critic.optim.lr={a.critic_lr}",
                f"critic.optim.lr_warmup_steps_ratio={a.critic_warmup_ratio}",
                f"critic.ppo_micro_batch_size={a.critic_micro_batch_size}",
            ]
        overrides += [
            "trainer.critic_warmup=0",
            "trainer.logger=[console]",
            "+trainer.val_only=false",
            "+trainer.val_before_train=false",
            "trainer.default_hdfs_dir=null",
            f"trainer.n_gpus_per_node={shape.gpus_per_node}",
            f"trainer.nnodes={shape.nodes}",
            f"trainer.save_freq={a.save_freq}",
            f"trainer.test_freq={a.test_freq}",
            f"trainer.project_name={a.project_name}",
            f"trainer.experiment_name={a.experiment_name}",
            f"trainer.total_epochs={a.total_epochs}",
            f"trainer.total_training_steps={'null' if a.total_training_steps is None else a.total_training_steps}",
            f"trainer.default_local_dir={ckpt}",
            f"max_turns={a.max_turns}",
            f"retriever.url={url}",
            f"retriever.topk={a.topk}",
            *a.extra_overrides,
        ]
        return RecipeOutput(
            entrypoint=["python3", "-m", "verl.trainer.main_ppo", *overrides],
            prepare=prepare,
            services=[retriever],
            node_inputs=[index_dir],  # every retriever (each node's, or its group's) reads what rank 0 downloaded
            # Search-R1's verl/trainer/runtime_env.yaml (vLLM with Qwen2 and flash-attn misbehaves).
            env={"VLLM_ATTENTION_BACKEND": "XFORMERS", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"},
            excludes=EXCLUDES + ["*.index"],
            wandb_args=["trainer.logger=[console,wandb]"] + (
                [f"trainer.project_name={shape.wandb.project}"] if shape.wandb and shape.wandb.project else []),
            summary={"checkpoints": ckpt, "retriever": url, "index": index_dir},
            checkpoint_files=["global_step_*"],  # verl's trainer: <default_local_dir>/global_step_N
            # `ulimit -n 65535` before the job: Search-R1's docs/multinode.md and example/multinode/*.sh
            # (github.com/PeterGriffinJin/Search-R1 at a14dc3a)
            open_files=65535,
            models=hub_models(a.model, RETRIEVER_ENCODER),  # the policy (actor, critic, reference); the retriever's
            # a GPU group's retriever (its encoder, a faiss_gpu index) holds the group's GPUs: not Ray's
            served_groups=[group.name] if group and group.gpus_per_node else [],
        )


def _retriever_group(a: SearchR1Args, shape: Shape) -> tuple[GroupShape | None, Shape]:
    """With retriever_where: group NAME, that group and the shape of the other GPU groups the trainer counts; else
    (None, shape). A faiss_gpu index on a group without GPUs is refused (the retriever's --faiss_gpu needs them)."""
    name = role_group(a.retriever_where, shape, "retriever_where", "retriever")
    group = next((g for g in shape.groups if g.name == name), None)
    places = [group] if group else shape.groups
    cpu = next((g for g in places if not g.gpus_per_node), None)
    if a.faiss_gpu and cpu is not None:
        runs = "the retriever runs there" if group else "the retriever runs on every node (retriever_where: every_node)"
        raise infeasible(f"group {cpu.name} has no GPUs, and {runs} with its index on the GPUs (faiss_gpu: true, "
                         f"retrieval_server.py --faiss_gpu)", "set faiss_gpu: false (the index in CPU memory)"
                         + ("" if group else f", or retriever_where: group {cpu.name}"),
                         args=("retriever_where", "faiss_gpu"))
    return group, without_group(shape, name, "retriever_where", "retriever") if group else shape


def _placement_lines(group: GroupShape | None, trainer: Shape) -> list[str]:
    """What check says of where the retriever and the trainer's workers run with node groups."""
    lines = [CONFINE_NOTE + f" (they count {trainer.nodes} node(s) x {trainer.gpus_per_node} GPUs)"]
    if group is None:
        lines.append("retriever: on every node, each node's workers asking their own at 127.0.0.1:8000")
        return lines
    ray = (served_line(group.name, "retriever", "trainer worker") if group.gpus_per_node else
           f"group {group.name}'s nodes join Ray without GPUs, so no trainer worker lands there")
    lines.append(f"retriever: on group {group.name} (every node of it), the trainer asking "
                 f"{RETRIEVER_AT.format(host=f'{{group_addr:{group.name}}}')}; {ray}")
    return lines
