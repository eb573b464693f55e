"""W&B (issue 38, item 4): `wandb: {entity, project, group, tags}` at placement or job level
passed as each framework takes them (checked by verl's config and OpenRLHF's own parser);
one W&B run id per name, continued across the job's restarts and relaunches (WANDB_RUN_ID,
WANDB_RESUME=allow) and new for `launch --fresh`, checked with the real `wandb` package
offline; `check` warns of a W&B project without WANDB_API_KEY."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import frameworks
from conftest import ROOT, need
from rlhf_tasks import providers
from rlhf_tasks.launch_records import keep_wandb_run, wandb_run
from rlhf_tasks.spec import parse_task
from test_framework_validation import OPENRLHF, hydra, openrlhf, verl_config  # noqa: F401 - fixtures

VERL = str(ROOT / "tasks" / "verl-ppo-gsm8k.yaml")


def task_with(path: str, secrets=("WANDB_API_KEY",), placement=None, job=None):
    import yaml

    data = yaml.safe_load(open(path))
    data["secrets"] = list(secrets)
    if placement is not None:
        data.setdefault("placement", {})["wandb"] = placement
    if job is not None:
        data["job"]["wandb"] = job
    return parse_task(data)


def test_job_level_wins_field_by_field_and_the_env_carries_them():
    task = task_with(VERL, placement={"entity": "team", "project": "rlhf", "tags": ["a", "b"]},
                     job={"project": "gsm8k", "group": "sweep-1"})
    plan = providers.get("dstack").plan(task)
    assert {k: v for k, v in plan.env.items() if k.startswith("WANDB_")} == {
        "WANDB_ENTITY": "team", "WANDB_PROJECT": "gsm8k", "WANDB_RUN_GROUP": "sweep-1", "WANDB_TAGS": "a,b"}


def test_verl_takes_the_project_as_its_project_name(verl_config):
    from omegaconf import OmegaConf

    task = task_with(VERL, job={"project": "gsm8k-runs"})
    plan = providers.get("dstack").plan(task)
    cfg = frameworks.compose(verl_config, "ppo_trainer", plan.job.entrypoint[3:] + plan.job.wandb_args)
    OmegaConf.resolve(cfg)
    assert cfg.trainer.project_name == "gsm8k-runs" and list(cfg.trainer.logger) == ["console", "wandb"]


@pytest.mark.parametrize("version", [OPENRLHF["current"], OPENRLHF["OpenRLHF-M base"]])
def test_openrlhf_takes_project_org_and_group_as_flags(openrlhf, version):  # noqa: F811
    from rlhf_tasks.models import WandbOptions
    from rlhf_tasks.recipes.base import Shape
    from rlhf_tasks.recipes.openrlhf import OpenRLHFPPOJob

    job = OpenRLHFPPOJob.model_validate({"recipe": "openrlhf-ppo", "args": {
        "pretrain": "a", "reward_pretrain": "rm", "prompt_data": "p", "colocate": "all",
        "version": version.split(".post")[0]}})
    shape = Shape(nodes=2, gpus_per_node=8, checkpoint_dir="/ckpt", resume=True,
                  wandb=WandbOptions(entity="team", project="ppo", group="g1"))
    out = job.build(shape)
    args = frameworks.openrlhf_parse(openrlhf(version), out.entrypoint[3:] + out.wandb_args)
    if hasattr(args, "logger"):
        told = args.logger.wandb
        assert (told.org, told.project, told.group) == ("team", "ppo", "g1")
    else:
        assert (args.wandb_org, args.wandb_project, args.wandb_group) == ("team", "ppo", "g1")


def test_check_warns_of_a_project_without_the_key(tmp_path):
    import yaml

    task = tmp_path / "t.yaml"
    data = yaml.safe_load(open(VERL))
    data["placement"] = {**data.get("placement", {}), "wandb": {"project": "rlhf"}}
    data["secrets"] = [s for s in data.get("secrets", []) if s != "WANDB_API_KEY"]
    task.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "check", str(task), "--provider", "dstack"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "warning: placement.wandb.project names a W&B project but WANDB_API_KEY is not among the task's " \
           "secrets" in done.stderr
    data["secrets"] = ["WANDB_API_KEY"]
    task.write_text(yaml.safe_dump(data))
    done = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "check", str(task), "--provider", "dstack"],
                          capture_output=True, text=True, env={**env, "WANDB_API_KEY": "x"}, timeout=120)
    assert done.returncode == 0 and "W&B" not in done.stderr, done.stderr


ATTEMPT = """
import sys, wandb
# as OpenRLHF's WandbLogger calls it (entity and group None unless given)
run = wandb.init(entity=None, project="rlhf", group=None, name="attempt", reinit=True)
start = run.step
for i in range(3):
    run.log({"reward": 0.1 * (start + i)})
print("RUN", run.id, run.group, ",".join(run.tags), flush=True)
run.finish()
"""


def test_two_attempts_of_a_job_write_into_one_wandb_run(rlhf_home, tmp_path):
    need(__import__("importlib").util.find_spec("wandb") is not None, "wandb is not installed (pip install -e '.[test]')")
    task = task_with(VERL, placement={"group": "g", "tags": ["t1"]})
    plan = providers.get("dstack").plan(task)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    run_env = wandb_run(task)
    assert not (rlhf_home / "runs").exists()  # nothing written before the launch goes ahead
    keep_wandb_run(task.name, run_env)

    def attempt():
        done = subprocess.run([sys.executable, "-c", ATTEMPT], capture_output=True, text=True, timeout=300, env={
            **env, **{k: v for k, v in plan.env.items() if k.startswith("WANDB_")}, **run_env,
            "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
        assert done.returncode == 0, done.stderr[-2000:]
        return [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RUN ")][0]

    first, second = attempt(), wandb_run(task)
    assert second == run_env  # a restart or a relaunch: the same id
    again = attempt()
    assert first == again == [run_env["WANDB_RUN_ID"], "g", "t1"]
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith("-" + run_env["WANDB_RUN_ID"]) for name in runs)
    fresh = wandb_run(task, fresh=True)
    assert fresh["WANDB_RUN_ID"] != run_env["WANDB_RUN_ID"] and wandb_run(task) == run_env
    keep_wandb_run(task.name, fresh)
    assert wandb_run(task) == fresh
    other = wandb_run(task_with(VERL).model_copy(update={"name": "other"}))
    assert other["WANDB_RUN_ID"].startswith("other-") and other["WANDB_RUN_ID"] != fresh["WANDB_RUN_ID"]
    assert wandb_run(task_with(VERL, secrets=())) == {}  # no key: W&B is off, nothing to continue


@pytest.mark.parametrize("path,field", [(VERL, "job.args.project_name"),
                                        (str(ROOT / "tasks" / "search-r1-ppo-qwen2.5-7b.yaml"), "job.args.project_name")])
def test_check_warns_of_a_verl_project_name_without_the_key(tmp_path, path, field):
    """verl's trainer.project_name (Search-R1's too) is the W&B project, as OpenRLHF's wandb_project is:
    named by the task without WANDB_API_KEY, `check` says nothing is logged; the recipe's default is no naming."""
    import yaml

    task = tmp_path / "t.yaml"
    data = yaml.safe_load(open(path))
    data["secrets"] = [s for s in data.get("secrets", []) if s != "WANDB_API_KEY"]
    assert "project_name" in data["job"]["args"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)
    words = f"warning: {field} names a W&B project but WANDB_API_KEY is not among the task's secrets"

    def check(data):
        task.write_text(yaml.safe_dump(data))
        done = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "check", str(task), "--provider", "dstack"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert words in check(data)
    data["job"]["args"].pop("project_name")
    assert "W&B" not in check(data)  # the recipe's own default names nothing
