"""The dstack render judged by dstack 0.22.5's own code: GPU names its catalog (gpuhunt's
KNOWN_ACCELERATORS) knows, resources as its ranges, a disk its offers can meet, and a fleet
that frees its instances when the run is over (issue 40, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.spec import load_task, parse_task

from conftest import ROOT, need

TASKS = sorted((ROOT / "tasks").glob("*.yaml"))


def _dstack():
    try:
        import gpuhunt
        from dstack._internal.core.models.configurations import parse_apply_configuration
    except ImportError:
        need(False, "the dstack package (pip install 'rlhf-tasks[dstack]')")
    return parse_apply_configuration, gpuhunt


def render(data: dict) -> tuple[dict, dict]:
    """The task and fleet configurations dstack parses from our render of a task given as data."""
    parse, _ = _dstack()
    provider = providers.get("dstack")
    task = parse_task({"name": "t", "nodes": 2, "job": {"recipe": "command", "args": {"entrypoint": "true"}}, **data})
    files = provider.render(provider.plan(task))
    return (parse(yaml.safe_load(files["t.dstack.yml"])), parse(yaml.safe_load(files["t-fleet.dstack.yml"])))


def known_accelerators() -> dict[str, set[int]]:
    """gpuhunt's known-GPU table, as dstack's catalog reads it: name -> the memory sizes (GiB) it comes in."""
    _, gpuhunt = _dstack()
    table: dict[str, set[int]] = {}
    for accelerator in gpuhunt.KNOWN_ACCELERATORS:
        table.setdefault(accelerator.name.lower(), set()).add(int(accelerator.memory))
    return table


def gpu_forms() -> list[tuple[str, str, int | None]]:
    """Every GPU name a task gives in tasks/, and each GPU of gpuhunt's table written as tasks write
    it (NAME:8, and NAME-<memory>GB:8 as SkyPilot and our shipped tasks spell memory): (spec, name, memory)."""
    _, gpuhunt = _dstack()
    forms = []
    for path in TASKS:
        gpus = load_task(path).resources.gpus
        if gpus and not gpus.isdigit():
            name = gpus.split(":")[0]
            memory = int(name.rsplit("-", 1)[1][:-2]) if name.upper().endswith("GB") and "-" in name else None
            forms.append((gpus, name.rsplit("-", 1)[0] if memory else name, memory))
    for accelerator in gpuhunt.KNOWN_ACCELERATORS:
        forms.append((f"{accelerator.name}:8", accelerator.name, None))
        if accelerator.memory:
            forms.append((f"{accelerator.name}-{accelerator.memory}GB:8", accelerator.name, accelerator.memory))
    return forms


def test_the_shipped_tasks_give_a_gpu_with_memory():
    """The check below covers the memory-suffixed form because a shipped task uses it."""
    assert any(spec.startswith("A100-80GB") for spec, _, _ in gpu_forms())


@pytest.mark.parametrize("spec,name,memory", gpu_forms(), ids=lambda v: str(v))
def test_every_gpu_name_renders_to_one_dstacks_catalog_knows(spec, name, memory):
    table = known_accelerators()
    task, fleet = render({"resources": {"gpus": spec}})
    for config in (task, fleet):
        gpu = config.resources.gpu
        assert gpu.name and len(gpu.name) == 1, gpu
        assert gpu.name[0].lower() in table, f"{spec} renders GPU name {gpu.name[0]!r}, which gpuhunt does not know"
        assert gpu.name[0].lower() == name.lower()
        assert gpu.count.min == gpu.count.max == int(spec.rsplit(":", 1)[1])
        if memory is None:
            assert gpu.memory is None
        else:
            assert gpu.memory.min == gpu.memory.max == memory
            assert memory in table[name.lower()]


@pytest.mark.parametrize("spec,count", [("A100-80GB", 1), ("H100", 1), ("4", 4)])
def test_a_bare_gpu_name_is_exactly_one_gpu(spec, count):
    """The spec reads `gpus: H100` as one GPU; dstack reads a bare `gpu: H100` as one or more."""
    task, fleet = render({"resources": {"gpus": spec}})
    for config in (task, fleet):
        assert config.resources.gpu.count.min == config.resources.gpu.count.max == count


def test_amounts_render_as_at_least_ranges():
    """`cpus: 28` is "at least 28": dstack reads `cpu: 28` as exactly 28, so we render `28..`."""
    task, fleet = render({"resources": {"cpus": 28, "memory": "200GB", "disk": "500GB", "shm_size": "64GB"}})
    resources = task.resources
    assert (resources.cpu.count.min, resources.cpu.count.max) == (28, None)
    assert (resources.memory.min, resources.memory.max) == (200, None)
    assert (resources.disk.size.min, resources.disk.size.max) == (500, None)
    assert resources.shm_size == 64
    assert (fleet.resources.disk.size.min, fleet.resources.disk.size.max) == (500, None)


def test_a_task_without_disk_asks_less_than_dstacks_default():
    """dstack's default disk is `100GB..` (resources.DEFAULT_DISK), compared to an offer's disk (a host's
    free disk on an SSH fleet): with none in the task we ask 50GB or more, in the task and the fleet."""
    from dstack._internal.core.models.resources import DEFAULT_DISK

    task, fleet = render({})
    for config in (task, fleet):
        assert config.resources.disk.size.max is None
        assert config.resources.disk.size.min == 50 < DEFAULT_DISK.size.min


@pytest.mark.parametrize("idle,expected", [(None, 300), ("15m", 900), ("1h", 3600), ("never", -1)])
def test_the_fleet_frees_its_instances_when_the_run_is_over(idle, expected):
    """dstack terminates only idle instances above nodes.min (fleets.py, idle_duration): the fleet
    starts at 0, grows to the task's nodes, and idle_duration comes from placement.idle where the task
    sets it, else 5 minutes (dstack's own default for a run's instances)."""
    placement = {} if idle is None else {"placement": {"idle": idle}}
    task, fleet = render(placement)
    assert fleet.nodes.min == 0
    assert fleet.nodes.max == task.nodes == 2
    assert fleet.idle_duration == expected


@pytest.mark.parametrize("task_path", TASKS, ids=lambda p: p.stem)
def test_every_shipped_fleet_scales_to_zero(task_path: Path):
    parse, _ = _dstack()
    provider = providers.get("dstack")
    plan = provider.plan(load_task(task_path))
    fleet = parse(yaml.safe_load(provider.render(plan)[f"{plan.name}-fleet.dstack.yml"]))
    assert fleet.nodes.min == 0 and fleet.nodes.max == plan.nodes
    assert fleet.idle_duration and fleet.idle_duration > 0
