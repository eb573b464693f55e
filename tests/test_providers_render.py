"""dstack and SkyPilot: what we render passes the providers' own parsers, for every task
in tasks/, and the golden copies under providers/ are current."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.spec import load_task

from conftest import ROOT, need

TASKS = sorted((ROOT / "tasks").glob("*.yaml"))
GOLDEN = {"dstack": ROOT / "providers" / "dstack", "sky": ROOT / "providers" / "skypilot"}
REFRESH = "python tests/test_providers_render.py  (or: make golden)"


def rendered(provider_name: str, task_path: Path) -> dict[str, str]:
    provider = providers.get(provider_name)
    return provider.render(provider.plan(load_task(task_path)))


def golden_files(provider_name: str, task_path: Path) -> dict[str, str]:
    """What providers/<name>/ keeps for a task: everything but the verbatim node agent and its preflight."""
    return {name: text for name, text in rendered(provider_name, task_path).items()
            if not name.endswith(("node.py", "preflight.py"))}


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


@pytest.mark.parametrize("task_path", TASKS, ids=lambda p: p.stem)
def test_dstack_parser_accepts_every_task(task_path):
    parse = _dstack_parser()
    files = rendered("dstack", task_path)
    name = load_task(task_path).name
    task_cfg = parse(yaml.safe_load(files[f"{name}.dstack.yml"]))
    fleet_cfg = parse(yaml.safe_load(files[f"{name}-fleet.dstack.yml"]))
    assert task_cfg.type == "task" and fleet_cfg.type == "fleet"
    assert task_cfg.nodes == fleet_cfg.nodes.min == load_task(task_path).nodes
    assert {m.local_path for m in task_cfg.files} <= set(files)
    assert "python3 /opt/rlhf-tasks/node.py" in task_cfg.commands[-1]


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


@pytest.mark.parametrize("task_path", TASKS, ids=lambda p: p.stem)
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
    assert set(config.get("secrets", {})) == set(task.secrets) | ({"RAY_AUTH_TOKEN"} if task.ray.auth == "token" else set())
    assert all(v is None for v in config.get("secrets", {}).values())


def test_skypilot_schema_rejects_an_unknown_field():
    sky, common_utils, schemas = _sky()
    from sky import exceptions

    config = yaml.safe_load(rendered("sky", TASKS[0])[f"{load_task(TASKS[0]).name}.sky.yaml"])
    with pytest.raises((ValueError, exceptions.InvalidSkyPilotConfigError)):
        common_utils.validate_schema({**config, "num_nodez": 2}, schemas.get_task_schema(), "Invalid task YAML: ")


@pytest.mark.parametrize("provider_name", ["dstack", "sky"])
def test_our_ray_never_takes_skypilots_ports(provider_name):
    for task_path in TASKS:
        plan = providers.get(provider_name).plan(load_task(task_path))
        ours = {plan.ray.port, plan.ray.dashboard_port, plan.ray.client_server_port}
        if provider_name == "sky":
            ours.add(plan.ray.agent_listen_port)
        assert not ours & {6380, 8266, 52365}, (task_path, ours)


@pytest.mark.parametrize("provider_name", ["dstack", "sky"])
def test_rendered_files_hold_no_secret_values(provider_name, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-secret-value")
    for task_path in TASKS:
        for text in rendered(provider_name, task_path).values():
            assert "wandb-secret-value" not in text and "ray-secret-value" not in text


@pytest.mark.parametrize("provider_name", ["dstack", "sky"])
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
    "ray": {"dashboard_public": True}, "checkpoints": {"path": "/mnt/ckpt", "volume": "ckpt-vol"},
    "placement": {"spot": "auto", "retry": True, "max_duration": "72h", "fleets": ["gpu-fleet"],
                  "backends": ["aws", "gcp"], "regions": ["us-east-1"]},
    "job": {"recipe": "command", "args": {"entrypoint": "python3 train.py"}},
}


def test_every_placement_option_passes_dstack():
    parse = _dstack_parser()
    provider = providers.get("dstack")
    from rlhf_tasks.spec import parse_task

    files = provider.render(provider.plan(parse_task(FULL)))
    cfg = parse(yaml.safe_load(files["everything.dstack.yml"]))
    assert cfg.spot_policy.value == "auto" and cfg.retry and cfg.fleets and cfg.backends and cfg.regions
    assert cfg.volumes[0].name == "ckpt-vol" and cfg.image == "verlai/verl:latest" and cfg.shell == "bash"
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
