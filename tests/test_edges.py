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
