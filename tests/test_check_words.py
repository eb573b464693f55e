"""`check` without --provider speaks for no provider in particular (issue 37, item 9): no one
provider's warnings as if they were the user's, the plan's provider-dependent lines said per
group of providers; and every `check` gives the price per hour and the most the run may cost
where they are known."""

from __future__ import annotations

import json

import pytest

from rlhf_tasks.cli import main

from conftest import ROOT

GPU_TASK = {"name": "t", "nodes": 2, "resources": {"gpus": "H100:8"},
            "job": {"recipe": "command", "working_dir": None,  # (".": the tests' directory, over dstack's limit)
                    "args": {"entrypoint": "python3 train.py"}}}


def check(tmp_path, capsys, data, *args):
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps(data))
    code = main(["check", str(path), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_without_a_provider_no_providers_warning_is_given_as_the_users(tmp_path, capsys, rlhf_home):
    code, out, err = check(tmp_path, capsys, GPU_TASK)
    assert code == 0
    assert "warning" not in err and "instance_path" not in out + err, err  # dstack's, said to a Slurm user
    assert "dstack" not in out.splitlines()[1], out  # the cluster line names no provider
    assert "providers dstack, kuberay, runpod, sky, slurm can run it" in out
    said = next(line for line in out.splitlines() if "warning" in line)
    assert "dstack (1)" in said and "slurm (3)" in said and "--provider NAME" in said, out
    code, out, err = check(tmp_path, capsys, GPU_TASK, "--provider", "dstack")
    assert code == 0 and "warning: checkpoints /checkpoints/t is a directory on each dstack host (instance_path)" in err
    assert "on dstack" in out


def test_lines_that_differ_by_provider_are_said_per_group(capsys, rlhf_home):
    """tiny-grpo's checkpoints are under ~/.rlhf-tasks on local, /checkpoints/NAME elsewhere:
    each group of providers gets its own lines, named; nothing is said as if for all."""
    assert main(["check", str(ROOT / "tasks/tiny-grpo.yaml")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert f"  checkpoints on local: {rlhf_home}/runs/tiny-grpo/checkpoints (resume: auto)" in lines, out
    assert "  checkpoints on dstack, kuberay, runpod, sky, slurm: /checkpoints/tiny-grpo (resume: auto)" in lines, out
    assert sum(line.startswith("  entrypoint on ") for line in lines) == 2
    assert sum(line.startswith("  job ") for line in lines) == 1  # the same everywhere: once, for none


def test_the_same_plan_everywhere_is_said_once(tmp_path, capsys, rlhf_home):
    data = {**GPU_TASK, "checkpoints": {"path": "/shared/t"}}
    code, out, _ = check(tmp_path, capsys, data)
    assert code == 0 and out.count("entrypoint") == 1 and "  checkpoints /shared/t (resume: auto)" in out, out


@pytest.mark.parametrize("placement, said", [
    ({"price_per_hour": 24, "max_cost": 100},
     ["$24.00/h for the cluster (placement.price_per_hour)", "at most about $100.80",
      "$100.00 (placement.max_cost, after 4 h 10 m)", "placement.stop_grace 2 m"]),
    ({"price_per_hour": 24, "max_duration": "2h", "stop_grace": "30s"},
     ["$24.00/h", "at most about $48.20", "after 2 h 00 m (placement.max_duration)", "placement.stop_grace 30s"]),
    ({"price_per_hour": 24, "max_duration": "10h", "max_cost": 48},
     ["at most about $48.80", "$48.00 (placement.max_cost, after 2 h 00 m)"]),
    ({"price_per_hour": 24},
     ["$24.00/h", "no cap (placement.max_cost, placement.max_duration): nothing ends the bill but the job's end"]),
    ({"max_duration": "2h"},
     ["price per hour not given (placement.price_per_hour)", "after 2 h 00 m (placement.max_duration)"]),
    ({}, ["price per hour not given (placement.price_per_hour)", "no cap"]),
])
def test_check_says_the_price_and_the_most_the_run_may_cost(placement, said, tmp_path, capsys, rlhf_home):
    for args in ((), ("--provider", "slurm")):
        code, out, _ = check(tmp_path, capsys, {**GPU_TASK, "placement": placement}, *args)
        assert code == 0
        (line,) = [line for line in out.splitlines() if line.startswith("  cost")]
        for words in said:
            assert words in line, line


def test_runpods_price_is_what_it_bills_the_pods(tmp_path, capsys, rlhf_home):
    code, out, _ = check(tmp_path, capsys, {**GPU_TASK, "network": "runpod-global"}, "--provider", "runpod")
    (line,) = [line for line in out.splitlines() if line.startswith("  cost")]
    assert code == 0 and "RunPod's billed pod `cost` once the pods run, its catalog's list price where RunPod " \
        "gives none" in line and "not given" not in line, line


def test_a_local_run_without_a_price_says_nothing_of_cost(capsys, rlhf_home):
    assert main(["check", str(ROOT / "tasks/tiny-grpo.yaml"), "--provider", "local"]) == 0
    assert "  cost" not in capsys.readouterr().out
