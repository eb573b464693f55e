"""What `prepare` makes on the head and every node reads (Search-R1's retriever index): where the
nodes share no storage, every node but the head would find nothing, so `check` and `render`
refuse the task (exit 2, nothing written), naming the provider's option for storage every
node sees (issue 32, item 1)."""

from __future__ import annotations

import copy

import pytest
import yaml

from rlhf_tasks import providers
from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks.spec import parse_task

from conftest import ROOT

SEARCH_R1 = yaml.safe_load((ROOT / "tasks" / "search-r1-ppo-qwen2.5-7b.yaml").read_text())
SHARED = {"dstack": {"host_path": "/mnt/nfs/search-r1"}, "sky": {"volume": "search-r1"}, "runpod": {"network_volume": "vol123"},
          "kuberay": {"claim": "search-r1"}}
OPTION = {"dstack": "checkpoints.shared.dstack: {host_path: /PATH} (a directory every fleet host mounts) or {volume: NAME} with placement.backends: [runpod]",
          "sky": "checkpoints.shared.sky: {bucket: s3://BUCKET/PATH} or {volume: NAME}",
          "runpod": "checkpoints.shared.runpod: {network_volume: ID}",
          "kuberay": "checkpoints.shared.kuberay: {claim: PVC}"}


def task(shared: dict | None = None, **changes) -> dict:
    data = copy.deepcopy(SEARCH_R1)
    data["checkpoints"].pop("shared", None)
    if shared is not None:
        data["checkpoints"]["shared"] = shared
    data.update(changes)
    return data


def plan(provider: str, data: dict):
    return providers.get(provider).plan(parse_task(data, "search-r1.yaml"))


@pytest.mark.parametrize("provider", sorted(OPTION))
def test_without_shared_storage_the_task_is_refused_naming_the_providers_option(provider):
    with pytest.raises(BadInput) as err:
        plan(provider, task())
    said = str(err.value)
    index = "/checkpoints/search-r1-ppo-qwen25-7b/search-r1/index"
    assert said.startswith(f"search-r1.yaml: checkpoints.shared.{provider}: ") and index in said, said
    assert "prepare" in said and "every node" in said and OPTION[provider] in said, said


@pytest.mark.parametrize("provider", sorted(OPTION))
def test_with_shared_storage_or_one_node_it_passes(provider):
    assert plan(provider, task({provider: SHARED[provider]})).nodes == 2
    assert plan(provider, task(nodes=1)).nodes == 1  # the head's own retriever reads what the head made


def test_nodes_that_share_a_filesystem_need_no_option():
    assert plan("slurm", task()).nodes == 2  # Slurm's nodes share the cluster's filesystem (the local ones, one machine)


def test_an_index_elsewhere_is_the_users_to_share():
    data = task()
    data["job"]["args"]["index_dir"] = "/data/search-r1-index"  # e.g. an image's or a mount's
    assert plan("dstack", data).nodes == 2


def test_check_and_render_exit_2_and_write_nothing(tmp_path, capsys, rlhf_home):
    path = tmp_path / "search-r1.yaml"
    path.write_text(yaml.safe_dump(task()))
    assert main(["check", str(path), "--provider", "dstack"]) == 2
    assert "checkpoints.shared.dstack" in capsys.readouterr().err
    assert main(["render", str(path), "--provider", "sky", "-o", str(tmp_path / "out" / "t.sky.yaml")]) == 2
    assert "checkpoints.shared.sky" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_catalogue_task_names_shared_storage_for_the_providers_without_a_shared_filesystem():
    for provider in ("dstack", "sky", "kuberay"):
        assert plan(provider, SEARCH_R1).checkpoint_shared, provider


def test_check_without_a_provider_says_which_refuse_it_and_why(tmp_path, capsys, rlhf_home):
    path = tmp_path / "search-r1.yaml"
    path.write_text(yaml.safe_dump(SEARCH_R1))  # shared storage named for dstack, sky and kuberay only
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "dstack, kuberay, sky, slurm can run it" in out, out
    assert "not runpod:" in out and OPTION["runpod"] in out, out
