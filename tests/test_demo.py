"""The tiny-grpo demo: reward server over HTTP, data prep, GRPO math, and a real
training run with resume on a 3-node local Ray cluster."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlhf_tasks.demo import prepare, reward_server
from rlhf_tasks.agent.protocol.ports import free_port

from conftest import starts_cluster

ROOT = Path(__file__).resolve().parent.parent
NODE_IP = "127.0.1.1"  # Ray rewrites 127.0.0.1 to the machine's public address, not the rest of 127/8


def request(url: str, body: bytes | dict | None = None, method: str = "POST") -> tuple[int, dict]:
    """(status, JSON body) of one request, error statuses included, bypassing any proxy."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=5) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture
def reward_url(tmp_path):
    """A reward server subprocess on a free loopback port; yields its base URL once it
    answers a POST, and checks that SIGTERM stops it cleanly."""
    port = free_port()
    log = open(tmp_path / "reward_server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_tasks.demo.reward_server", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"reward server exited: {(tmp_path / 'reward_server.log').read_text()}"
            try:
                request(f"{base}/score", {"prompts": [], "completions": []})
                break
            except OSError:  # not listening yet
                assert time.monotonic() < deadline, "reward server did not answer within 30s"
                time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        try:
            returncode = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            log.close()
    assert returncode == 0, (tmp_path / "reward_server.log").read_text()
    assert "reward server stopped" in (tmp_path / "reward_server.log").read_text()


# ---------------------------------------------------------------- (a) reward server


def test_score_rules():
    assert reward_server.score("3+4=", "7") == 1.0
    assert reward_server.score("3+4=", " 7\n") == 1.0
    assert reward_server.score("3+4=", "7.") == 0.5  # right number, extra text
    assert reward_server.score("3+4=", "8") == 0.0
    assert reward_server.score("3+4=", "") == 0.0
    assert reward_server.score("9-12=", "-3") == 1.0
    assert reward_server.score("6*7=", "the answer is 42") == 0.5
    assert reward_server.score("hello", "7") == 0.0


def test_reward_server_http(reward_url):
    status, body = request(f"{reward_url}/score", {"prompts": ["3+4=", "3+4=", "2+2=", "1+1="], "completions": ["7", "8", " 4", "2!"]})
    assert status == 200
    assert body == {"rewards": [1.0, 0.0, 1.0, 0.5]}

    # OpenRLHF-M's remote reward model route: queries are prompt + completion
    status, body = request(f"{reward_url}/get_reward", {"query": ["3+4=7", "3+4=1"], "prompts": ["3+4=", "3+4="]})
    assert (status, body) == (200, {"rewards": [1.0, 0.0]})

    status, body = request(f"{reward_url}/score", method="GET")
    assert status == 405 and "POST" in body["error"]

    status, body = request(f"{reward_url}/score", b"{not json")
    assert status == 400 and "bad JSON" in body["error"]

    status, body = request(f"{reward_url}/score", {"prompts": ["3+4="], "completions": []})
    assert status == 400 and "completions" in body["error"]

    status, body = request(f"{reward_url}/score", {"prompts": "3+4=", "completions": ["7"]})
    assert status == 400 and "list of strings" in body["error"]

    status, _ = request(f"{reward_url}/nope", {})
    assert status == 404


# ---------------------------------------------------------------- (b) data prep


def test_prepare_writes_prompts(tmp_path):
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "rlhf_tasks.demo.prepare", "--out", str(out), "--num-prompts", "50", "--seed", "3"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    assert "wrote 50 prompts" in first.stdout

    path = out / "prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50
    for row in rows:
        assert re.fullmatch(r"\d\+\d=", row["prompt"])
        assert reward_server.score(row["prompt"], row["answer"]) == 1.0
        assert len(row["answer"]) == 1
    assert len({row["answer"] for row in rows}) > 5  # sums are spread out, not one answer

    before = path.read_text()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    assert "up to date" in again.stdout
    assert path.read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["prompts.jsonl"]  # no temp files left

    assert prepare.make_prompts(50, 4) != prepare.make_prompts(50, 3)


# ---------------------------------------------------------------- (c) GRPO math


def test_group_advantages():
    import torch
    from rlhf_tasks.demo.train import group_advantages

    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(4))  # no signal when every completion scores the same
    expected = 0.5 / torch.tensor([0.0, 1.0, 0.0, 1.0]).std()
    assert torch.allclose(adv[1], torch.tensor([-1.0, 1.0, -1.0, 1.0]) * expected, atol=1e-3)
    assert adv[2, 3] > 0 and (adv[2, :3] < 0).all()
    assert torch.allclose(adv.mean(dim=1), torch.zeros(3), atol=1e-6)
    assert torch.allclose(adv[1:].std(dim=1), torch.ones(2), atol=1e-3)
    # invariant to the reward scale and offset, per group
    assert torch.allclose(group_advantages(rewards * 5 + 2)[1:], adv[1:], atol=1e-3)


def test_grpo_loss_pushes_towards_rewarded_answers():
    import torch
    from rlhf_tasks.demo.train import grpo_loss

    logits = torch.zeros(2, 10, requires_grad=True)
    actions = torch.tensor([3, 5])
    loss = grpo_loss(logits, actions, torch.tensor([1.0, -1.0]), explore_coef=0.0)
    loss.backward()
    assert logits.grad[0, 3] < 0  # gradient descent raises the rewarded answer
    assert logits.grad[1, 5] > 0  # and lowers the penalised one

    # the exploration term is zero at the uniform policy and grows as the policy sharpens
    uniform = grpo_loss(torch.zeros(1, 10), torch.tensor([0]), torch.zeros(1), explore_coef=1.0)
    peaked = grpo_loss(torch.tensor([[9.0] + [0.0] * 9]), torch.tensor([0]), torch.zeros(1), explore_coef=1.0)
    assert abs(uniform.item()) < 1e-6 and peaked.item() > 1.0


def test_grpo_learns_addition_locally():
    """The default hyperparameters learn the task (3 ranks' prompts in one batch, local scoring)."""
    import torch
    from rlhf_tasks.demo.train import Policy, grpo_step

    torch.manual_seed(0)
    prompts = [row["prompt"] for row in prepare.make_prompts(1000, 0)]
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.02)
    generator = torch.Generator().manual_seed(0)
    rewards = []
    for _ in range(100):
        picks = torch.randint(len(prompts), (96,), generator=generator)
        batch = [prompts[i] for i in picks.tolist()]
        reward, _ = grpo_step(policy, optimizer, batch, lambda p, c: [reward_server.score(*pc) for pc in zip(p, c)], 16, 0.05, generator)
        rewards.append(reward)
    assert rewards[0] < 0.2
    assert sum(rewards[-10:]) / 10 > 0.9


# ---------------------------------------------------------------- (d) 3-node training run


@pytest.fixture
@starts_cluster
def ray_cluster(monkeypatch):
    """A real 3-node Ray cluster (1 CPU each) in this process's children, without token
    auth and with its own short temp dir, so it cannot meet another Ray on the machine."""
    from ray.cluster_utils import Cluster
    temp_root = tempfile.mkdtemp(prefix="rtd", dir="/tmp")  # short: Ray's socket paths are length-limited
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", temp_root)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    node_args = {"num_cpus": 1, "node_ip_address": NODE_IP, "object_store_memory": 80 * 1024 * 1024}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node_args, "include_dashboard": False, "dashboard_port": free_port(), "dashboard_agent_listen_port": 0},
    )
    try:
        for _ in range(2):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes(timeout=60)
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_root, ignore_errors=True)


def run_trainer(cluster, reward_url: str, data: Path, ckpt: Path, steps: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_ADDRESS=cluster.address, PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "rlhf_tasks.demo.train",
        "--data", str(data), "--reward-url", f"{reward_url}/score", "--ckpt-dir", str(ckpt),
        "--num-nodes", "3", "--steps", str(steps), "--save-every", "2", "--pg-timeout", "90",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def read_metrics(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]


def test_train_on_three_nodes_and_resume(ray_cluster, reward_url, tmp_path):
    prepare.main(["--out", str(tmp_path / "data"), "--num-prompts", "200"])
    data, ckpt = tmp_path / "data" / "prompts.jsonl", tmp_path / "ckpt"
    cluster_node_ids = {node.node_id for node in ray_cluster.list_all_nodes()}

    first = run_trainer(ray_cluster, reward_url, data, ckpt, steps=4)
    assert re.search(r"^done: steps 1\.\.4 in [\d.]+s, reward ", first.stdout, re.M)
    metrics = read_metrics(ckpt)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["world_size"] == 3
        assert len(set(m["node_ids"])) == 3 and set(m["node_ids"]) == cluster_node_ids
        assert 0.0 <= m["mean_reward"] <= 1.0 and m["seconds"] > 0 and "loss" in m
    assert sorted(p.name for p in ckpt.glob("step_*.pt")) == ["step_000002.pt", "step_000004.pt"]

    second = run_trainer(ray_cluster, reward_url, data, ckpt, steps=6)
    assert "resuming from step_000004.pt" in second.stdout and "done: steps 5..6 in" in second.stdout
    metrics = read_metrics(ckpt)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert metrics[4]["resumed_from"] == 4 and "resumed_from" not in metrics[5]
    assert (ckpt / "step_000006.pt").is_file()

    third = run_trainer(ray_cluster, reward_url, data, ckpt, steps=6)
    assert "nothing to do" in third.stdout
    assert len(read_metrics(ckpt)) == 6
