"""Shared storage each backend can really share (issue 48, item 3): `checkpoints.shared.dstack: {volume: ckpt}`
rendered one network volume that every node mounts, and dstack attaches an aws or gcp volume to one instance only:
the second node's attach failed after the first instance was billed (VOLUME_ERROR, then the retry loop). Each
provider's `check` now follows its rules (Provider.sharing), refusing with the reason and the alternatives what
no backend the run may land on shares, and docs/providers.md's table is those rules."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import textwrap

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.cli import main
from rlhf_tasks.providers.dstack.options import SHARING as DSTACK_SHARING, volume_backends

from conftest import ROOT

TASK = {"name": "shared", "nodes": 2, "resources": {"gpus": "H100:8"},
        "checkpoints": {"path": "/ckpt/run", "shared": {"dstack": {"volume": "ckpt"}}},
        "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "python3 train.py"}}}


def task(shared: dict | None = None, nodes: int = 2, **placement) -> dict:
    data = copy.deepcopy(TASK)
    data["nodes"] = nodes
    if shared is not None:
        data["checkpoints"]["shared"] = shared
    if placement:
        data["placement"] = placement
    return data


def check(tmp_path, capsys, data: dict, provider: str) -> tuple[int, str, str]:
    path = tmp_path / "shared.yaml"
    path.write_text(json.dumps(data))
    code = main(["check", str(path), "--provider", provider])
    out = capsys.readouterr()
    return code, out.out, out.err


def render(tmp_path, capsys, data: dict, provider: str, name: str) -> dict:
    path = tmp_path / "shared.yaml"
    path.write_text(json.dumps(data))
    assert main(["render", str(path), "--provider", provider, "-o", str(tmp_path / "out" / name)]) == 0, \
        capsys.readouterr().err
    capsys.readouterr()
    return yaml.safe_load((tmp_path / "out" / name).read_text())


# ------------------------------------------------------------------ dstack

@pytest.mark.parametrize("placement, lands", [
    ({}, "placement.backends is empty, so the run may land on any backend"),
    ({"backends": ["aws"]}, "placement.backends lists aws"),
    ({"backends": ["runpod", "gcp"]}, "placement.backends lists gcp"),
    ({"fleets": ["h100-cluster"]}, "placement.backends is empty"),  # a fleet of the user's: any backend
])
def test_one_dstack_volume_for_several_nodes_is_refused_where_the_run_may_land_on_a_single_attach_disk(
        placement, lands, tmp_path, capsys, rlhf_home):
    code, out, err = check(tmp_path, capsys, task(**placement), "dstack")
    assert code == 2, out + err
    assert "checkpoints.shared.dstack.volume: ckpt: one dstack network volume for 2 nodes" in err, err
    assert lands in err, err
    for why in ("attaches to one instance", "after its instance is billed", "VOLUME_ERROR"):
        assert why in err, err
    for instead in ("placement.backends: [runpod]", "checkpoints.shared.dstack: {host_path: /PATH}",
                    "checkpoints.shared.sky: {bucket: ...}", "${{ dstack.node_rank }}"):
        assert instead in err, err
    assert main(["render", str(tmp_path / "shared.yaml"), "--provider", "dstack", "-o",
                 str(tmp_path / "out" / "s.dstack.yml")]) == 2
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_per_node_volume_and_a_volume_on_an_ssh_fleet_are_no_shared_storage(tmp_path, capsys, rlhf_home):
    code, _, err = check(tmp_path, capsys, task({"dstack": {"volume": "ckpt-${{ dstack.node_rank }}"}},
                                                backends=["runpod"]), "dstack")
    assert code == 2 and "names one volume per node" in err and "not shared storage" in err, err
    ssh = {"dstack": {"ssh": {"hosts": ["10.0.0.1", "10.0.0.2"], "user": "ubuntu", "identity_file": "~/.ssh/id"}}}
    code, _, err = check(tmp_path, capsys, task(nodes=1, **ssh), "dstack")
    assert code == 2 and "an SSH fleet (placement.dstack.ssh) has no dstack network volumes" in err, err
    assert "{host_path: /PATH}" in err


def test_a_dstack_volume_on_runpod_or_for_one_node_renders_and_dstacks_parser_takes_it(tmp_path, capsys, rlhf_home):
    from dstack._internal.core.models.configurations import parse_apply_configuration

    for data in (task(backends=["runpod"]), task(nodes=1)):
        code, _, err = check(tmp_path, capsys, data, "dstack")
        assert code == 0 and "checkpoints.shared.dstack" not in err, err
        config = render(tmp_path, capsys, data, "dstack", "s.dstack.yml")
        parsed = parse_apply_configuration(config)
        assert [(v.name, v.path) for v in parsed.volumes] == [("ckpt", "/ckpt/run")]


def test_a_dstack_volume_on_kubernetes_is_allowed_with_what_check_cannot_see(tmp_path, capsys, rlhf_home):
    code, _, err = check(tmp_path, capsys, task(backends=["kubernetes", "runpod"]), "dstack")
    assert code == 0, err
    assert "warning: checkpoints.shared.dstack.volume ckpt on kubernetes: every node mounts it only if its " \
           "PersistentVolumeClaim is ReadWriteMany" in err and "`check` cannot see it" in err, err


@pytest.mark.cluster  # dstack's server code: the dstack[server] virtualenv the dstack tests install
def test_the_per_node_form_named_as_the_alternative_is_dstacks_own_and_interpolated_per_job():
    """What the refusal names, `NAME-${{ dstack.node_rank }}`, is a volume name dstack's parser takes and its
    server makes one name per job of (interpolate_job_volumes): each node its own volume, none shared. The
    server's code runs in the dstack[server] virtualenv the dstack tests install (tests/dstack/server.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dstack_bed_server", ROOT / "tests" / "dstack" / "server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ensure_dstack = module.ensure_dstack

    script = textwrap.dedent("""
        import json
        from dstack._internal.core.models.configurations import parse_apply_configuration
        from dstack._internal.server.services.jobs.configurators.base import interpolate_job_volumes
        config = {"type": "task", "nodes": 2, "commands": ["true"],
                  "volumes": [{"name": "ckpt-${{ dstack.node_rank }}", "path": "/ckpt"}]}
        parsed = parse_apply_configuration(config)
        print(json.dumps([interpolate_job_volumes(parsed.volumes, job)[0].name for job in (0, 1)]))
    """)
    out = subprocess.run([str(ensure_dstack() / "python"), "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["ckpt-0"], ["ckpt-1"]]


def test_the_dstack_rules_name_the_backends_dstack_gives_volumes_and_multi_node_runs():
    """The rows are dstack's own: each backend whose compute class has both volume and multi-node support
    (read in its source: some need cloud SDKs not installed here) has its row, and one volume mounts in every
    node only on runpod and kubernetes."""
    import importlib.util
    from pathlib import Path

    backends = Path(importlib.util.find_spec("dstack").submodule_search_locations[0]) / "_internal/core/backends"
    both = set()
    for compute in backends.glob("*/compute.py"):
        head = re.search(r"^class \w+Compute\((.*?)\):", compute.read_text(), re.S | re.M)
        if head and "ComputeWithVolumeSupport" in head.group(1) and "ComputeWithMultinodeSupport" in head.group(1):
            both.add(compute.parent.name)
    assert both == {"aws", "gcp", "kubernetes", "runpod"}, both
    assert both <= {rule.backend for rule in DSTACK_SHARING if rule.form == "volume"}
    assert volume_backends() == ["runpod", "kubernetes"]


# ------------------------------------------------------------------ SkyPilot

def test_a_skypilot_volume_with_clouds_it_cannot_be_on_is_refused(tmp_path, capsys, rlhf_home):
    data = task({"sky": {"volume": "ckpt"}}, backends=["aws", "kubernetes"])
    code, _, err = check(tmp_path, capsys, data, "sky")
    assert code == 2 and "checkpoints.shared.sky.volume: ckpt: SkyPilot volumes are on kubernetes or runpod" in err
    assert "placement.backends lists aws" in err and "{bucket: s3://BUCKET/PATH}" in err, err


def test_a_skypilot_volume_on_kubernetes_and_a_bucket_anywhere_render_and_skypilot_takes_them(
        tmp_path, capsys, rlhf_home, monkeypatch):
    import sky

    for shared, backends, warned in (({"volume": "ckpt"}, ["kubernetes"], True),
                                     ({"bucket": "s3://b/run"}, ["aws", "gcp"], False)):
        data = task({"sky": shared}, backends=backends)
        code, _, err = check(tmp_path, capsys, data, "sky")
        assert code == 0, err
        assert ("ReadWriteMany k8s-pvc" in err and "`check` cannot see its type" in err) == warned, err
        config = render(tmp_path, capsys, data, "sky", "s.sky.yaml")
        monkeypatch.chdir(tmp_path / "out")
        parsed = sky.Task.from_yaml_config(copy.deepcopy(config))
        assert parsed.num_nodes == 2
        assert (parsed.volumes if "volume" in shared else parsed.storage_mounts), config


# ------------------------------------------------------------------ KubeRay

def test_kuberay_says_check_cannot_see_the_claims_access_mode(tmp_path, capsys, rlhf_home):
    code, _, err = check(tmp_path, capsys, task({"kuberay": {"claim": "ckpt"}}), "kuberay")
    assert code == 0
    assert "checkpoints.shared.kuberay.claim ckpt: the 2 pods share it only if it is ReadWriteMany" in err, err
    assert "`launch` reads the claim's access modes" in err
    _, _, err = check(tmp_path, capsys, task({"kuberay": {"claim": "ckpt"}}, nodes=1), "kuberay")
    assert "ReadWriteMany" not in err


# ------------------------------------------------------------------ the rule table in docs

def table(page: str, heading: str) -> list[str]:
    """The rows (header and rule left out) of the first table under `### heading` of a docs page."""
    lines = (ROOT / "docs" / page).read_text().split(f"\n### {heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start + 2:end]


def test_the_rule_table_in_docs_is_the_rules_the_providers_check_by():
    rows = providers.sharing_rows()
    assert table("providers.md", "Which storage every node shares") == rows
    assert {row.split("`")[1] for row in rows} == {"local", "dstack", "sky", "runpod", "slurm", "kuberay"}
    for page, name in (("dstack.md", "dstack"), ("skypilot.md", "sky"), ("kuberay.md", "kuberay"),
                       ("runpod.md", "runpod")):
        assert table(page, "Which storage every node shares") == [r for r in rows if r.startswith(f"| `{name}` ")]


def test_every_shipped_tasks_shared_storage_passes_its_providers_check(capsys, rlhf_home):
    """search-r1's `dstack: {volume: search-r1}` for 2 nodes on any backend is now refused: it names a directory
    every fleet host mounts instead."""
    for path in sorted((ROOT / "tasks").glob("*.yaml")):
        for provider in (yaml.safe_load(path.read_text()).get("checkpoints") or {}).get("shared", {}):
            assert main(["check", str(path), "--provider", provider]) == 0, (path.name, capsys.readouterr().err)
