"""openrlhf-m-grpo: OpenRLHF-M's multimodal GRPO (Qwen2.5-VL on MathV60K) with its math
verifier as the remote reward, run as a head service that is ready only when it answers a
real reward request.

OpenRLHF-M is a fork of OpenRLHF 0.6.1: its trainer takes the flat flags and runs the
0.6.1 assertions, so the command comes from the openrlhf-ppo recipe at that version. The
published RunPod multi-node script passes `--worker_rm_url`, a flag the trainer rejects,
instead of `--remote_rm_url`; here the trainer reaches the verifier through the head's
private address, which every node can reach."""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import Field, field_validator

from ..models import require_absolute
from .base import Infeasible, JobBase, RecipeOutput, Service, Shape, StrictModel
from .metrics import OpenRLHFReader
from .openrlhf import OpenRLHFArgs, openrlhf_command

#: openrlhf/models/remote_rm/math_verifier.py: Flask on 0.0.0.0:5000 (fixed), POST /get_reward only.
REWARD_PORT = 5000
OPENRLHF_M_VERSION = "0.6.1"  # version.txt of OpenRLHF-M


class OpenRLHFMGrpoArgs(StrictModel):
    pretrain: str = Field("Qwen/Qwen2.5-VL-3B-Instruct", description="the vision-language model to train")
    repo_dir: str = Field("/workspace/OpenRLHF-M", description="OpenRLHF-M checkout; rank 0 prepares the data "
                          "with its examples/scripts/downloaders/download_mathv60k.py")
    data_dir: str | None = Field(None, description="where MathV60K is downloaded (absolute, shared by all nodes); "
                                 "default: <checkpoints>/data/VerMulti")
    input_key: str = Field("message", description="dataset field holding the prompt messages")
    prompt_template: Literal["chatml", "qwen1", "base"] = Field("chatml", description="chat format the verifier "
                                                                "parses responses with")
    actor_gpus: int | None = Field(None, ge=1, description="GPUs shared by actor, reference and vLLM; "
                                   "default: every GPU of the cluster")
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    vllm_sync_backend: Literal["nccl", "gloo"] = Field("nccl", description="gloo where NCCL cannot connect the "
                                                       "nodes (the RunPod guide uses it)")
    n_samples_per_prompt: int = Field(4, ge=2, description="samples per prompt in a GRPO group")
    rollout_batch_size: int = Field(128, ge=1)
    micro_rollout_batch_size: int = Field(1, ge=1)
    train_batch_size: int = Field(128, ge=1)
    micro_train_batch_size: int = Field(1, ge=1)
    num_episodes: int = Field(2, ge=1)
    max_samples: int | None = Field(None, ge=1, description="use at most this many prompts")
    prompt_max_len: int = Field(4096, ge=1)
    generate_max_len: int = Field(8000, ge=1)
    actor_learning_rate: float = Field(5e-7, gt=0)
    init_kl_coef: float = Field(1e-3, ge=0, description="KL loss coefficient")
    save_steps: int = Field(5, description="checkpoint every this many steps")
    extra_args: list[str] = Field([], description="more flat OpenRLHF 0.6.1 flags (as OpenRLHF-M takes them)")

    _absolute = field_validator("data_dir")(classmethod(lambda cls, v: require_absolute(v, "every node reads it")))


class OpenRLHFMGrpoJob(JobBase):
    """OpenRLHF-M GRPO with its math verifier reward server on the head."""

    recipe_summary = "OpenRLHF-M multimodal GRPO (MathV60K) with the math-verifier reward server on the head"
    recipe_needs = ("OpenRLHF-M installed and checked out at repo_dir on every node, with flask, Levenshtein, "
                    "math_verify and latex2sympy2_extended for the verifier; GPUs; a shared checkpoints.path")

    recipe: Literal["openrlhf-m-grpo"]
    args: OpenRLHFMGrpoArgs = OpenRLHFMGrpoArgs()

    def metrics_reader(self):
        return OpenRLHFReader()

    def ask_framework(self, argv: list[str]) -> list[str]:
        return ["OpenRLHF-M's argument parser: not checked: OpenRLHF-M is not on PyPI (the nodes install it from "
                "its repository); its DeepSpeed batch arithmetic is checked"]

    def build(self, shape: Shape) -> RecipeOutput:
        a = self.args
        data_dir = a.data_dir or f"{shape.checkpoint_dir}/data/VerMulti"
        dataset = f"{data_dir}/mathv60k_message.jsonl"
        trainer = OpenRLHFArgs(
            version=OPENRLHF_M_VERSION, pretrain=a.pretrain, prompt_data=dataset, input_key=a.input_key,
            reward_url=f"http://{{head_addr}}:{REWARD_PORT}/get_reward", estimator="group_norm", colocate="all",
            actor_gpus=a.actor_gpus, vllm_tensor_parallel_size=a.vllm_tensor_parallel_size,
            vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization, vllm_sync_backend=a.vllm_sync_backend,
            enable_prefix_caching=True, sleep=True, n_samples_per_prompt=a.n_samples_per_prompt,
            rollout_batch_size=a.rollout_batch_size, micro_rollout_batch_size=a.micro_rollout_batch_size,
            train_batch_size=a.train_batch_size, micro_train_batch_size=a.micro_train_batch_size,
            num_episodes=a.num_episodes, max_samples=a.max_samples, prompt_max_len=a.prompt_max_len,
            generate_max_len=a.generate_max_len, temperature=1.0, actor_learning_rate=a.actor_learning_rate,
            init_kl_coef=a.init_kl_coef, use_kl_loss=True, kl_estimator="k3", zero_stage=3,
            normalize_reward=True, save_steps=a.save_steps, save_hf=True, extra_args=a.extra_args,
        )
        try:
            out = openrlhf_command(trainer, shape)
        except Infeasible as exc:  # name only the arguments this recipe has (it fixes colocate, vllm_engines...)
            raise exc.only_args(OpenRLHFMGrpoArgs.model_fields) from None
        data, repo = shlex.quote(data_dir), shlex.quote(a.repo_dir)
        out.prepare = [f"test -f {data}/mathv60k_message.jsonl || python3 {repo}/examples/scripts/downloaders/"
                       f"download_mathv60k.py --root_dir {data}"]
        # A real reward request: the verifier answers GET with 405 and an unknown problem
        # falls back to the most similar one, so this is ready once the dataset is loaded.
        probe = {"query": ["<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
                           "<think>1+1=2</think><answer>$2$</answer><|im_end|>"],
                 "prompts": ["What is 1+1?"]}
        # OpenRLHF-M's RunPod guides (github.com/the-laughing-monkey/OpenRLHF-M): "Set the file descriptor limit
        # to 65536 to avoid "Too many open files" error", before Ray starts (docs/RunPodding_InstaCluster_setup.md
        # step 7 and its troubleshooting; examples/scripts/setup/setup.sh).
        out.open_files = 65536
        out.services = [Service.model_validate({
            "name": "math-verifier",
            "where": "head",
            "command": (f"python3 -m openrlhf.models.remote_rm.math_verifier --dataset {shlex.quote(dataset)} "
                        f"--input_key {shlex.quote(a.input_key)} --prompt-template {a.prompt_template}"),
            "ready": {"http": f"http://{{node_addr}}:{REWARD_PORT}/get_reward", "method": "POST", "json": probe},
            "timeout": "15m",
        })]
        return out
