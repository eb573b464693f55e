"""Models fetched once (issue 47, item 1): where each provider keeps the caches (HF_HOME, TORCH_HOME,
VLLM_CACHE_ROOT) and takes the hub offline, what `check` says a fetch costs, the task's `models:`
refusals, and the node agent's fetch: huggingface_hub's own download (installed here) against the
played hub of tests/hub/ on loopback. The three-node launch that fetches once and relaunches asking
nothing is in tests/test_e2e_local.py (test_tiny_grpo_learns_on_three_nodes_and_resumes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.agent import hub as agent_hub
from rlhf_tasks.agent.contract import NodeInfo
from rlhf_tasks.agent.head import move_aside
from rlhf_tasks.agent.protocol import RESULT_PREFIX
from rlhf_tasks.agent.raynode import Node
from rlhf_tasks.errors import BadInput
from rlhf_tasks.spec import parse_task

from conftest import ROOT
from hub.played_hub import PlayedHub, tiny_model

TOKEN = "hf_" + "Zx8Kp" * 7  # no real token: the played hub accepts this one only
MODEL = "rlhf-tests/tiny-model"


def task_data(**overrides):
    data = {"name": "t", "nodes": 3, "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}}
    data.update(overrides)
    return data


def plan_of(provider: str, **overrides):
    return providers.get(provider).plan(parse_task(task_data(**overrides)))


SHARED = {"dstack": {"volume": "ckpt"}, "sky": {"volume": "ckpt"}, "runpod": {"network_volume": "vol123"},
          "kuberay": {"claim": "ckpt"}}


@pytest.mark.parametrize("provider", ["dstack", "sky", "runpod", "kuberay", "slurm"])
def test_with_shared_storage_the_caches_live_on_it_and_the_head_fetches_once(provider):
    extra = {"placement": {"backends": ["runpod"]}} if provider == "dstack" else {}
    shared = {"checkpoints": {"path": "/ckpt", "shared": {provider: SHARED[provider]}}} if provider in SHARED else \
        {"checkpoints": {"path": "/ckpt"}}
    plan = plan_of(provider, models=[MODEL], secrets=["HF_TOKEN"], **shared, **extra)
    assert {k: plan.env.get(k) for k in ("HF_HOME", "TORCH_HOME", "VLLM_CACHE_ROOT", "HF_HUB_OFFLINE")} == {
        "HF_HOME": "/ckpt/.cache/huggingface", "TORCH_HOME": "/ckpt/.cache/torch", "VLLM_CACHE_ROOT": "/ckpt/.cache/vllm",
        "HF_HUB_OFFLINE": "1"}
    assert plan.hub.model_dump() == {"models": [MODEL], "shared": True, "cache": "/ckpt/.cache/huggingface",
                                     "token_env": "HF_TOKEN", "offline": True, "online_for": []}
    words, warning = providers.get(provider).hub_words(plan)
    assert not warning and words.startswith(f"{MODEL}: fetched once, on the head before Ray starts, into /ckpt/.cache/")
    assert not [w for w in providers.get(provider).notes(plan) if w.startswith("models:")]
    rendered = "\n".join(providers.get(provider).render(plan).values())
    assert "/ckpt/.cache/huggingface" in rendered and "HF_HUB_OFFLINE" in rendered


@pytest.mark.parametrize("provider", ["dstack", "sky", "runpod", "kuberay"])
def test_without_shared_storage_each_node_fetches_into_its_own_cache_and_check_says_the_cost(provider):
    models = ["Qwen/Qwen2.5-7B-Instruct", MODEL]
    plan = providers.get(provider).plan(parse_task(task_data(models=models)))
    assert "HF_HOME" not in plan.env and plan.hub.shared is False and plan.hub.cache is None
    words = [w for w in providers.get(provider).notes(plan) if w.startswith("models:")]
    assert len(words) == 1, words
    assert "each of the 3 nodes fetches them into its own cache" in words[0]
    assert "about 14 GB per node by the sizes in their names, 42 GB from the hub in all" in words[0]
    assert f"(and {MODEL}, whose size is not known from its name)" in words[0]
    unknown = providers.get(provider).notes(providers.get(provider).plan(parse_task(task_data(models=[MODEL]))))
    assert any("their size is not known from their names" in w for w in unknown), unknown


def test_a_sky_bucket_holds_no_cache_and_a_volume_does():
    bucket = plan_of("sky", models=[MODEL], checkpoints={"path": "/ckpt", "shared": {"sky": {"bucket": "s3://b/p"}}})
    assert "HF_HOME" not in bucket.env and not bucket.hub.shared  # rclone's cache uploads in the background
    volume = plan_of("sky", models=[MODEL], checkpoints={"path": "/ckpt", "shared": {"sky": {"volume": "v"}}})
    assert volume.env["HF_HOME"] == "/ckpt/.cache/huggingface" and volume.hub.shared


def test_local_keeps_this_machines_cache_and_fetches_once():
    plan = plan_of("local", models=[MODEL])
    assert "HF_HOME" not in plan.env and plan.hub.shared and plan.env["HF_HUB_OFFLINE"] == "1"


def test_the_tasks_env_wins_and_a_cache_off_the_shared_storage_is_not_shared():
    mine = plan_of("dstack", models=[MODEL], env={"HF_HOME": "/root/hf"},
                   checkpoints={"path": "/ckpt", "shared": {"dstack": {"host_path": "/mnt/nfs"}}})
    assert mine.env["HF_HOME"] == "/root/hf" and mine.env["TORCH_HOME"] == "/ckpt/.cache/torch"
    assert mine.hub.shared is False and mine.hub.cache == "/root/hf"  # each node fetches: /root/hf is its own


def test_a_task_that_names_no_model_fetches_nothing_and_stays_online():
    plan = plan_of("slurm", checkpoints={"path": "/ckpt"})
    assert plan.hub is None and "HF_HUB_OFFLINE" not in plan.env
    assert plan.env["HF_HOME"] == "/ckpt/.cache/huggingface"  # the cache is still on the shared storage
    assert providers.get("slurm").hub_words(plan) is None


def test_the_recipes_name_their_models():
    verl = parse_task(yaml.safe_load((ROOT / "tasks" / "verl-ppo-gsm8k.yaml").read_text()))
    plan = providers.get("slurm").plan(verl)
    assert plan.hub.models == [verl.job.args.model]
    search = [p for p in (ROOT / "tasks").glob("search-r1*.yaml")]
    assert search, "a shipped Search-R1 task"
    plan = providers.get("slurm").plan(parse_task(yaml.safe_load(search[0].read_text())))
    assert "intfloat/e5-base-v2" in plan.hub.models  # the retriever's encoder


def test_a_dataset_the_job_reads_from_the_hub_keeps_it_online():
    data = task_data(nodes=1, resources={"gpus": "H100:8"}, job={"recipe": "openrlhf-ppo", "working_dir": None, "args": {
        "pretrain": "OpenRLHF/Llama-3-8b-sft-mixture", "reward_pretrain": "OpenRLHF/Llama-3-8b-rm-mixture",
        "prompt_data": "OpenRLHF/prompt-collection-v0.1", "colocate": "all"}})
    plan = providers.get("slurm").plan(parse_task(data))
    assert plan.hub.models == ["OpenRLHF/Llama-3-8b-sft-mixture", "OpenRLHF/Llama-3-8b-rm-mixture"]
    assert not plan.hub.offline and "HF_HUB_OFFLINE" not in plan.env
    words, warning = providers.get("slurm").hub_words(plan)
    assert "reads OpenRLHF/prompt-collection-v0.1 from the hub at run time" in words and not warning


@pytest.mark.parametrize("name", ["a/b/c", "org/--x", "../x", "org/x y", "-org/x"])
def test_a_name_that_is_no_hub_model_is_refused_naming_the_entry(name):
    with pytest.raises(BadInput, match=r"models\[1\]: .* is not a Hugging Face Hub model's name"):
        parse_task(task_data(models=[MODEL, name]))


def test_fresh_leaves_the_caches_in_place(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / ".cache" / "huggingface").mkdir(parents=True)
    (ckpt / "step_1.pt").write_text("x")
    moved = move_aside(str(ckpt), "20260101T000000")
    assert moved == str(ckpt / ".old-20260101T000000") and (ckpt / ".old-20260101T000000" / "step_1.pt").exists()
    assert (ckpt / ".cache" / "huggingface").is_dir()


# ------------------------------------------------------------------ the agent's fetch, against the played hub

def node_of(plan: dict, rank: int, env: dict, tmp_path) -> Node:
    logs = tmp_path / f"logs{rank}"
    logs.mkdir(exist_ok=True)
    return Node(plan, NodeInfo(rank, plan["nodes"], "127.0.0.1", "127.0.0.1"), env, str(logs), str(logs))


def hub_env(hub: PlayedHub, home, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return dict(env, HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_TOKEN=TOKEN, RLHF_TASKS_FETCH_EVERY="0", **extra)


def test_three_nodes_on_one_cache_fetch_once_and_a_relaunch_asks_nothing(tmp_path, capsys):
    plan = json.loads(plan_of("local", models=[MODEL], secrets=["HF_TOKEN"]).to_json())
    files = tiny_model()
    with PlayedHub({MODEL: files}, tmp_path / "hub.log", token=TOKEN) as hub:
        env = hub_env(hub, tmp_path / "hf", HF_HUB_OFFLINE="1")  # as the plan's env has it: the fetch is online
        for rank in range(3):
            agent_hub.fetch_models(node_of(plan, rank, env, tmp_path))
        assert hub.count("GET", MODEL, "api") == 1
        assert all(hub.count("GET", MODEL, n + " (cdn)" if n.endswith(".safetensors") else n) == 1 for n in files)
        asked = hub.total()
        for rank in range(3):  # the relaunch
            agent_hub.fetch_models(node_of(plan, rank, env, tmp_path))
        assert hub.total() == asked
    out = capsys.readouterr().out
    assert f"models: fetched {MODEL}: 3 files" in out and f"fetching {MODEL}: " in out and " of " in out
    assert f"models: {MODEL} already fetched in {tmp_path / 'hf' / 'hub'}: the hub is not asked" in out
    assert f"the head fetches {MODEL}" in out
    assert TOKEN not in out and TOKEN not in (tmp_path / "hub.log").read_text()
    assert "token=yes" in (tmp_path / "hub.log").read_text()
    snapshot = tmp_path / "hf" / "hub" / ("models--" + MODEL.replace("/", "--")) / "snapshots" / hub.commits[MODEL]
    assert (snapshot / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_without_a_shared_cache_each_node_fetches_once_into_its_own(tmp_path):
    plan = json.loads(plan_of("dstack", nodes=2, models=[MODEL]).to_json())
    with PlayedHub({MODEL: tiny_model()}, tmp_path / "hub.log") as hub:
        for rank in range(2):
            agent_hub.fetch_models(node_of(plan, rank, hub_env(hub, tmp_path / f"hf{rank}"), tmp_path))
        assert hub.count("GET", MODEL, "api") == 2 and hub.count("GET", MODEL, "config.json") == 2


def test_a_model_the_hub_does_not_know_ends_the_head_before_ray_starts_with_the_hubs_words(tmp_path):
    """The real agent on a one-node plan: its result line names the fetch and gives the hub's words (its
    404 through huggingface_hub's RepositoryNotFoundError), and no Ray was started."""
    plan = plan_of("local", nodes=1, models=["nobody/no-such-model"], secrets=["HF_TOKEN"], ray={"auth": "none"})
    (tmp_path / "plan.json").write_text(plan.to_json())
    with PlayedHub({}, tmp_path / "hub.log", token=TOKEN) as hub:
        env = dict(hub_env(hub, tmp_path / "hf"), RLHF_TASKS_NODE_RANK="0", RLHF_TASKS_NUM_NODES="1",
                   RLHF_TASKS_HEAD_ADDR="127.0.0.1", RLHF_TASKS_NODE_ADDR="127.0.0.1", PYTHONPATH=str(ROOT))
        run = subprocess.run([sys.executable, str(ROOT / "rlhf_tasks" / "agent" / "__main__.py"), "--plan",
                              str(tmp_path / "plan.json"), "--state-dir", str(tmp_path / "state")], env=env,
                             capture_output=True, text=True, timeout=120)
    result = json.loads(next(l for l in run.stdout.splitlines() if l.startswith(RESULT_PREFIX))[len(RESULT_PREFIX):])
    assert run.returncode == 1 and result["failed_step"] == "fetching models", run.stdout + run.stderr
    error = result["error"]
    assert "the hub refused nobody/no-such-model, before Ray started: RepositoryNotFoundError" in error, error
    assert "Repository Not Found for url: " in error and "/api/models/nobody/no-such-model/revision/main" in error
    assert [s["step"] for s in result["steps"]] == ["fetching models"]  # nothing of Ray, no prepare
    assert "starting Ray" not in run.stdout and not list((tmp_path / "state").glob("ray-*.log"))
    assert "token=yes" in (tmp_path / "hub.log").read_text()
    for text in (run.stdout, run.stderr, (tmp_path / "hub.log").read_text(), (tmp_path / "plan.json").read_text()):
        assert TOKEN not in text


def test_check_says_what_fetching_on_every_node_costs(tmp_path, capsys):
    from rlhf_tasks.cli import main

    task = tmp_path / "t.yaml"
    task.write_text(yaml.safe_dump(task_data(models=["Qwen/Qwen2.5-7B-Instruct"])))
    assert main(["check", str(task), "--provider", "dstack"]) == 0
    err = capsys.readouterr().err
    assert ("warning: models: Qwen/Qwen2.5-7B-Instruct: each of the 3 nodes fetches them into its own cache (the "
            "node's default cache (~/.cache/huggingface)) before Ray starts, 3 times: about 14 GB per node by the "
            "sizes in their names, 42 GB from the hub in all; to fetch them once, give checkpoints.shared.dstack") in err
