"""GPUs by memory (issue 47, item 3): `resources.gpus: 80GB:8`, `A100:80GB:8` and `24GB..:1`, as dstack writes
them, read back by each provider's own parser from the render: dstack's GPUSpec (core/models/resources.py),
SkyPilot's Resources.from_yaml_config with its own memory table (tests/sky/metadata.csv, read by its own
LazyDataFrame), RunPod's catalog through the stand-in of its API; Slurm and KubeRay refuse them without the
cluster's own name for the GPU, naming the field that gives it. Fast: no cluster."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.cli import main
from rlhf_tasks.spec import Resources, parse_task

from conftest import ROOT, need

TASK = {"name": "t", "nodes": 2, "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}}


def task_with(gpus: str, **extra) -> dict:
    return {**json.loads(json.dumps(TASK)), "resources": {"gpus": gpus}, **extra}


def render(provider: str, task: dict) -> tuple[object, dict[str, str]]:
    p = providers.get(provider)
    plan = p.plan(parse_task(task, "t.yaml"))
    return plan, p.render(plan)


def check(tmp_path, capsys, task: dict, provider: str) -> tuple[int, str, str]:
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps(task))
    code = main(["check", str(path), "--provider", provider])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- the task file's grammar ---------------------------------------------------------------------


@pytest.mark.parametrize("spec,name,memory,count", [
    ("80GB:8", None, (80 * 10**9, 80 * 10**9), 8),
    ("A100:80GB:8", "A100", (80 * 10**9, 80 * 10**9), 8),
    ("24GB..:1", None, (24 * 10**9, None), 1),
    ("24GB..48GB", None, (24 * 10**9, 48 * 10**9), 1),
    ("..48GB:2", None, (None, 48 * 10**9), 2),
    ("24GiB..:1", None, (24 * 2**30, None), 1),
    ("H100:8", "H100", None, 8), ("A100-80GB:4", "A100-80GB", None, 4), ("8", None, None, 8), ("L4", "L4", None, 1),
])
def test_gpu_specs_by_memory(spec, name, memory, count):
    res = Resources(gpus=spec)
    assert (res.gpu_name, res.gpu_memory, res.gpus_per_node) == (name, memory, count)


@pytest.mark.parametrize("spec,words", [
    ("80:8", "two counts; a GPU's memory needs its unit, as 80GB:8"),
    ("80G:8", 'the GPU memory "80G" is not a size: write 80GB (10^9 bytes each) or 80GiB'),
    ("1..8", "a range of counts: Ray and the recipe need the GPUs per node exactly"),
    ("48GB..24GB:1", "the GPU memory '48GB..24GB' is no range"),
    ("80GB:80GB:8", "the memory given twice"),
    ("H100:0", "'0' is not a count >= 1"),
])
def test_bad_gpu_specs_exit_2_naming_the_field(tmp_path, capsys, spec, words):
    code, _, err = check(tmp_path, capsys, task_with(spec), "dstack")
    assert code == 2
    assert "resources.gpus" in err and words in err, err


# --- dstack: as it takes them ------------------------------------------------------------------------


@pytest.mark.parametrize("spec,rendered", [
    ("80GB:8", "80GB:8"), ("A100:80GB:8", "A100:80GB:8"), ("24GB..:1", "24GB..:1"), ("..48GB:2", "..48GB:2"),
    ("A100-80G:8", "A100:80GB:8"), ("H100:8", "H100:8"), ("24GiB..:1", "25.769803776GB..:1"),
])
def test_dstack_reads_the_render_as_the_task_says(spec, rendered):
    """dstack's own GPUSpec parses the rendered `gpu` to the task's name, memory (its figure in GB, gpuhunt's)
    and count: the same as it parses the task's words where dstack writes them so."""
    from dstack._internal.core.models.resources import GPUSpec

    _, files = render("dstack", task_with(spec))
    text = yaml.safe_load(files["t.dstack.yml"])["resources"]["gpu"]
    assert text == rendered
    parsed = GPUSpec.model_validate(text)
    res = Resources(gpus=spec)
    low, high = res.gpu_memory or (None, None)
    if res.gpu_memory:
        assert (parsed.memory.min, parsed.memory.max) == tuple(b / 10**9 if b else None for b in (low, high))
    assert parsed.count.min == parsed.count.max == res.gpus_per_node
    if spec in ("80GB:8", "A100:80GB:8", "24GB..:1"):  # dstack's own words, as verl's example writes them
        assert parsed == GPUSpec.model_validate(spec)


def test_dstack_check_names_the_gpus_of_that_memory_or_refuses(tmp_path, capsys):
    code, out, err = check(tmp_path, capsys, task_with("80GB:8"), "dstack")
    assert code == 0, err
    assert "resources.gpus 80GB:8: dstack takes any GPU of gpuhunt's table with that memory: A100, H100" in out
    code, _, err = check(tmp_path, capsys, task_with("1000GB:8"), "dstack")
    assert code == 2 and "resources.gpus: 1000GB:8: gpuhunt's GPU table has no GPU of 1000GB" in err, err
    code, _, err = check(tmp_path, capsys, task_with("H100:48GB:8"), "dstack")
    assert code == 2 and "gpuhunt's GPU table has H100 with 80GB only" in err, err


# --- SkyPilot: its own memory form, resolved by its own table -----------------------------------------


@pytest.fixture
def sky_catalog(tmp_path, monkeypatch):
    """SkyPilot's catalog files where it keeps them (SKY_RUNTIME_DIR), and its memory table handed to its own
    reader (accelerator_registry._memory_df, a LazyDataFrame that would fetch the file where it is missing)."""
    try:
        from sky.catalog import common as catalog_common
        from sky.utils import accelerator_registry
    except ImportError:
        need(False, "the skypilot package (pip install 'rlhf-tasks[sky]')")
    common = tmp_path / "sky-runtime" / ".sky/catalogs/v8/common"
    common.mkdir(parents=True)
    for name in ("accelerators.csv", "metadata.csv"):
        shutil.copy(ROOT / "tests/sky" / name, common / name)
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path / "sky-runtime"))
    monkeypatch.setattr(accelerator_registry, "_memory_df",
                        catalog_common.LazyDataFrame(str(common / "metadata.csv"), lambda: False))
    return common


def sky_names(accelerators) -> set[str]:
    """The accelerators SkyPilot's own Resources.from_yaml_config makes of a rendered `accelerators`."""
    from sky.resources import Resources as SkyResources

    return {f"{name}:{int(count)}" for r in SkyResources.from_yaml_config({"accelerators": accelerators})
            for name, count in r.accelerators.items()}


@pytest.mark.parametrize("spec,rendered", [
    ("80GB:8", "80GB:8"), ("24GB..:1", "24GB+:1"), ("A100:80GB:8", "A100-80GB:8"), ("24GiB..:1", "26GB+:1"),
    ("A100-80G:8", "A100-80GB:8"),
])
def test_sky_reads_the_render_and_check_says_which_it_takes(tmp_path, capsys, sky_catalog, spec, rendered):
    _, files = render("sky", task_with(spec))
    accelerators = yaml.safe_load(files["t.sky.yaml"])["resources"]["accelerators"]
    assert accelerators == rendered
    taken = sky_names(accelerators)
    code, out, err = check(tmp_path, capsys, task_with(spec), "sky")
    assert code == 0, err
    count = Resources(gpus=spec).gpus_per_node
    if Resources(gpus=spec).gpu_name:
        assert taken == {rendered}
        assert f"resources.gpus {rendered.partition(':')[0]} is in SkyPilot's accelerator catalog" in out
    else:
        assert len(taken) > 1 and all(t.endswith(f":{count}") for t in taken)
        said = out.split(f"resources.gpus {spec}: SkyPilot takes any of ")[1].split(" (its")[0].split(", ")
        assert {f"{name}:{count}" for name in said} == taken, out
    if spec == "80GB:8":
        assert {"A100-80GB:8", "H100:8"} <= taken and "A100:8" not in taken


def test_sky_refuses_a_memory_it_has_no_words_or_no_gpu_for(tmp_path, capsys, sky_catalog):
    code, _, err = check(tmp_path, capsys, task_with("24GB..48GB:1"), "sky")
    assert code == 2 and "resources.gpus: 24GB..48GB:1: SkyPilot takes a GPU memory exactly (80GB:8) or at " \
                         "least (24GB..:1 -> 24GB+:1), not at most" in err, err
    code, _, err = check(tmp_path, capsys, task_with("1000GB:8"), "sky")
    assert code == 2 and "resources.gpus: 1000GB:8: no GPU of SkyPilot's catalog (common/metadata.csv) has " \
                         "1000GB of memory" in err, err
    code, _, err = check(tmp_path, capsys, task_with("H100:80GB:8"), "sky")  # the catalog's H100 has no suffix
    assert code == 2 and "has H100 but no H100-80GB, the name it gives a GPU's memory variant (A100-80GB) (its " \
                         "common/metadata.csv gives H100 80GB): write H100:8, or the memory alone (80GB:8)" in err, err


def test_sky_without_its_memory_table_says_what_it_did_not_check(tmp_path, capsys, monkeypatch):
    try:
        import sky  # noqa: F401
    except ImportError:
        need(False, "the skypilot package (pip install 'rlhf-tasks[sky]')")
    monkeypatch.setenv("SKY_RUNTIME_DIR", str(tmp_path / "sky-runtime"))
    code, out, err = check(tmp_path, capsys, task_with("80GB:8"), "sky")
    assert code == 0, err
    assert "resources.gpus 80GB:8: not checked against SkyPilot's catalog: its common/metadata.csv" in out
    assert not (tmp_path / "sky-runtime" / ".sky" / "catalogs").exists()  # nothing fetched


# --- Slurm, KubeRay, local: the cluster's own names --------------------------------------------------


def test_slurm_needs_the_clusters_gpu_type_for_a_gpu_by_memory(tmp_path, capsys):
    code, _, err = check(tmp_path, capsys, task_with("80GB:8"), "slurm")
    assert code == 2
    assert "resources.gpus: 80GB:8: Slurm asks for GPUs by the type names each cluster gives them" in err
    assert "give placement.slurm.gpu_type" in err
    plan, files = render("slurm", task_with("80GB:8", placement={"slurm": {"gpu_type": "a100_80g"}}))
    assert "--gpus-per-node=a100_80g:8" in files["t.sbatch"]


def test_kuberay_needs_a_node_label_for_a_gpu_by_memory(tmp_path, capsys):
    code, _, err = check(tmp_path, capsys, task_with("80GB:8"), "kuberay")
    assert code == 2
    assert "resources.gpus: 80GB:8: a pod requests GPUs by count only" in err
    assert "placement.kuberay.node_selector" in err and "nvidia.com/gpu.memory" in err
    code, _, err = check(tmp_path, capsys, task_with(
        "80GB:8", placement={"kuberay": {"node_selector": {"nvidia.com/gpu.memory": "81920"}}}), "kuberay")
    assert code == 0, err


def test_local_runs_cpu_only_nodes(tmp_path, capsys):
    code, _, err = check(tmp_path, capsys, task_with("80GB:1", nodes=1), "local")
    assert code == 2 and "resources.gpus: the local provider runs CPU-only nodes" in err


# --- RunPod: the catalog's GPU types of that memory ----------------------------------------------------


@pytest.fixture
def runpod(tmp_path):
    from runpod_standin import ProcessRunner, RunPodStandIn

    from rlhf_tasks.providers.runpod.api import RunPodClient

    runner = ProcessRunner(tmp_path / "pods", entrypoint=("bash", "-c", "exec sleep 600", "container"))
    api = RunPodStandIn(runner, api_key="rpa_GPUMEMORY_0123").start()
    yield RunPodClient("rpa_GPUMEMORY_0123", base_url=api.url)
    api.close()
    runner.close()
    assert api.errors == []


def test_runpod_picks_the_cheapest_gpu_type_of_that_memory(runpod, capsys):
    from runpod_standin import A40, H100

    from rlhf_tasks.errors import BadInput
    from rlhf_tasks.providers.runpod import catalog

    plan, files = render("runpod", task_with("80GB:8"))
    assert "names no GPU type, and a pod has one" in json.loads(files["t.runpod.json"])["note"]
    fit = catalog.fit(runpod, plan)
    assert (fit["gpu"], fit["count"], fit["matched"]) == (H100, 8, [H100])
    # at least 48GB: A40 (48GB, $0.40), MI300X ($2.49), H100 ($2.69); Global Networking takes NVIDIA only
    plan, _ = render("runpod", task_with("48GB..:1"))
    fit = catalog.fit(runpod, plan)
    assert fit["gpu"] == A40 and set(fit["matched"]) == {A40, H100, "AMD Instinct MI300X OAM"}
    catalog.announce(plan, fit, None)
    assert f"chosen: {A40}, the cheapest that fits" in capsys.readouterr().out
    requests = json.loads(providers.get("runpod").render(plan)["t.runpod.json"])  # before the choice: words
    assert requests["head"]["gpu"]["id"] == "a GPU type of 48GB.."
    from rlhf_tasks.providers.runpod.render import render as render_files

    chosen = json.loads(render_files(plan, None, fit["gpu"])["t.runpod.json"])
    assert chosen["head"]["gpu"] == {"id": A40, "count": 1} and "names no GPU type" not in chosen["note"]
    plan, _ = render("runpod", task_with("1000GB:1"))
    with pytest.raises(BadInput, match=r"resources\.gpus: 1000GB:1: RunPod's catalog has no GPU type of that memory "
                                       r"\(its GPU types have 48GB, 80GB, 192GB\)"):
        catalog.fit(runpod, plan)
    for spec in ("A100:80GB:8", "A100-80G:8", "A100-80GB:8"):  # issue 48's suffix forms name the same type
        plan, files = render("runpod", task_with(spec))
        assert json.loads(files["t.runpod.json"])["head"]["gpu"] == {"id": "NVIDIA A100-SXM4-80GB", "count": 8}
    plan, _ = render("runpod", task_with("H100:48GB:1"))
    with pytest.raises(BadInput, match=r"NVIDIA H100 80GB HBM3 has 80GB"):
        catalog.fit(runpod, plan)
