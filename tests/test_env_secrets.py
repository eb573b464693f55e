"""A task's `env` is written into every rendered file, so it never holds a secret's value
(by its name's convention or its value's format, unless the task says it is not one), nor a
variable the launcher or the provider sets on the nodes itself. Refused as bad input (exit
2) before anything is rendered or launched."""

from __future__ import annotations

import json

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks.spec import json_schema, parse_task

TASK = {"name": "t", "nodes": 2, "job": {"recipe": "command", "args": {"entrypoint": "true"}}}


def task_with(**fields):
    return {**TASK, **fields}


@pytest.mark.parametrize("name, value", [
    ("WANDB_API_KEY", "val-123"), ("HF_TOKEN", "val-123"), ("RUNPOD_API_KEY", "val-123"),
    ("AWS_SECRET_ACCESS_KEY", "val-123"), ("DB_PASSWORD", "val-123"), ("MY_CLIENT_SECRET_FILE", "val-123"),
    ("GITHUB_TOKEN", "val-123"),
    ("MODEL_REPO_KEY", "hf_" + "a" * 34),                   # a Hugging Face token's format
    ("LLM_KEY", "sk-proj-" + "A1b2" * 10),                    # OpenAI's
    ("GH", "ghp_" + "A" * 36), ("AWS_ID", "AKIA" + "ABCDEFGHIJKLMNOP"), ("POD_KEY", "rpa_" + "X1" * 20),
    ("WB", "0123456789abcdef0123456789abcdef01234567"),      # W&B's 40 hex digits
])
def test_a_secret_under_env_is_refused_naming_it_and_saying_where_it_goes(name, value):
    with pytest.raises(BadInput) as err:
        parse_task(task_with(env={name: value, "NCCL_DEBUG": "INFO"}))
    said = str(err.value)
    assert f"env.{name}:" in said and f"secrets: [{name}]" in said and f"env_not_secret: [{name}]" in said
    assert value not in said  # the value itself is never repeated


PEM = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU=\n-----END OPENSSH PRIVATE KEY-----\n"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"


@pytest.mark.parametrize("name, value", [
    ("WANDB_KEY", "val-123"), ("OPENAI_KEY", "val-123"), ("DB_PASS", "val-123"), ("MY_PWD", "val-123"),
    ("S3_KEY", "val-123"), ("PASSPHRASE", "val-123"), ("SMTP_PASSWD_FILE", "val-123"),
    ("GCP_CREDENTIAL_JSON", "val-123"), ("PRIVATE_REGISTRY", "val-123"), ("ssh_private", "val-123"),
    ("DEPLOY", PEM), ("SIGNER", "-----BEGIN RSA PRIVATE KEY-----\nMIIEow==\n-----END RSA PRIVATE KEY-----"),
    ("DATABASE_URL", "postgres://user:pw@db.internal:5432/runs"), ("PROXY", "http://:tok3n@proxy.example:3128"),
    ("SESSION", JWT), ("SLACK_HOOK", "xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOpQrStUvWx"),
    ("SLACK_USER", "xoxp-" + "12345678" * 3), ("GL", "glpat-" + "Ab1_" * 5),
    ("STRIPE", "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc"), ("MAPS", "AIza" + "SyA-1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"),
])
def test_more_secret_names_and_value_formats_are_refused(name, value):
    with pytest.raises(BadInput) as err:
        parse_task(task_with(env={name: value}))
    said = str(err.value)
    assert f"env.{name}:" in said and f"secrets: [{name}]" in said
    assert value.strip() not in said and "pw@" not in said
    assert parse_task(task_with(env={name: value}, env_not_secret=[name])).env[name] == value  # the way out


@pytest.mark.parametrize("name, value", [
    ("TOKENIZERS_PARALLELISM", "false"), ("MAX_TOKENS", "512"), ("NCCL_IB_GID_INDEX", "3"),
    ("HF_HOME", "/data/hf"), ("KEYS_DIR", "/etc/keys"), ("SPEC", "/ckpt/task-abcdefghijklmnopqrstuvwx"),
    ("MIRROR", "https://user@pypi.example/simple"), ("REPO", "https://github.com/org/repo.git"),
    ("NOTE", "BEGIN PUBLIC KEY"), ("MODE", "eyJ"), ("HOST", "http://10.0.0.1:8000/retrieve"),
])
def test_ordinary_names_and_values_still_pass(name, value):
    assert parse_task(task_with(env={name: value})).env[name] == value


def test_ordinary_env_passes_and_a_name_that_only_looks_secret_can_stay():
    assert parse_task(task_with(env={"NCCL_DEBUG": "INFO", "TOKENIZERS_PARALLELISM": "false",
                                     "MAX_TOKENS": "512"})).env["MAX_TOKENS"] == "512"
    with pytest.raises(BadInput, match="env.MAX_NEW_TOKEN"):
        parse_task(task_with(env={"MAX_NEW_TOKEN": "64"}))
    task = parse_task(task_with(env={"MAX_NEW_TOKEN": "64"}, env_not_secret=["MAX_NEW_TOKEN"]))
    assert task.env == {"MAX_NEW_TOKEN": "64"}
    with pytest.raises(BadInput, match=r"env_not_secret\.OTHER: not under env"):
        parse_task(task_with(env={"A": "1"}, env_not_secret=["OTHER"]))
    with pytest.raises(BadInput, match=r"env_not_secret: unknown field|env_not_secrets"):
        parse_task(task_with(env_not_secrets=["A"]))  # forbidden extras stay forbidden


def test_the_override_is_in_the_schema():
    props = json_schema()["properties"]
    assert props["env_not_secret"]["type"] == "array" and "secret" in props["env_not_secret"]["description"]
    assert "secrets" in props["env"]["description"]


@pytest.mark.parametrize("name", ["RAY_AUTH_TOKEN", "RAY_AUTH_MODE"])
def test_names_the_launcher_owns_are_refused_even_when_said_not_secret(name):
    with pytest.raises(BadInput, match=f"env.{name}: the launcher sets it"):
        parse_task(task_with(env={name: "x"}, env_not_secret=[name]))
    with pytest.raises(BadInput, match=f"{name}: the launcher passes it"):
        parse_task(task_with(secrets=[name]))


@pytest.mark.parametrize("provider, name, extra", [
    ("local", "RLHF_TASKS_NODE_RANK", {}), ("dstack", "DSTACK_NODE_RANK", {}), ("dstack", "DSTACK_MASTER_NODE_IP", {}),
    ("sky", "SKYPILOT_NODE_RANK", {}), ("sky", "SKYPILOT_NODE_IPS", {}),
    ("slurm", "SLURM_NODEID", {}), ("slurm", "SLURM_JOB_NODELIST", {}),
    ("slurm", "RLHF_TASKS_HOSTS", {"image": "nvcr.io/nvidia/pytorch:24.05-py3"}),
    ("runpod", "RAY_WORKER", {}), ("runpod", "HEAD_POD_ID", {}), ("runpod", "EXPECTED_WORKERS", {}),
    ("runpod", "NODE_RANK", {"network": "runpod-cluster"}), ("runpod", "PRIMARY_ADDR", {"network": "runpod-cluster"}),
])
def test_the_providers_contract_variables_are_refused_under_env(provider, name, extra):
    task = parse_task(task_with(env={name: "3"}, resources={"gpus": "H100:1"} if provider != "local" else {},
                                **extra), "t.yaml")
    with pytest.raises(BadInput, match=f"t.yaml: env.{name}: the {provider} provider sets it"):
        providers.provider_class(provider)().plan(task)


def test_only_its_own_provider_refuses_a_contract_variable():
    task = parse_task(task_with(env={"DSTACK_NODE_RANK": "0"}, resources={"gpus": "H100:1"}))
    assert providers.provider_class("sky")().plan(task).env["DSTACK_NODE_RANK"] == "0"


def write(tmp_path, data):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


ALL = ("local", "dstack", "sky", "slurm", "runpod")


@pytest.mark.parametrize("env, refusing", [({"WANDB_API_KEY": "abc123"}, ALL), ({"RAY_AUTH_TOKEN": "abc123"}, ALL),
                                           ({"RLHF_TASKS_NUM_NODES": "abc123"}, ("local",)),
                                           ({"SKYPILOT_NUM_NODES": "abc123"}, ("sky",))])
def test_check_and_render_exit_2_and_write_nothing(env, refusing, tmp_path, capsys, rlhf_home):
    path = write(tmp_path, task_with(env=env))
    name = next(iter(env))
    assert main(["check", path, "--provider", refusing[0]]) == 2
    assert f"env.{name}" in capsys.readouterr().err
    out = tmp_path / "out" / "start-nodes.sh"
    for provider in refusing:
        assert main(["render", path, "--provider", provider, "-o", str(out)]) == 2, provider
        said = capsys.readouterr()
        assert f"env.{name}" in said.err and "abc123" not in said.out + said.err
    assert not (tmp_path / "out").exists()


def test_check_passes_with_the_override(tmp_path, capsys, rlhf_home):
    path = write(tmp_path, task_with(env={"MAX_NEW_TOKEN": "64"}, env_not_secret=["MAX_NEW_TOKEN"]))
    assert main(["check", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["env"]["MAX_NEW_TOKEN"] == "64"


# ------------------------------------------------------------------ secrets wherever they are written

HF = "hf_" + "Q7xw" * 9                       # a Hugging Face token's format
WB = "0123456789abcdef0123456789abcdef01234567"  # W&B's 40 hex digits
SK = "sk-proj-" + "A1b2" * 10


def shipped(name: str) -> dict:
    from conftest import ROOT
    return yaml.safe_load((ROOT / "tasks" / name).read_text())


def verl_with(**args):
    task = shipped("verl-ppo-gsm8k.yaml")
    task["job"]["args"].update(args)
    return task


def openrlhf_with(**args):
    task = shipped("openrlhf-ppo-llama3-8b.yaml")
    task["job"]["args"].update(args)
    return task


def command_with(entrypoint):
    return task_with(job={"recipe": "command", "args": {"entrypoint": entrypoint}})


SERVICE = {"name": "rm", "command": "python3 rm.py"}

#: (the task, the field path the error names, the value it must never repeat): one per kind of field.
WRITTEN = [
    (task_with(setup=["pip install x", f"huggingface-cli login --token {HF}"]), "setup[1]", HF),
    (task_with(prepare=[f"export WANDB_API_KEY={WB} && python3 prep.py"]), "prepare[0]", WB),
    (task_with(prepare=[f"wandb login {WB}"]), "prepare[0]", WB),
    (task_with(services=[{**SERVICE, "command": f"python3 rm.py --api-key {SK}"}]), "services[0].command", SK),
    (task_with(services=[{**SERVICE, "ready": {"http": "http://robot:s3cr3tpw@{node_addr}:8000/health"}}]),
     "services[0].ready.http", "s3cr3tpw"),
    (task_with(services=[{**SERVICE, "ready": {"http": "http://{node_addr}:8000/score", "method": "POST",
                                               "json": {"query": ["q"], "auth": f"Bearer {SK}"}}}]),
     "services[0].ready.json.auth", SK),
    (task_with(services=[{**SERVICE, "env": {"HF_TOKEN": "plain-value-9"}}]), "services[0].env.HF_TOKEN",
     "plain-value-9"),
    (verl_with(extra_overrides=["trainer.val_before_train=false", f"+actor_rollout_ref.model.token={HF}"]),
     "job.args.extra_overrides[1]", HF),
    (openrlhf_with(extra_args=["--use_wandb", WB]), "job.args.extra_args[1]", WB),
    (command_with(f"python3 train.py --hf_token {HF}"), "job.args.entrypoint", HF),
    (command_with(["python3", "train.py", "--password", "hunter2hunter2"]), "job.args.entrypoint[3]",
     "hunter2hunter2"),
    (command_with(["env", "OPENAI_API_KEY=abc123xyz", "python3", "t.py"]), "job.args.entrypoint[1]", "abc123xyz"),
]


@pytest.mark.parametrize("data, path, value", WRITTEN, ids=[p for _, p, _ in WRITTEN])
def test_a_secret_written_anywhere_in_the_task_is_refused_naming_the_field(data, path, value):
    """The checks of `env` run over every string the task writes (setup, prepare, services' commands, readiness
    and env, every recipe argument): the error names the field's path and what it looks like, never the value."""
    with pytest.raises(BadInput) as err:
        parse_task(data, "t.yaml")
    said = str(err.value)
    assert f"t.yaml: invalid task\n  {path}: " in said, said
    assert value not in said and "secrets:" in said, said


def test_each_field_is_named_once_with_the_others_listed():
    with pytest.raises(BadInput) as err:
        parse_task(task_with(setup=[f"echo {HF}"], prepare=[f"echo {SK}"]))
    said = str(err.value)
    assert "setup[0]: " in said and "(also: prepare[0])" in said and HF not in said and SK not in said


@pytest.mark.parametrize("data", [
    task_with(setup=["huggingface-cli login --token $HF_TOKEN", "export WANDB_API_KEY=$WANDB_API_KEY",
                     "pip install git+https://${GH_USER}:${GH_TOKEN}@github.com/org/repo.git",
                     f"git -C /src checkout {WB}",  # a commit's 40 hex digits are no W&B key
                     "curl -H \"Authorization: Bearer $API_TOKEN\" https://example.com/x",
                     "wandb login \"$WANDB_API_KEY\""]),
    task_with(prepare=["python3 prep.py --eos_token '</s>' --max_new_tokens 64 --tokenizer_path /m",
                       "MAX_JOBS=4 HF_HOME=/data/hf pip install flash-attn"]),
    task_with(services=[{**SERVICE, "ready": {"http": "http://{node_addr}:8000/retrieve", "method": "POST",
                                              "json": {"queries": ["what is 2+2?"], "topk": 3}}}]),
    verl_with(extra_overrides=["actor_rollout_ref.rollout.max_num_batched_tokens=8192",
                               "data.max_prompt_length=512", f"actor_rollout_ref.model.revision={WB}"]),
    command_with(["python3", "t.py", "--token_budget", "512", "--pad_token", "<pad>"]),
], ids=["setup", "prepare", "ready-json", "verl-overrides", "command-list"])
def test_references_to_secrets_and_ordinary_words_still_pass(data):
    parse_task(data)


@pytest.mark.parametrize("name", sorted(p.name for p in __import__("conftest").ROOT.joinpath("tasks").glob("*.yaml")))
def test_every_shipped_task_still_passes(name):
    parse_task(shipped(name), name)


@pytest.mark.parametrize("data, path, value", [WRITTEN[0], WRITTEN[7], WRITTEN[11]], ids=["setup", "args", "argv"])
def test_check_render_and_launch_exit_2_naming_the_field_and_never_the_value(data, path, value, tmp_path, capsys,
                                                                             rlhf_home):
    task = write(tmp_path, data)
    for args in (["check", task], ["render", task, "--provider", "dstack", "-o", str(tmp_path / "out")],
                 ["launch", task, "--provider", "local"]):
        assert main(args) == 2, args
        said = capsys.readouterr()
        assert f"{path}: " in said.err and value not in said.out + said.err, said.err
    assert not (tmp_path / "out").exists()
