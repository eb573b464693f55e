"""Small edges a new user met (issue 37, item 10): a duplicate key in the task file, a provider's
launch flag without its provider, --version, a `Bearer` value under env, `launch --fresh`, and
the demo's install said truthfully."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_tasks
from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks.spec import load_task, parse_task

from conftest import ROOT

TASK = {"name": "t", "nodes": 2, "job": {"recipe": "command", "args": {"entrypoint": "true"}}}


def test_a_duplicate_key_is_refused_naming_the_key_and_both_lines(tmp_path, capsys, rlhf_home):
    task = tmp_path / "t.yaml"
    task.write_text("name: t\nnodes: 2\nnodes: 3\njob:\n  recipe: command\n  args: {entrypoint: 'true'}\n")
    with pytest.raises(BadInput) as err:
        load_task(task)
    said = str(err.value)
    assert "nodes" in said and "line 2" in said and "line 3" in said and str(task) in said
    out = tmp_path / "out.sh"
    assert main(["render", str(task), "--provider", "local", "-o", str(out)]) == 2
    assert not out.exists()
    assert "nodes" in capsys.readouterr().err


def test_a_duplicate_key_deeper_down_is_named_by_its_path(tmp_path):
    task = tmp_path / "t.yaml"
    task.write_text("name: t\nnodes: 2\nresources:\n  gpus: H100:8\n  cpus: 4\n  gpus: A100:8\n"
                    "job: {recipe: command, args: {entrypoint: 'true'}}\n")
    with pytest.raises(BadInput) as err:
        load_task(task)
    said = str(err.value)
    assert "resources.gpus" in said and "line 4" in said and "line 6" in said


def test_yaml_merge_keys_and_same_keys_in_different_mappings_still_load(tmp_path):
    task = tmp_path / "t.yaml"
    task.write_text("name: t\nnodes: 2\nenv: &e {NCCL_DEBUG: INFO}\n"
                    "services:\n  - {name: a, command: x, env: {<<: *e, NCCL_DEBUG: WARN}}\n"
                    "  - {name: b, command: y}\n"
                    "job: {recipe: command, args: {entrypoint: 'true'}}\n")
    loaded = load_task(task)
    assert loaded.services[0].env == {"NCCL_DEBUG": "WARN"} and loaded.services[1].name == "b"


def test_a_providers_launch_flag_without_its_provider_is_refused_in_words(capsys):
    assert main(["launch", str(ROOT / "tasks/tiny-grpo.yaml"), "--managed"]) == 2
    err = capsys.readouterr().err
    assert "--managed" in err and "--provider sky" in err
    assert "usage:" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlhf-tasks {rlhf_tasks.__version__}"


@pytest.mark.parametrize("value", ["Bearer abcdef0123456789xyz", "bearer 9f8e7d6c5b4a39281706",
                                   "Authorization: Bearer tok.en-value_123456"])
def test_a_bearer_value_under_env_is_taken_for_a_secret(value):
    with pytest.raises(BadInput) as err:
        parse_task({**TASK, "env": {"EXTRA_HEADER": value}})
    said = str(err.value)
    assert "env.EXTRA_HEADER:" in said and "Bearer" in said and "secrets: [EXTRA_HEADER]" in said
    assert value not in said


@pytest.mark.parametrize("value", ["Bearer", "auth scheme: bearer", "Bearer-token-auth"])
def test_the_word_bearer_alone_is_no_secret(value):
    assert parse_task({**TASK, "env": {"NOTE": value}}).env["NOTE"] == value


def test_fresh_moves_the_old_checkpoints_aside_once_and_never_deletes_them(tmp_path, capsys):
    from rlhf_tasks.agent.head import move_aside

    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_000480.pt").parent.mkdir()
    (ckpt / "step_000480.pt").write_text("weights")
    moved = move_aside(str(ckpt), "20261128T070000Z")
    old = tmp_path / "checkpoints.old-20261128T070000Z"
    assert moved == str(old) and (old / "step_000480.pt").read_text() == "weights" and not ckpt.exists()
    assert str(old) in capsys.readouterr().out
    ckpt.mkdir()  # the fresh run's own checkpoint, then a relaunch of the same launch: kept where it is
    (ckpt / "step_000010.pt").write_text("new")
    assert move_aside(str(ckpt), "20261128T070000Z") is None
    assert (ckpt / "step_000010.pt").read_text() == "new" and (old / "step_000480.pt").exists()
    assert move_aside(str(tmp_path / "none-yet"), "20261128T070000Z") is None


def test_fresh_moves_the_contents_of_a_directory_that_cannot_be_renamed(tmp_path, monkeypatch, capsys):
    """A checkpoint directory that is a mount point (a volume, a claim) cannot be renamed: its
    contents go aside inside it, under a hidden name no recipe resumes from."""
    import os

    from rlhf_tasks.agent import head

    ckpt = tmp_path / "checkpoints"
    (ckpt / "ckpt").mkdir(parents=True)
    (ckpt / "ckpt" / "latest").write_text("7")
    real = os.rename

    def busy(src, dst):
        if os.path.abspath(src) == str(ckpt):
            raise OSError(16, "Device or resource busy")
        return real(src, dst)
    monkeypatch.setattr(head.os, "rename", busy)
    moved = head.move_aside(str(ckpt), "S")
    assert moved == str(ckpt / ".old-S") and (ckpt / ".old-S" / "ckpt" / "latest").read_text() == "7"
    assert os.listdir(ckpt) == [".old-S"]
    assert head.move_aside(str(ckpt), "S") is None  # once per launch


def test_launch_fresh_gives_the_head_the_launchs_stamp_and_says_where(tmp_path, monkeypatch, capsys, rlhf_home):
    from rlhf_tasks.providers.local import LocalProvider

    seen = []

    class Fake(LocalProvider):
        def apply(self, plan, secrets):
            seen.append(plan)
            raise KeyboardInterrupt

    monkeypatch.setattr("rlhf_tasks.commands.cluster.make_provider", lambda name, args=None: Fake())
    main(["launch", str(ROOT / "tasks/tiny-grpo.yaml"), "--fresh"])
    (plan,) = seen
    assert re.fullmatch(r"\d{8}T\d{6}Z", plan.fresh or "")
    out = capsys.readouterr()
    said = out.out + out.err
    assert f"{plan.checkpoint_dir}.old-{plan.fresh}" in said and "deleted" in said
    seen.clear()
    main(["launch", str(ROOT / "tasks/tiny-grpo.yaml")])
    assert seen[0].fresh is None


def test_the_demos_install_says_what_pip_installs():
    """PyPI serves torch for Linux x86_64 only as its CUDA build (its wheel requires CUDA's nvidia-*
    wheels, some 5 GB with them); the CPU-only build is on PyTorch's own index, which `make demo`
    does not use. So `make` must not promise "CPU torch"."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        cuda = any(r.startswith("nvidia-") for r in requires("torch") or [])
    except PackageNotFoundError:
        pytest.fail("torch is not installed (the demo extra holds it)")
    makefile = (ROOT / "Makefile").read_text()
    install = next(line for line in makefile.splitlines() if "installing rlhf-tasks with the demo's needs" in line)
    if cuda:
        assert "CPU torch" not in install and "CUDA" in install and "GB" in install, install
        assert "CPU torch" not in (ROOT / "pyproject.toml").read_text()


def test_launch_fresh_on_local_starts_over_with_the_old_checkpoints_kept_aside(tmp_path, cli_env, rlhf_home):
    """For real, on the local provider: a run, then `launch --fresh`: the second trains from step 1,
    and the first run's checkpoints are beside, whole, where the head said. Its two nodes are two node groups
    (issue 46): tiny-grpo's reward server on a group of its own (`reward_where: group reward`), its trainer on
    the first group's node only (as Ray's own node labels say in the job), reaching the reward server at the
    address the head's gate filled in (`{group_addr:reward}`)."""
    import yaml

    data = yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    del data["nodes"], data["resources"]
    data.update(name="fresh", preflight="off")  # preflight is test_preflight's claim, not this one's
    data["groups"] = [{"name": "trainer", "nodes": 1, "resources": {"cpus": 1}},
                      {"name": "reward", "nodes": 1, "resources": {"cpus": 1}}]
    data["job"]["args"].update(steps=10, save_every=5, reward_where="group reward")
    task = tmp_path / "fresh.yaml"
    task.write_text(yaml.safe_dump(data))

    def launch(*args):
        done = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(task), *args], cwd=tmp_path,
                              env=cli_env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
        return done.stdout + done.stderr

    said = launch()
    nodes = rlhf_home / "runs" / "fresh" / "nodes"
    head, reward = ((nodes / f"node-{rank}.log").read_text() for rank in (0, 1))
    ips = [re.search(r"--node-ip-address (\S+)", log).group(1) for log in (head, reward)]
    served = f"service reward: python3 -m rlhf_tasks.demo.reward_server --host {ips[1]} "
    assert "--labels rlhf-tasks/group=reward" in reward and served in reward and "service reward" not in head, (head,
                                                                                                              reward)
    assert f"the groups' addresses in the job's command: reward={ips[1]}, trainer={ips[0]}" in said, said[-4000:]
    assert "ranks on nodes with trainer: node groups ['trainer'] (Ray's labels)" in said, said[-4000:]
    ckpt = rlhf_home / "runs" / "fresh" / "checkpoints"
    first = sorted(p.name for p in ckpt.iterdir())
    assert "step_000010.pt" in first
    out = launch("--fresh")
    (old,) = ckpt.parent.glob("checkpoints.old-*")
    assert sorted(p.name for p in old.iterdir()) == first
    assert f"moved the old checkpoints aside, nothing deleted: {ckpt} -> {old}" in out
    assert "over steps 1..10" in out and "resumed" not in out, out[-3000:]
    assert (ckpt / "step_000010.pt").exists()
