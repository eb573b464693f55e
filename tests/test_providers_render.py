"""dstack and SkyPilot: what we render passes the providers' own parsers, for every task
in tasks/, and the golden copies under providers/ (dstack, SkyPilot, Slurm, KubeRay) are
current (KubeRay's schema checks are in test_kuberay_render.py)."""

from __future__ import annotations

import copy
import re
import os
from pathlib import Path

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.spec import load_task

from conftest import ROOT, need

TASKS = sorted((ROOT / "tasks").glob("*.yaml"))
GOLDEN = {"dstack": ROOT / "providers" / "dstack", "sky": ROOT / "providers" / "skypilot",
          "slurm": ROOT / "providers" / "slurm", "kuberay": ROOT / "providers" / "kuberay"}
#: Tasks a provider refuses (KubeRay always starts Ray; torchrun runs without it; SkyPilot renders no node groups,
#: tests/test_groups.py): no golden copy.
REFUSED = {"kuberay": {"openrlhf-dpo-llama3-8b.yaml"}, "sky": {"openrlhf-ppo-groups.yaml"}}
#: Slurm also keeps these tasks rendered with the other ways of running an image.
SLURM_VARIANTS = {"verl-ppo-gsm8k-mi300x.yaml": ("docker", "pyxis"), "openrlhf-dpo-llama3-8b.yaml": ("docker", "podman")}
AGENT_LEFT_OUT = "# (here the script holds a shipped file verbatim: the node agent or a module; left out of this copy)"
REFRESH = "python tests/test_providers_render.py  (or: make golden)"


def tasks_for(provider_name: str) -> list[Path]:
    """The shipped tasks the provider renders."""
    return [path for path in TASKS if path.name not in REFUSED.get(provider_name, ())]


def rendered(provider_name: str, task_path: Path) -> dict[str, str]:
    provider = providers.get(provider_name)
    return provider.render(provider.plan(load_task(task_path)))


def golden_files(provider_name: str, task_path: Path) -> dict[str, str]:
    """What providers/<name>/ keeps for a task: everything but the verbatim sources shipped
    (the node agent, and the demo's code under rlhf-tasks/lib/)."""
    if task_path.name in REFUSED.get(provider_name, ()):
        return {}
    files = {name: text for name, text in rendered(provider_name, task_path).items() if not name.endswith(".py")}
    if provider_name == "kuberay":
        return {name: without_configmap_sources(text) for name, text in files.items()}
    if provider_name != "slurm":
        return files
    from rlhf_tasks.spec import parse_task

    for container in SLURM_VARIANTS.get(task_path.name, ()):
        data = yaml.safe_load(task_path.read_text())
        data.setdefault("placement", {}).setdefault("slurm", {})["container"] = container
        provider = providers.get("slurm")
        for name, text in provider.render(provider.plan(parse_task(data))).items():
            files[name.replace(".sbatch", f".{container}.sbatch")] = text
    return {name: without_agent(text) for name, text in files.items()}


def without_agent(script: str) -> str:
    """A Slurm script with its embedded node agent left out (the golden copies stay readable
    and do not change with every change to the agent)."""
    for delimiter in ("RLHF_TASKS_NODE_PY", "RLHF_TASKS_PREFLIGHT_PY", "RLHF_TASKS_MODULE_PY"):
        script = re.sub(rf"<<'{delimiter}'\n.*?\n{delimiter}\n", f"<<'{delimiter}'\n{AGENT_LEFT_OUT}\n{delimiter}\n",
                        script, flags=re.S)
    return script


def without_configmap_sources(text: str) -> str:
    """A rendered KubeRay file with the ConfigMap's shipped sources (the packed lib/) left out (as for Slurm)."""
    from rlhf_tasks.providers.shipping import dump_yaml

    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    configmap, *rest = yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    configmap["binaryData"] = {key: AGENT_LEFT_OUT for key in configmap["binaryData"]}
    return dump_yaml(configmap, header) + "".join("---\n" + dump_yaml(doc) for doc in rest)


def refresh() -> None:
    for provider_name, directory in GOLDEN.items():
        for task_path in TASKS:
            for name, text in golden_files(provider_name, task_path).items():
                (directory / name).parent.mkdir(parents=True, exist_ok=True)
                (directory / name).write_text(text)


def _dstack_parser():
    try:
        from dstack._internal.core.models.configurations import parse_apply_configuration
    except ImportError:
        need(False, "the dstack package (pip install 'rlhf-tasks[dstack]')")
    return parse_apply_configuration


@pytest.mark.parametrize("task_path", tasks_for("dstack"), ids=lambda p: p.stem)
def test_dstack_parser_accepts_every_task(task_path):
    parse = _dstack_parser()
    files = rendered("dstack", task_path)
    name = load_task(task_path).name
    task_cfg = parse(yaml.safe_load(files[f"{name}.dstack.yml"]))
    fleet_cfg = parse(yaml.safe_load(files[f"{name}-fleet.dstack.yml"]))
    assert task_cfg.type == "task" and fleet_cfg.type == "fleet"
    groups = task_cfg.groups or []  # dstack's own node groups (NodeGroup) where the task has groups
    nodes = task_cfg.nodes if not groups else sum(group.nodes for group in groups)
    assert nodes == fleet_cfg.nodes.max == load_task(task_path).nodes and fleet_cfg.nodes.min == 0
    shipped = {(m.local_path, m.path) for m in task_cfg.files}  # one directory, and the working_dir (from here)
    assert ("rlhf-tasks", "/opt/rlhf-tasks") in shipped and any(name.startswith("rlhf-tasks/") for name in files)
    assert shipped <= {("rlhf-tasks", "/opt/rlhf-tasks"), (".", "/opt/rlhf-tasks-workdir")}
    for commands in [group.commands for group in groups] or [task_cfg.commands]:
        assert "python3 /opt/rlhf-tasks/lib/rlhf_tasks/agent/__main__.py" in commands[-1]


def test_dstack_parser_rejects_what_we_must_not_render():
    from dstack._internal.core.errors import ConfigurationError

    parse = _dstack_parser()
    good = yaml.safe_load(rendered("dstack", TASKS[0])[f"{load_task(TASKS[0]).name}.dstack.yml"])
    with pytest.raises(ConfigurationError):
        parse({**good, "nodez": 2})


def _sky():
    try:
        import sky
        from sky.utils import common_utils, schemas
    except ImportError:
        need(False, "the skypilot package (pip install 'rlhf-tasks[sky]')")
    return sky, common_utils, schemas


@pytest.mark.parametrize("task_path", tasks_for("sky"), ids=lambda p: p.stem)
def test_skypilot_accepts_every_task(task_path, tmp_path, monkeypatch):
    sky, common_utils, schemas = _sky()
    files = rendered("sky", task_path)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    task = load_task(task_path)
    config = yaml.safe_load(files[f"{task.name}.sky.yaml"])
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    monkeypatch.chdir(tmp_path)  # file_mounts are relative to where `sky launch` runs
    sky_task = sky.Task.from_yaml_config(copy.deepcopy(config))  # it consumes the dict
    sky_task.expand_and_validate_file_mounts()
    assert sky_task.num_nodes == task.nodes
    token_env = providers.get("sky").plan(task).token_env  # no Ray (torchrun): no token
    assert set(config.get("secrets", {})) == set(task.secrets) | ({token_env} if token_env else set())
    assert all(v is None for v in config.get("secrets", {}).values())


def test_skypilot_schema_rejects_an_unknown_field():
    sky, common_utils, schemas = _sky()
    from sky import exceptions

    config = yaml.safe_load(rendered("sky", TASKS[0])[f"{load_task(TASKS[0]).name}.sky.yaml"])
    with pytest.raises((ValueError, exceptions.InvalidSkyPilotConfigError)):
        common_utils.validate_schema({**config, "num_nodez": 2}, schemas.get_task_schema(), "Invalid task YAML: ")


@pytest.mark.parametrize("provider_name", ["dstack", "sky"])
def test_our_ray_never_takes_skypilots_ports(provider_name):
    for task_path in tasks_for(provider_name):
        plan = providers.get(provider_name).plan(load_task(task_path))
        ours = {plan.ray.port, plan.ray.dashboard_port, plan.ray.client_server_port}
        if provider_name == "sky":
            ours.add(plan.ray.agent_listen_port)
        assert not ours & {6380, 8266, 52365}, (task_path, ours)


@pytest.mark.parametrize("provider_name", ["dstack", "sky", "slurm"])
def test_rendered_files_hold_no_secret_values(provider_name, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-secret-value")
    for task_path in tasks_for(provider_name):
        for text in rendered(provider_name, task_path).values():
            assert "wandb-secret-value" not in text and "ray-secret-value" not in text


@pytest.mark.parametrize("provider_name", ["dstack", "sky", "slurm", "kuberay"])
def test_golden_files_are_current(provider_name):
    directory = GOLDEN[provider_name]
    expected = {}
    for task_path in TASKS:
        expected.update(golden_files(provider_name, task_path))
    stale = [name for name, text in expected.items()
             if not (directory / name).exists() or (directory / name).read_text() != text]
    kept = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    extra = sorted(kept - set(expected))
    assert not stale and not extra, f"providers/ is stale ({stale + extra}); refresh with: {REFRESH}"


if __name__ == "__main__":
    os.chdir(ROOT)
    refresh()
    print(f"refreshed {', '.join(str(d.relative_to(ROOT)) for d in GOLDEN.values())}")


FULL = {
    "name": "everything", "nodes": 4, "image": "verlai/verl:latest",
    "resources": {"gpus": "H100:8", "cpus": 64, "memory": "512GB", "shm_size": "128GB", "disk": "1TB"},
    "env": {"NCCL_DEBUG": "INFO"}, "secrets": ["WANDB_API_KEY", "HF_TOKEN"], "setup": ["pip install -e ."],
    "ray": {"dashboard_public": True},
    "checkpoints": {"path": "/mnt/ckpt",
                    "shared": {"dstack": {"host_path": "/mnt/nfs/ckpt"}, "sky": {"bucket": "s3://ckpt-bucket/run"}}},
    "placement": {"spot": "auto", "retry": True, "max_duration": "72h", "fleets": ["gpu-fleet"],
                  "backends": ["aws", "gcp"], "regions": ["us-east-1"]},
    "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "python3 train.py"}},
}


def test_every_placement_option_passes_dstack():
    parse = _dstack_parser()
    provider = providers.get("dstack")
    from rlhf_tasks.spec import parse_task

    files = provider.render(provider.plan(parse_task(FULL)))
    cfg = parse(yaml.safe_load(files["everything.dstack.yml"]))
    assert cfg.spot_policy.value == "auto" and cfg.retry and cfg.fleets and cfg.backends and cfg.regions
    assert cfg.volumes[0].instance_path == "/mnt/nfs/ckpt" and cfg.image == "verlai/verl:latest" and cfg.shell == "bash"
    assert cfg.max_duration == 72 * 3600
    parse(yaml.safe_load(files["everything-fleet.dstack.yml"]))


def test_every_placement_option_passes_skypilot(tmp_path, monkeypatch):
    sky, common_utils, schemas = _sky()
    provider = providers.get("sky")
    from rlhf_tasks.spec import parse_task

    files = provider.render(provider.plan(parse_task(FULL)))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    config = yaml.safe_load(files["everything.sky.yaml"])
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    monkeypatch.chdir(tmp_path)
    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    resources = list(task.resources)
    assert task.num_nodes == 4 and all(r.use_spot for r in resources)
    assert config["resources"]["ports"] == [8265] and config["resources"]["image_id"] == "docker:verlai/verl:latest"


# --- shared checkpoints and shared memory ---------------------------------------------------

def shared_task(shared: dict | None = None, nodes: int = 2, **extra) -> dict:
    checkpoints = {"path": "/ckpt/run", **({"shared": shared} if shared is not None else {})}
    return {"name": "shared", "nodes": nodes, "checkpoints": checkpoints,
            "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "python3 train.py"}}, **extra}


def render_task(provider_name: str, data: dict) -> tuple[providers.Provider, object, dict[str, str]]:
    from rlhf_tasks.spec import parse_task

    provider = providers.get(provider_name)
    plan = provider.plan(parse_task(data, "shared.yaml"))
    return provider, plan, provider.render(plan)


@pytest.mark.parametrize("shared,volume,placement", [
    ({"volume": "ckpt-vol"}, {"name": "ckpt-vol", "path": "/ckpt/run"}, {"backends": ["runpod"]}),  # one mounts in many
    ({"host_path": "/mnt/nfs/run"}, {"instance_path": "/mnt/nfs/run", "path": "/ckpt/run"}, {}),
])
def test_dstack_mounts_the_shared_checkpoint_storage(shared, volume, placement):
    parse = _dstack_parser()
    provider, plan, files = render_task("dstack", shared_task({"dstack": shared}, placement=placement))
    config = yaml.safe_load(files["shared.dstack.yml"])
    assert config["volumes"] == [volume]
    parse(config)
    assert provider.shared_storage_warning(plan) is None


@pytest.mark.parametrize("shared,key,value", [
    ({"bucket": "s3://ckpt-bucket/run"}, "file_mounts", {"source": "s3://ckpt-bucket/run", "mode": "MOUNT_CACHED"}),
    ({"bucket": "gs://ckpt-bucket", "mode": "MOUNT"}, "file_mounts", {"source": "gs://ckpt-bucket", "mode": "MOUNT"}),
    ({"volume": "ckpt-vol"}, "volumes", "ckpt-vol"),
])
def test_skypilot_mounts_the_shared_checkpoint_storage(shared, key, value, tmp_path, monkeypatch):
    sky, common_utils, schemas = _sky()
    provider, plan, files = render_task("sky", shared_task({"sky": shared}))
    config = yaml.safe_load(files["shared.sky.yaml"])
    assert config[key]["/ckpt/run"] == value
    assert "mkdir -p /ckpt/run" not in config["setup"]  # the mount point is the storage
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    monkeypatch.chdir(tmp_path)
    sky.Task.from_yaml_config(copy.deepcopy(config))
    assert provider.shared_storage_warning(plan) is None


@pytest.mark.parametrize("provider_name,hint", [
    ("dstack", "add checkpoints.shared.dstack: {host_path: /PATH} (a directory every fleet host mounts) or {volume: NAME} with placement.backends: [runpod]"),
    ("sky", "add checkpoints.shared.sky: {bucket: s3://BUCKET/PATH} or {volume: NAME}"),
])
def test_a_multi_node_resume_from_per_node_directories_is_warned(provider_name, hint):
    provider, plan, files = render_task(provider_name, shared_task())
    warning = provider.shared_storage_warning(plan)
    assert warning.startswith("checkpoints /ckpt/run is a directory on each ") and hint in warning, warning
    other = {"dstack": {"sky": {"volume": "v"}}, "sky": {"dstack": {"volume": "v"}}}[provider_name]
    assert provider.shared_storage_warning(render_task(provider_name, shared_task(other))[1]) == warning
    for quiet in (shared_task(nodes=1), {**shared_task(), "checkpoints": {"path": "/ckpt/run", "resume": "never"}}):
        assert provider.shared_storage_warning(render_task(provider_name, quiet)[1]) is None
    tiny = providers.get(provider_name)  # the demo as it stands: 3 nodes, resume auto, the provider's directory
    assert tiny.shared_storage_warning(tiny.plan(load_task(ROOT / "tasks" / "tiny-grpo.yaml")))


def test_skypilot_gives_shm_size_to_the_container_or_says_why_not(tmp_path, monkeypatch):
    sky, common_utils, schemas = _sky()
    _, _, files = render_task("sky", shared_task(image="verlai/verl:latest", resources={"shm_size": "64GiB"}))
    config = yaml.safe_load(files["shared.sky.yaml"])
    assert config["config"] == {"docker": {"run_options": ["--shm-size=64g"]}}
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    monkeypatch.chdir(tmp_path)
    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    assert all(r.cluster_config_overrides == config["config"] for r in task.resources)

    _, _, files = render_task("sky", shared_task(resources={"shm_size": "64GiB"}))
    text = files["shared.sky.yaml"]
    assert "config" not in yaml.safe_load(text)
    assert "# resources.shm_size 64GiB is not applied: without an image SkyPilot runs on the VM" in text


# --- the demo's code travels with the agent ---------------------------------------------------

def test_the_demo_requirements_are_pyprojects_demo_extra():
    import tomllib

    from rlhf_tasks.recipes.tiny_grpo import LAUNCHER_ONLY, REQUIREMENTS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert REQUIREMENTS + LAUNCHER_ONLY == extras["demo"]


@pytest.mark.parametrize("provider_name", ["dstack", "sky"])
def test_the_demo_ships_its_code_and_imports_only_the_shipped_copy(provider_name, tmp_path):
    import subprocess
    import sys

    files = rendered(provider_name, ROOT / "tasks" / "tiny-grpo.yaml")
    lib = {name for name in files if name.startswith("rlhf-tasks/lib/")}
    assert {"rlhf-tasks/lib/rlhf_tasks/__init__.py", "rlhf-tasks/lib/rlhf_tasks/demo/train.py"} <= lib
    main = yaml.safe_load(files[next(iter(files))])
    if provider_name == "dstack":
        assert main["files"][0] == "rlhf-tasks:/opt/rlhf-tasks"  # the whole directory, lib/ included
        command = main["commands"][-1].splitlines()[-1]  # the one script's last line, after set -e and setup
    else:
        assert main["file_mounts"]["/opt/rlhf-tasks"] == "rlhf-tasks"  # the whole directory, lib/ included
        command = main["run"].splitlines()[-1]  # after the lines that put back what SkyPilot's runner leaks
    assert command.startswith("PYTHONPATH=/opt/rlhf-tasks/lib${PYTHONPATH:+:$PYTHONPATH} "
                              "python3 /opt/rlhf-tasks/lib/rlhf_tasks/agent/__main__.py")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    # From a directory outside the checkout, with only the shipped lib/ on the path: every
    # rlhf_tasks module the demo imports comes from there (this venv's own install is a fallback only).
    probe = ("import sys, rlhf_tasks.demo.prepare, rlhf_tasks.demo.reward_server, rlhf_tasks.demo.train; "
             "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.startswith('rlhf_tasks')))")
    lib_dir = tmp_path / "rlhf-tasks" / "lib"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": str(lib_dir)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.split()
    assert len(loaded) == 5 and all(path.startswith(f"{lib_dir}/") for path in loaded), loaded
