"""The task spec: good tasks pass, each bad task exits 2 naming its field, writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_tasks.cli import main
from rlhf_tasks.errors import BadInput
from rlhf_tasks.models import parse_duration
from rlhf_tasks.spec import Resources, json_schema, load_task, parse_task

from conftest import ROOT

TASKS = sorted((ROOT / "tasks").glob("*.yaml"))
BAD = sorted((ROOT / "tests" / "bad_tasks").glob("*.yaml"))


def expected_field(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path} must start with '# expect: FIELD'"
    return first.removeprefix("# expect: ")


def provider_of(path: Path) -> str:
    """A bad task that only one provider refuses names it on its second line."""
    second = (path.read_text().splitlines() + [""])[1]
    return second.removeprefix("# provider: ") if second.startswith("# provider: ") else "local"


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.name)
def test_catalogue_tasks_pass_check(path, capsys, rlhf_home):
    assert main(["check", str(path)]) == 0
    assert f"{path}: ok" in capsys.readouterr().out


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_task_exits_2_names_field_and_writes_nothing(path, tmp_path, capsys, rlhf_home):
    out = tmp_path / "out" / "generated.yml"
    assert main(["render", str(path), "--provider", provider_of(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected_field(path) in err, err
    assert str(path) in err or "mapping" in err
    assert not out.exists() and not (tmp_path / "out").exists()
    assert not rlhf_home.exists()


def test_error_lists_every_problem_with_its_path():
    data = {"name": "x", "nodes": 1, "resources": {"gpus": "H100:0"}, "bogus": 1,
            "services": [{"name": "a", "command": "c", "ready": {"tcp": 99999}}],
            "job": {"recipe": "command", "args": {"entrypoint": "true"}}}
    with pytest.raises(BadInput) as info:
        parse_task(data, "t.yaml")
    text = str(info.value)
    for field in ("resources.gpus", "bogus", "services[0].ready.tcp"):
        assert f"  {field}:" in text, text


def test_missing_file_and_bad_yaml_are_bad_input(tmp_path):
    with pytest.raises(BadInput, match="cannot read"):
        load_task(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(BadInput, match="not valid YAML"):
        load_task(broken)


@pytest.mark.parametrize("spec,name,count", [("H100:8", "H100", 8), ("A100-80GB:4", "A100-80GB", 4),
                                              ("L4", "L4", 1), ("2", None, 2)])
def test_gpu_specs(spec, name, count):
    res = Resources(gpus=spec)
    assert (res.gpu_name, res.gpus_per_node) == (name, count)


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("15m", 900), ("2h", 7200), (30, 30), ("1.5m", 90)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_schema_is_exported_and_describes_recipes(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    from rlhf_tasks.providers.dstack.options import DstackPlacement
    from rlhf_tasks.providers.kuberay import KubeRayPlacement
    from rlhf_tasks.providers.slurm.placement import SlurmPlacement

    # the providers' own placement options composed in
    assert schema == json_schema({"slurm": SlurmPlacement, "kuberay": KubeRayPlacement, "dstack": DstackPlacement})
    assert schema["$defs"]["Placement"]["properties"]["kuberay"]["$ref"] == "#/$defs/KubeRayPlacement"
    text = json.dumps(schema)
    assert "tiny-grpo" in text and "additionalProperties" in text
    assert set(schema["required"]) == {"name", "job"}  # and nodes, or groups that give them (test_groups.py)
    assert [branch["required"] for branch in schema["oneOf"]] == [["nodes"], ["groups"]]


def test_unquoted_scalars_where_text_belongs_say_how_to_quote_them():
    data = {"name": "x", "nodes": 1, "env": {"DEBUG": True, "RATIO": 0.5, "EMPTY": None},
            "services": [{"name": "a", "command": "c", "env": {"PORT": 8000}}],
            "job": {"recipe": "command", "args": {"entrypoint": "true"}}}
    with pytest.raises(BadInput) as info:
        parse_task(data, "t.yaml")
    lines = str(info.value).splitlines()[1:]
    assert lines == ['  env.DEBUG: true is a boolean; write it as "true"',
                     '  env.RATIO: 0.5 is a number; write it as "0.5"',
                     '  env.EMPTY: no value; write one in quotes (e.g. "")',
                     '  services[0].env.PORT: 8000 is a number; write it as "8000"'], lines


def test_a_missing_recipe_lists_the_recipes():
    with pytest.raises(BadInput) as info:
        parse_task({"name": "x", "nodes": 1, "job": {"args": {}}}, "t.yaml")
    assert "  job.recipe: missing (choose one of: command, openrlhf-m-grpo, openrlhf-ppo, search-r1, tiny-grpo, " \
           "torchrun, verl-ppo)" in str(info.value)


def test_off_and_on_unquoted_are_the_words_yaml_reads_as_booleans():
    """`spot: off` and `debug: off` as the docs write them: YAML 1.1 reads off/on as false/true, and
    the task means the words."""
    import yaml as _yaml

    from rlhf_tasks.spec import parse_task

    task = parse_task(_yaml.safe_load("""
name: t
nodes: 1
ray: {debug: off}
placement: {spot: on}
job: {recipe: command, args: {entrypoint: "true"}}
"""))
    assert task.ray.debug == "off" and task.placement.spot == "on"
    task = parse_task(_yaml.safe_load("name: t\nnodes: 1\nplacement: {spot: off}\n"
                                      "job: {recipe: command, args: {entrypoint: 'true'}}\n"))
    assert task.placement.spot == "off"
