"""The real frameworks, read without GPUs and without importing them.

verl: its Hydra config (`verl/trainer/config`) extracted from the verl wheel and composed
with our overrides in struct mode. OpenRLHF: the `__main__` block of
`openrlhf/cli/train_ppo_ray.py` from a release's wheel, executed on our arguments with
`train()` cut down to its assertions on `args` (importing openrlhf needs vllm and GPUs).
Search-R1 is not on PyPI: its config is the copy below.

Wheels come from PyPI with `pip download --no-deps` (CPython 3.11 / manylinux wheels
whatever Python runs the tests) into a cache kept between runs:
$RLHF_TASKS_TEST_CACHE, default ~/.cache/rlhf-tasks-tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from rlhf_tasks.recipes import installed

CACHE = Path(os.environ.get("RLHF_TASKS_TEST_CACHE", Path.home() / ".cache" / "rlhf-tasks-tests"))


#: The framework refused the arguments (argparse error or failed assertion).
Rejected = installed.Refused


def wheel(name: str, version: str) -> tuple[Path | None, str]:
    """The cached wheel of name==version, downloaded once; (None, why) when pip fails."""
    folder = CACHE / "wheels"
    found = sorted(folder.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0], ""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux1_x86_64",
           "-d", str(folder), f"{name}=={version}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    found = sorted(folder.glob(f"{name}-{version}-*.whl"))
    if out.returncode != 0 or not found:
        last = (out.stderr or out.stdout or "no output").strip().splitlines()[-1]
        return None, f"pip download {name}=={version} failed: {last}"
    return found[0], ""


def _member(archive: zipfile.ZipFile, suffix: str) -> str:
    """A file of the wheel by its path inside the package (wheels may nest it under .data/purelib)."""
    names = [n for n in archive.namelist() if n == suffix or n.endswith("/" + suffix)]
    if not names:
        raise FileNotFoundError(f"{suffix} is not in {archive.filename}")
    return archive.read(names[0]).decode()


# --- verl and Search-R1: Hydra ------------------------------------------------------------


def verl_config_dir(version: str) -> tuple[Path | None, str]:
    """verl's trainer/config directory, extracted from the wheel (verl itself is never imported)."""
    target = CACHE / f"verl-{version}-config"
    if (target / "ppo_trainer.yaml").exists():
        return target, ""
    path, why = wheel("verl", version)
    if path is None:
        return None, why
    prefix = "verl/trainer/config/"
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                dest = target / name[len(prefix):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(archive.read(name))
    return target, ""


def compose(config_dir: Path, config_name: str, overrides: list[str]):
    """Compose like the trainer's @hydra.main does: struct mode, an unknown key raises."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose(config_name=config_name, overrides=overrides)


#: Search-R1's verl/trainer/config/ppo_trainer.yaml at commit a14dc3a (2025-10-29) of
#: github.com/PeterGriffinJin/Search-R1, comments dropped. Search-R1 is not on PyPI.
SEARCH_R1_PPO_TRAINER = """\
data:
  tokenizer: null
  train_files: ~/data/rlhf/gsm8k/train.parquet
  val_files: ~/data/rlhf/gsm8k/test.parquet
  train_data_num: null
  val_data_num: null
  prompt_key: prompt
  max_prompt_length: 512
  max_response_length: 512
  max_start_length: 256
  max_obs_length: 512
  train_batch_size: 1024
  val_batch_size: 1312
  return_raw_input_ids: False
  return_raw_chat: False
  shuffle_train_dataloader: True
actor_rollout_ref:
  hybrid_engine: True
  model:
    path: ~/models/deepseek-llm-7b-chat
    external_lib: null
    override_config: { }
    enable_gradient_checkpointing: False
    use_remove_padding: False
  actor:
    strategy: fsdp
    ppo_mini_batch_size: 256
    ppo_micro_batch_size: 64
    use_dynamic_bsz: False
    ppo_max_token_len_per_gpu: 16384
    grad_clip: 1.0
    state_masking: False
    clip_ratio: 0.2
    entropy_coeff: 0.001
    use_kl_loss: False
    kl_loss_coef: 0.001
    kl_loss_type: low_var_kl
    ppo_epochs: 1
    shuffle: False
    ulysses_sequence_parallel_size: 1
    optim:
      lr: 1e-6
      lr_warmup_steps_ratio: 0.
      min_lr_ratio: null
      warmup_style: constant
      total_training_steps: -1
    fsdp_config:
      wrap_policy:
        min_num_params: 0
      param_offload: False
      grad_offload: False
      optimizer_offload: False
      fsdp_size: -1
  ref:
    fsdp_config:
      param_offload: False
      wrap_policy:
        min_num_params: 0
      fsdp_size: -1
    log_prob_micro_batch_size: 128
    log_prob_use_dynamic_bsz: ${actor_rollout_ref.actor.use_dynamic_bsz}
    log_prob_max_token_len_per_gpu: ${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}
    ulysses_sequence_parallel_size: ${actor_rollout_ref.actor.ulysses_sequence_parallel_size}
  rollout:
    name: vllm
    temperature: 1.0
    top_k: -1
    top_p: 0.95
    prompt_length: ${data.max_prompt_length}
    response_length: ${data.max_response_length}
    dtype: bfloat16
    gpu_memory_utilization: 0.5
    ignore_eos: False
    enforce_eager: True
    free_cache_engine: True
    load_format: dummy_dtensor
    tensor_model_parallel_size: 2
    max_num_batched_tokens: 8192
    max_num_seqs: 1024
    log_prob_micro_batch_size: 128
    log_prob_use_dynamic_bsz: ${actor_rollout_ref.actor.use_dynamic_bsz}
    log_prob_max_token_len_per_gpu: ${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}
    do_sample: True
    n: 1
    n_agent: 1
critic:
  strategy: fsdp
  optim:
    lr: 1e-5
    lr_warmup_steps_ratio: 0.
    min_lr_ratio: null
    warmup_style: constant
    total_training_steps: -1
  model:
    path: ~/models/deepseek-llm-7b-chat
    tokenizer_path: ${actor_rollout_ref.model.path}
    override_config: { }
    external_lib: ${actor_rollout_ref.model.external_lib}
    enable_gradient_checkpointing: False
    use_remove_padding: False
    fsdp_config:
      param_offload: False
      grad_offload: False
      optimizer_offload: False
      wrap_policy:
        min_num_params: 0
      fsdp_size: -1
  ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}
  ppo_micro_batch_size: 64
  forward_micro_batch_size: ${critic.ppo_micro_batch_size}
  use_dynamic_bsz: ${actor_rollout_ref.actor.use_dynamic_bsz}
  ppo_max_token_len_per_gpu: 32768
  forward_max_token_len_per_gpu: ${critic.ppo_max_token_len_per_gpu}
  ulysses_sequence_parallel_size: 1
  ppo_epochs: ${actor_rollout_ref.actor.ppo_epochs}
  shuffle: ${actor_rollout_ref.actor.shuffle}
  grad_clip: 1.0
  cliprange_value: 0.5
reward_model:
  enable: False
  strategy: fsdp
  model:
    input_tokenizer: ${actor_rollout_ref.model.path}
    path: ~/models/FsfairX-LLaMA3-RM-v0.1
    external_lib: ${actor_rollout_ref.model.external_lib}
    use_remove_padding: False
    fsdp_config:
      min_num_params: 0
      param_offload: False
  micro_batch_size: 64
  max_length: null
  ulysses_sequence_parallel_size: 1
  use_dynamic_bsz: ${critic.use_dynamic_bsz}
  forward_max_token_len_per_gpu: ${critic.forward_max_token_len_per_gpu}
  structure_format_score: 0
  final_format_score: 0
  retrieval_score: 0
retriever:
  url: "http://127.0.0.1:8000/retrieve"
  topk: 3
algorithm:
  gamma: 1.0
  lam: 1.0
  adv_estimator: gae
  no_think_rl: False
  kl_penalty: kl
  kl_ctrl:
    type: fixed
    kl_coef: 0.001
  state_masking:
    start_state_marker: "<information>"
    end_state_marker: "</information>"
trainer:
  total_epochs: 30
  total_training_steps: null
  project_name: verl_examples
  experiment_name: gsm8k
  logger: [ 'console', 'wandb' ]
  nnodes: 1
  n_gpus_per_node: 8
  save_freq: -1
  test_freq: -1
  critic_warmup: 0
  default_hdfs_dir: ~/experiments/gsm8k/ppo/${trainer.experiment_name}
  default_local_dir: checkpoints/${trainer.project_name}/${trainer.experiment_name}
max_turns: 10
do_search: true
"""


def search_r1_config_dir(tmp: Path) -> Path:
    (tmp / "ppo_trainer.yaml").write_text(SEARCH_R1_PPO_TRAINER)
    return tmp


# --- OpenRLHF: argparse (the harness `check` runs on an installed release: rlhf_tasks/recipes/installed.py) ---


def openrlhf_main(version: str) -> tuple[tuple | None, str]:
    """train_ppo_ray's __main__ block of this release's wheel, compiled with train() cut down to its
    assertions; (None, why) when the wheel cannot be had."""
    path, why = wheel("openrlhf", version)
    if path is None:
        return None, why
    with zipfile.ZipFile(path) as archive:
        return installed.openrlhf_main(lambda member: _member(archive, member), version), ""


def openrlhf_parse(main, argv: list[str]):
    """Parse argv as train_ppo_ray would and run its GPU-free checks; Rejected on refusal."""
    return installed.openrlhf_parse(main, argv)


# --- metric lines: the frameworks' own logging code ------------------------------------------


def wheel_source(name: str, version: str, member: str) -> tuple[str | None, str]:
    """The text of one file of a framework's wheel (`verl/utils/logger/aggregate_logger.py`)."""
    path, why = wheel(name, version)
    if path is None:
        return None, why
    with zipfile.ZipFile(path) as archive:
        return _member(archive, member), ""


def wheel_module(name: str, version: str, member: str):
    """One module file of a framework's wheel, loaded on its own (not its package, whose
    `__init__` needs GPUs): (module, "") or (None, why)."""
    import importlib.util

    text, why = wheel_source(name, version, member)
    if text is None:
        return None, why
    target = CACHE / f"{name}-{version}-modules" / member
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    spec = importlib.util.spec_from_file_location(f"_{name}_{version.replace('.', '_')}_{target.stem}", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, ""
