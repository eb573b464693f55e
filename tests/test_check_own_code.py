"""`check` asks the providers' and frameworks' own code (issue 48, item 7): dstack's configuration
models, backend names and gpuhunt's GPU table; SkyPilot's task schema, `Task.from_yaml_config`, its
clouds and its accelerator catalog; verl's Hydra compose of the overrides; OpenRLHF's argument parser
of the whole command, in the release the task pins; DeepSpeed's batch arithmetic. Each refusal names
the field, gives the tool's words and exits 2; where the tool is not installed here, `check` says what
it did not check. And a misspelled recipe argument gets the suggestion it means (item 8).

verl and OpenRLHF are installed for a test the way `check` finds them on a user's machine: their
released wheels (tests/frameworks.py: `pip download --no-deps`, cached) installed with `pip install
--no-deps --target` into a directory on sys.path (their dependencies need GPUs). SkyPilot ships no
accelerator catalog (it fetches one on first use): tests/sky/accelerators.csv is a copy of its own
(github.com/skypilot-org/skypilot-catalog, catalogs/v8/common/accelerators.csv), put where SkyPilot
keeps it under SKY_RUNTIME_DIR."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.cli import main
from rlhf_tasks.spec import load_task
from rlhf_tasks.recipes.verl import VERL_VERSION

import frameworks
from conftest import ROOT, need
from test_providers_render import tasks_for

VERL_TASK = {"name": "t", "nodes": 2, "resources": {"gpus": "H100:8"}, "checkpoints": {"path": "/ckpt"},
             "job": {"recipe": "verl-ppo", "working_dir": None}}
OPENRLHF_TASK = {"name": "t", "nodes": 2, "resources": {"gpus": "H100:8"}, "checkpoints": {"path": "/ckpt"},
                 "job": {"recipe": "openrlhf-ppo", "working_dir": None,
                         "args": {"pretrain": "a", "reward_pretrain": "rm", "prompt_data": "p", "colocate": "all"}}}
COMMAND_TASK = {"name": "t", "nodes": 2, "resources": {"gpus": "H100:8"},
                "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}}


def task_file(tmp_path: Path, data: dict, **changes) -> str:
    data = json.loads(json.dumps(data))
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    out = tmp_path / "t.yaml"
    out.write_text(json.dumps(data))
    return str(out)


def check(capsys, path: str, provider: str | None = "slurm") -> tuple[int, str, str]:
    code = main(["check", path] + (["--provider", provider] if provider else []))
    out = capsys.readouterr()
    return code, out.out, out.err


def installed(tmp_path_factory, name: str, version: str) -> Path:
    """The release's wheel installed without its dependencies into a directory of its own."""
    wheel, why = frameworks.wheel(name, version)
    need(wheel is not None, f"{name} {version}: {why}")
    target = tmp_path_factory.mktemp(f"{name}-{version}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    return target


@pytest.fixture(scope="module")
def verl_site(tmp_path_factory):
    return installed(tmp_path_factory, "verl", VERL_VERSION)


@pytest.fixture(scope="module")
def openrlhf_site(tmp_path_factory):
    return installed(tmp_path_factory, "openrlhf", "0.11.2")


def test_the_frameworks_are_not_installed_in_the_test_environment():
    """The tests below without a framework's site directory rely on its absence here."""
    import importlib.util

    assert importlib.util.find_spec("verl") is None and importlib.util.find_spec("openrlhf") is None


# --- verl ----------------------------------------------------------------------------------


def test_verl_not_installed_is_said(tmp_path, capsys):
    code, out, _ = check(capsys, task_file(tmp_path, VERL_TASK))
    assert code == 0
    assert "verl's Hydra config (verl/trainer/config/ppo_trainer.yaml): not checked: verl is not installed here" in out


def test_verl_composes_a_good_task(tmp_path, capsys, monkeypatch, verl_site):
    monkeypatch.syspath_prepend(str(verl_site))
    code, out, err = check(capsys, task_file(tmp_path, VERL_TASK))
    assert code == 0, err
    assert f"of verl {VERL_VERSION}, installed here: the overrides compose" in out


def test_verl_refuses_a_misspelled_override_in_its_words(tmp_path, capsys, monkeypatch, verl_site):
    monkeypatch.syspath_prepend(str(verl_site))
    path = task_file(tmp_path, VERL_TASK, job__args={
        "extra_overrides": ["trainer.val_before_train=False", "actor_rollout_ref.rollout.tensor_paralel_size=2"]})
    code, _, err = check(capsys, path)
    assert code == 2
    assert f"job.args.extra_overrides[1]: verl {VERL_VERSION}'s Hydra compose refuses the overrides" in err
    assert "Could not override 'actor_rollout_ref.rollout.tensor_paralel_size'" in err  # Hydra's words
    assert "(did you mean tensor_model_parallel_size?)" in err


# --- OpenRLHF --------------------------------------------------------------------------------


def test_openrlhf_not_installed_is_said(tmp_path, capsys):
    code, out, _ = check(capsys, task_file(tmp_path, OPENRLHF_TASK))
    assert code == 0
    assert "OpenRLHF's argument parser (openrlhf/cli/train_ppo_ray.py): not checked: openrlhf is not installed" in out


@pytest.mark.parametrize("extra,words,hint", [
    (["--actor_num_nodes", "2"], "unrecognized arguments: --actor_num_nodes 2", "--actor.num_nodes"),
    (["--train.colocate_actr_ref"], "unrecognized arguments: --train.colocate_actr_ref", "--train.colocate_actor_ref"),
])
def test_openrlhf_refuses_flags_its_release_lacks(tmp_path, capsys, monkeypatch, openrlhf_site, extra, words, hint):
    monkeypatch.syspath_prepend(str(openrlhf_site))
    code, _, err = check(capsys, task_file(tmp_path, OPENRLHF_TASK, job__args__extra_args=extra))
    assert code == 2
    assert "job.args.extra_args[0]: OpenRLHF 0.11.2's train_ppo_ray refuses the command: " in err
    assert f"train_ppo_ray.py: error: {words}" in err and f"(did you mean {hint}?)" in err


def test_openrlhf_parses_a_good_task_and_names_another_release(tmp_path, capsys, monkeypatch, openrlhf_site):
    monkeypatch.syspath_prepend(str(openrlhf_site))
    code, out, err = check(capsys, task_file(tmp_path, OPENRLHF_TASK))
    assert code == 0, err
    assert "of openrlhf 0.11.2, installed here: the command parses and passes its start-up checks" in out
    code, out, err = check(capsys, task_file(tmp_path, OPENRLHF_TASK, job__args__version="0.8.11"))
    assert code == 0, err
    assert "not checked: openrlhf 0.11.2 is installed here, the task pins 0.8.11 (job.args.version)" in out


def test_openrlhf_checkpoint_options_are_asked_of_the_pinned_release(tmp_path, capsys, monkeypatch, openrlhf_site):
    """save_value_network and use_ds_universal_ckpt: recipe arguments that OpenRLHF 0.11.2's parser takes under
    its names; a release without the flag is refused with why, before anything is asked."""
    monkeypatch.syspath_prepend(str(openrlhf_site))
    args = dict(OPENRLHF_TASK["job"]["args"], colocate="pairs", actor_gpus=4, critic_gpus=4, save_value_network=True,
                use_ds_universal_ckpt=True)
    code, out, err = check(capsys, task_file(tmp_path, OPENRLHF_TASK, job__args=args))
    assert code == 0, err
    assert "of openrlhf 0.11.2, installed here: the command parses and passes its start-up checks" in out
    assert "--critic.save_value_network --ds.use_universal_ckpt" in out
    code, _, err = check(capsys, task_file(tmp_path, OPENRLHF_TASK, job__args=dict(args, version="0.6.1")))
    assert code == 2
    assert "job.args: use_ds_universal_ckpt: OpenRLHF's universal checkpoint loading came in 0.6.3" in err


def test_deepspeed_batch_arithmetic(tmp_path, capsys):
    """train_batch_size 100 with micro 8 on the actor's 16 GPUs: DeepSpeed's _batch_assertion refuses it."""
    args = dict(OPENRLHF_TASK["job"]["args"], train_batch_size=100, micro_train_batch_size=8)
    code, _, err = check(capsys, task_file(tmp_path, OPENRLHF_TASK, job__args=args))
    assert code == 2
    assert "job.args.train_batch_size, job.args.micro_train_batch_size, job.args.actor_gpus: infeasible" in err
    assert "Gradient accumulation steps: 0 has to be greater than 0" in err  # 100 // 8 // 16 = 0
    args.update(train_batch_size=200, actor_gpus=8, vllm_engines=8, ref_gpus=8, reward_gpus=8)
    code, _, err = check(capsys, task_file(tmp_path, OPENRLHF_TASK, job__args=args))
    assert code == 2 and "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * " \
                          "world_size200 != 8 * 3 * 8" in err
    args.update(train_batch_size=192)
    code, _, err = check(capsys, task_file(tmp_path, OPENRLHF_TASK, job__args=args))
    assert code == 0, err


# --- dstack ----------------------------------------------------------------------------------


def _dstack():
    try:
        import dstack  # noqa: F401
    except ImportError:
        need(False, "the dstack package (pip install 'rlhf-tasks[dstack]')")


@pytest.mark.parametrize("changes,field,words", [
    ({"resources__gpus": "H100X:8"}, "resources.gpus", "gpuhunt's GPU table has no such GPU (did you mean H100?)"),
    ({"resources__gpus": "A100-96GB:8"}, "resources.gpus", "gpuhunt's GPU table has A100 with 40GB, 80GB only"),
    ({"placement": {"backends": ["aws", "aws2"]}}, "placement.backends[1]", "Input should be 'amddevcloud'"),
])
def test_dstack_refuses_what_its_code_refuses(tmp_path, capsys, changes, field, words):
    _dstack()
    code, _, err = check(capsys, task_file(tmp_path, COMMAND_TASK, **changes), "dstack")
    assert code == 2
    assert f"error: {tmp_path / 't.yaml'}: {field}: " in err and words in err
    if "backends" in field:
        assert "(did you mean aws?)" in err


def test_dstack_takes_skypilots_memory_form(tmp_path, capsys):
    _dstack()
    code, out, err = check(capsys, task_file(tmp_path, COMMAND_TASK, resources__gpus="A100-80G:8"), "dstack")
    assert code == 0, err
    assert "dstack 0.22.5's configuration models (parse_apply_configuration) take t.dstack.yml and " \
           "t-fleet.dstack.yml" in out


# --- SkyPilot --------------------------------------------------------------------------------


def sky_check(tmp_path, capsys, monkeypatch, data: dict, catalog: bool, **changes) -> tuple[int, str, str]:
    """`check --provider sky` with SkyPilot's catalog on this machine (under SKY_RUNTIME_DIR) or not."""
    try:
        import sky  # noqa: F401
    except ImportError:
        need(False, "the skypilot package (pip install 'rlhf-tasks[sky]')")
    runtime = tmp_path / "sky-runtime"
    if catalog:
        (runtime / ".sky/catalogs/v8/common").mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "tests/sky/accelerators.csv", runtime / ".sky/catalogs/v8/common/accelerators.csv")
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(runtime))
    return check(capsys, task_file(tmp_path, data, **changes), "sky")


def test_sky_refuses_an_unknown_cloud_in_its_words(tmp_path, capsys, monkeypatch):
    code, out, err = sky_check(tmp_path, capsys, monkeypatch, COMMAND_TASK, False, placement={"backends": ["aws2"]})
    assert code == 2
    assert "placement.backends[0]: SkyPilot 0.14.1 refuses t.sky.yaml: Invalid resources YAML: 'aws2' is not one " \
           "of ['aws'" in err
    assert "(did you mean aws?)" in err


def test_sky_without_its_catalog_says_the_gpu_is_not_checked(tmp_path, capsys, monkeypatch):
    code, out, err = sky_check(tmp_path, capsys, monkeypatch, COMMAND_TASK, False, resources__gpus="H100X:8")
    assert code == 0, err
    assert "resources.gpus: not checked against SkyPilot's accelerator catalog: it is not on this machine" in out
    assert not (tmp_path / "sky-runtime" / ".sky" / "catalogs").exists()  # nothing fetched


def test_sky_leaves_kubernetes_gpu_names_to_the_cluster(tmp_path, capsys, monkeypatch):
    code, out, err = sky_check(tmp_path, capsys, monkeypatch, COMMAND_TASK, True, resources__gpus="H100X:8",
                               placement={"backends": ["kubernetes"]})
    assert code == 0, err
    assert "resources.gpus H100X: not checked against SkyPilot's catalog: on kubernetes the cluster names its " \
           "GPUs itself" in out


def test_sky_refuses_a_gpu_its_catalog_lacks(tmp_path, capsys, monkeypatch):
    code, out, err = sky_check(tmp_path, capsys, monkeypatch, COMMAND_TASK, True, resources__gpus="H100X:8")
    assert code == 2
    assert "resources.gpus: H100X:8: SkyPilot's accelerator catalog (common/accelerators.csv) has no 'H100X'" \
           in err and "(did you mean H100?)" in err


def test_sky_renders_the_memory_form_its_catalog_has(tmp_path, capsys, monkeypatch):
    """`A100-80G:8` is `A100-80GB:8` for SkyPilot (and `A100:80GB:8` for dstack)."""
    code, out, err = sky_check(tmp_path, capsys, monkeypatch, COMMAND_TASK, True, resources__gpus="A100-80G:8")
    assert code == 0, err
    assert "resources.gpus A100-80GB is in SkyPilot's accelerator catalog" in out
    task = load_task(task_file(tmp_path, COMMAND_TASK, resources__gpus="A100-80G:8"))
    for name, key, form in (("sky", "accelerators", "A100-80GB:8"), ("dstack", "gpu", "A100:80GB:8")):
        provider = providers.get(name)
        rendered = yaml.safe_load(provider.render(provider.plan(task))["t.dstack.yml" if name == "dstack"
                                                                         else "t.sky.yaml"])
        assert rendered["resources"][key] == form
    code, out, err = sky_check(tmp_path, capsys, monkeypatch, COMMAND_TASK, True, resources__gpus="MI300X:8",
                               placement={"backends": ["aws"]})
    assert code == 2 and "offers MI300X on runpod only, none of aws" in err


# --- item 8: the suggestion for a misspelled recipe argument -------------------------------------


@pytest.mark.parametrize("word,said", [
    ("rollout_tp", "(did you mean rollout_tensor_parallel_size?)"),  # was: rollout_n
    ("rolout_n", "(did you mean rollout_n?)"),
    ("rollout", "(its arguments: model, "),  # the start of several: none offered
])
def test_a_misspelled_argument_gets_the_suggestion_it_means(tmp_path, capsys, word, said):
    code, _, err = check(capsys, task_file(tmp_path, VERL_TASK, job__args={word: 2}))
    assert code == 2
    assert f"job.args.{word}: unknown argument of the verl-ppo recipe {said}" in err


@pytest.mark.parametrize("provider", ["dstack", "sky"])
def test_every_shipped_task_passes_what_it_is_asked(tmp_path, capsys, monkeypatch, verl_site, openrlhf_site, provider):
    """A task valid before stays valid: every catalogue task, with verl and OpenRLHF installed and
    SkyPilot's catalog here, passes each provider's and framework's own code."""
    for site in (verl_site, openrlhf_site):
        monkeypatch.syspath_prepend(str(site))
    runtime = tmp_path / "sky-runtime" / ".sky/catalogs/v8/common"
    runtime.mkdir(parents=True)
    shutil.copy(ROOT / "tests/sky/accelerators.csv", runtime / "accelerators.csv")
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path / "sky-runtime"))
    for path in tasks_for(provider):
        code, out, err = check(capsys, str(path), provider)
        assert code == 0, (path, err)
        assert "not checked: verl" not in out and "not checked: openrlhf" not in out, out
        if "search-r1" in path.name or "openrlhf-m" in path.name:
            assert "not checked: Search-R1 is not on PyPI" in out or "not checked: OpenRLHF-M is not on PyPI" in out


# --- Slurm's sbatch ----------------------------------------------------------------------------

SLURM_TASK = {**COMMAND_TASK, "resources": {"cpus": 1}}


def test_sbatch_without_a_slurm_to_ask_is_not_started_and_that_is_said(tmp_path, capsys, monkeypatch):
    """sbatch --test-only asks the cluster's slurmctld (tests/test_slurm_provider.py, on a real one): where
    sbatch has no configuration here, or is not installed, `check` starts nothing and says what it did not check
    (the `cluster` guard of tests/conftest.py fails a test that starts sbatch)."""
    from rlhf_tasks.providers.slurm.commands import SLURM_CONFS

    monkeypatch.delenv("SLURM_CONF", raising=False)
    need(not any(Path(path).exists() for path in SLURM_CONFS), "this machine has a Slurm configuration")
    code, out, _ = check(capsys, task_file(tmp_path, SLURM_TASK))
    assert code == 0
    assert ("sbatch --test-only of t.sbatch: not checked: no Slurm configuration here for sbatch (SLURM_CONF, "
            "/etc/slurm/slurm.conf, ") in out
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    code, out, _ = check(capsys, task_file(tmp_path, SLURM_TASK))
    assert code == 0 and "sbatch --test-only of t.sbatch: not checked: sbatch is not on PATH here" in out
