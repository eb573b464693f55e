"""Messages that must be true (issue 20, items 9-17): what the CLI says of itself, of a task
file's mistakes, of a cluster and of the files it writes is what is so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from rlhf_tasks import state
from rlhf_tasks.cli import main

from conftest import ROOT

TINY = str(ROOT / "tasks" / "tiny-grpo.yaml")


# ---------------------------------------------------------------- status NAME of a cluster (issue 32, item 6)

def test_status_of_a_clusters_name_shows_the_cluster(rlhf_home, capsys):
    """`status tiny-grpo` of a local cluster: its node agents, Ray's nodes, its job (exit 0),
    not "not a job" (issue 20 item 11 said what to ask instead; issue 32 item 6: show it)."""
    import subprocess as sp

    sleeper = sp.Popen(["sleep", "60"])
    try:
        state.save("tiny-grpo", {"provider": "local", "cluster_id": "c1", "dashboard": "http://127.0.0.1:9",
                                 "pids": [sleeper.pid, 2**22 + 1],
                                 "job": {"submission_id": "tiny-grpo-c1", "status": "RUNNING"}})
        assert main(["status", "tiny-grpo"]) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    out = capsys.readouterr().out
    assert out.startswith(f"tiny-grpo: a local cluster; node agents: 1 of 2 running on this machine (PIDs "
                          f"{sleeper.pid})\n"), out
    assert "Ray: its dashboard http://127.0.0.1:9 does not answer here" in out
    assert "job tiny-grpo-c1: RUNNING (last seen)" in out and "rlhf-tasks down tiny-grpo" in out
    assert "not a job" not in out


def test_status_of_a_clusters_name_asks_ray_where_its_dashboard_answers(rlhf_home, capsys):
    from test_messages import FakeDashboard

    dashboard = FakeDashboard()
    dashboard.jobs["tiny-grpo-c1"] = "SUCCEEDED"
    try:
        state.save("tiny-grpo", {"provider": "dstack", "cluster_id": "c1", "dashboard": dashboard.url})
        assert main(["status", "tiny-grpo"]) == 0
    finally:
        dashboard.close()
    out = capsys.readouterr().out
    assert "tiny-grpo: a cluster launched from here, on dstack" in out
    assert f"Ray: 1 node(s) alive (dashboard {dashboard.url})" in out and "job tiny-grpo-c1: SUCCEEDED" in out


def test_status_of_an_ended_clusters_name_says_how_it_ended(rlhf_home, capsys):
    state.save("tiny-grpo", {"provider": "local", "cluster_id": "c1", "dashboard": "http://127.0.0.1:9",
                             "job": {"submission_id": "tiny-grpo-c1", "status": "SUCCEEDED"},
                             "ended": "2026-11-24 12:00:00"})
    assert main(["status", "tiny-grpo"]) == 0
    out = capsys.readouterr().out
    assert "tiny-grpo: a cluster launched from here, on local; the cluster ended at 2026-11-24 12:00:00; its " \
           "job tiny-grpo-c1 ended SUCCEEDED" in out, out


# ---------------------------------------------------------------- render -o (item 12)

def test_render_into_an_existing_directory_writes_each_file_under_its_name(tmp_path, capsys, rlhf_home):
    out = tmp_path / "rendered"
    out.mkdir()
    assert main(["render", TINY, "--provider", "dstack", "-o", str(out)]) == 0
    assert {"tiny-grpo.dstack.yml", "tiny-grpo-fleet.dstack.yml"} <= {p.name for p in out.iterdir()}
    assert "type: task" in (out / "tiny-grpo.dstack.yml").read_text()
    assert f"wrote {out / 'tiny-grpo.dstack.yml'}" in capsys.readouterr().err


@pytest.mark.parametrize("provider, old, says", [
    ("sky", "tiny-grpo.sky.yaml", "sky launch -c tiny-grpo x.out"),
    ("slurm", "tiny-grpo.sbatch", "sbatch x.out"),
    ("runpod", "tiny-grpo.runpod.json", "see the args of\n# x.out"),
    ("local", "start-nodes.sh", "Usage: x.out [RANK ...]"),
])
def test_render_under_another_name_names_the_files_written(provider, old, says, tmp_path, capsys, rlhf_home):
    main_file = tmp_path / "x.out"
    assert main(["render", TINY, "--provider", provider, "-o", str(main_file)]) == 0
    written = [main_file, *(p for p in tmp_path.iterdir() if p != main_file and p.is_file())]
    texts = "".join(p.read_text() for p in written)
    assert says in texts
    assert old not in texts


# ---------------------------------------------------------------- a pipe's reader that leaves (item 13)

@pytest.mark.parametrize("argv", [["schema"], ["check", TINY], ["recipes"]])
def test_a_closed_pipe_on_stdout_ends_quietly(argv, tmp_path):
    """`rlhf-tasks schema | head`: the reader leaves; no traceback, exit 0."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as after `head` has left
    try:
        proc = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60,
                              env=dict(os.environ, RLHF_TASKS_HOME=str(tmp_path)))
    finally:
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


# ---------------------------------------------------------------- check --provider slurm (item 16)

def test_check_for_slurm_warns_about_the_default_checkpoint_path(tmp_path, capsys, rlhf_home):
    assert main(["check", TINY, "--provider", "slurm"]) == 0
    err = capsys.readouterr().err
    assert "warning: checkpoints /checkpoints/tiny-grpo is the default path" in err, err
    assert "set checkpoints.path" in err
    task = tmp_path / "t.yaml"
    task.write_text(json.dumps({"name": "t", "nodes": 2, "checkpoints": {"path": "/shared/ckpt/t"},
                                "placement": {"max_duration": "2h"},  # (no --time is a warning of its own)
                                "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}}))
    assert main(["check", str(task), "--provider", "slurm"]) == 0
    assert "warning" not in capsys.readouterr().err  # a path of the user's own: nothing to say


@pytest.mark.parametrize("path", ["/checkpoints/t", "/checkpoints/other"])
def test_slurms_checkpoint_warning_calls_a_path_the_task_gave_the_tasks(path, tmp_path, capsys, rlhf_home):
    """Issue 32, item 10: not "the default path" for a path the task names (even the default's)."""
    task = tmp_path / "t.yaml"
    task.write_text(json.dumps({"name": "t", "nodes": 2, "checkpoints": {"path": path},
                                "placement": {"max_duration": "2h"},  # (no --time is a warning of its own)
                                "job": {"recipe": "command", "args": {"entrypoint": "true"}}}))
    assert main(["check", str(task), "--provider", "slurm"]) == 0
    err = capsys.readouterr().err
    assert f"warning: checkpoints {path} is the task's checkpoints.path: the script makes it" in err, err
    assert "default" not in err and "make sure /checkpoints is on the cluster's shared filesystem" in err


# ---------------------------------------------------------------- RunPod pods made by hand (item 15)

def test_runpod_readme_and_rendered_files_tell_one_story_of_ray_worker(tmp_path, rlhf_home):
    """docs/runpod.md, start.sh's header and the create requests: each worker its own rank, worker-k gets k."""
    story = "on each worker its own rank, 1 to N-1 (the create requests give worker-k RAY_WORKER=k)"
    main_file = tmp_path / "tiny-grpo.runpod.json"
    assert main(["render", TINY, "--provider", "runpod", "-o", str(main_file)]) == 0
    requests = json.loads(main_file.read_text())
    assert [w["env"]["RAY_WORKER"] for w in requests["workers"]] == ["1", "2"]
    assert requests["head"]["env"]["RAY_WORKER"] == "0"
    flat = lambda text: " ".join(text.replace("#", " ").replace("`", "").split())  # noqa: E731
    assert story in flat((tmp_path / "tiny-grpo.start.sh").read_text())
    assert story in flat((ROOT / "docs" / "runpod.md").read_text())


# ---------------------------------------------------------------- launch --help (item 9)

def test_launch_help_lists_every_flag_each_providers_own_named(capsys):
    with pytest.raises(SystemExit) as done:
        main(["launch", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--provider {dstack,kuberay,local,runpod,sky,slurm}" in out
    for provider, flag in (("local", "--retry N"), ("runpod", "-y"), ("sky", "--managed")):
        assert f"options of --provider {provider}: {flag} " in out, out
    assert "--keep" in out


def test_launch_help_imports_nothing_heavy():
    code = ("import sys\nfrom rlhf_tasks.cli import main\ntry:\n    main(['launch', '--help'])\nexcept SystemExit:\n"
            "    pass\nprint('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in "
            "('ray', 'torch', 'sky', 'dstack', 'runpod', 'httpx')), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stderr, out.stderr


# ---------------------------------------------------------------- a task file's mistakes in its own words (item 14)

INTERNALS = ("String should match", "instance of", "NoneType", "top level", "Input should be a valid")


@pytest.mark.parametrize("text, says", [
    ("", "the file is empty; a task file is a mapping of fields"),
    ("- a\n- b\n", "a task file is a mapping of fields (name: ..., nodes: ..., job: ...), not a list"),
    ("name: Tiny_GRPO\nnodes: 1\njob: {recipe: tiny-grpo}\n", "name: 'Tiny_GRPO': use lowercase letters, digits and dashes"),
    ("name: t\nnodes: 1\njob:\n  recipe: tiny-grpo\n  args: 3\n", "job.args: expected a mapping of tiny-grpo's arguments"),
    ("name: t\nnodes: 1\njob:\n  recipe: tiny-grpo\n  args:\n", "job.args: no value; expected a mapping of tiny-grpo's"),
    ("name: t\nnodes: 1\njob:\n  recipe: tiny-grpo\nargs:\n  steps: 3\n", "args: unknown field here; it belongs under job:"),
    ("name: t\nnodes:\njob: {recipe: tiny-grpo}\n", "nodes: no value; expected a whole number"),
    ("name: t\nnodes: 1\njob:\n", "job: no value; expected a mapping: recipe: NAME and its args:"),
    ("name: t\nnodes: 1\nenv: {A: b}\nsecrets: [A]\njob: {recipe: tiny-grpo}\n", "env.A: also under secrets"),
])
def test_task_file_errors_are_in_the_task_files_words(text, says, tmp_path, capsys, rlhf_home):
    task = tmp_path / "t.yaml"
    task.write_text(text)
    assert main(["check", str(task)]) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert not [word for word in INTERNALS if word in err], err


# ---------------------------------------------------------------- rlhf-tasks env NAME (item 10)

def test_env_gives_the_dashboard_to_rays_job_cli_and_the_gcs_where_reachable(rlhf_home, capsys, monkeypatch):
    state.save("here", {"provider": "local", "cluster_id": "c1", "dashboard": "http://127.0.0.1:8265",
                        "gcs": "127.1.2.1:6379"})
    state.save("far", {"provider": "dstack", "cluster_id": "far", "dashboard": "http://127.0.0.1:8266"})
    assert main(["env", "here"]) == 0
    out = capsys.readouterr().out
    assert "export RAY_API_SERVER_ADDRESS=http://127.0.0.1:8265" in out and "export RAY_ADDRESS=127.1.2.1:6379" in out
    assert main(["env", "far"]) == 0
    said = capsys.readouterr()
    assert "export RAY_API_SERVER_ADDRESS=http://127.0.0.1:8266" in said.out and "unset RAY_ADDRESS" in said.out
    assert "its GCS is not reachable from here" in said.err and "`ray status` and `ray.init()` on the head" in said.err
    # rlhf-tasks itself, after the eval, asks the dashboard, not the GCS's host:port.
    from rlhf_tasks.jobs import dashboard_from_env

    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265")
    monkeypatch.setenv("RAY_ADDRESS", "127.1.2.1:6379")
    assert dashboard_from_env() == "http://127.0.0.1:8265"
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS")
    assert dashboard_from_env() is None


# ---------------------------------------------------------------- small ones (item 17)

def test_forward_on_a_local_cluster_says_its_dashboard_is_here_already(rlhf_home, capsys):
    state.save("here", {"provider": "local", "cluster_id": "c1", "dashboard": "http://127.0.0.1:8265"})
    assert main(["forward", "here"]) == 2
    err = capsys.readouterr().err
    assert "its dashboard is at http://127.0.0.1:8265 already" in err, err
    assert "dstack attach" not in err and "ssh -L" not in err


def test_preflight_names_nodes_of_one_machine_by_rank():
    """The local provider's nodes share a hostname: the report names them node0, node1, ... (as
    docs/preflight.md shows), each with its address, not by the address alone."""
    from rlhf_tasks.agent.preflight import name_nodes

    nodes = [{"hostname": "box", "address": "127.9.9.%d" % (r + 1), "rank": r} for r in range(3)]
    name_nodes(nodes)
    assert [n["label"] for n in nodes] == ["node0 (127.9.9.1)", "node1 (127.9.9.2)", "node2 (127.9.9.3)"]
    apart = [{"hostname": "h%d" % r, "address": "10.0.0.%d" % r, "rank": r} for r in range(2)]
    name_nodes(apart)
    assert [n["name"] for n in apart] == ["h0", "h1"]


# ---------------------------------------------------------------- forward of an ended cluster (issue 32, item 8)

@pytest.mark.parametrize("provider", ["local", "runpod", "kuberay"])
def test_forward_of_a_cluster_that_ended_says_it_ended(provider, rlhf_home, capsys, monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    state.save("tiny-grpo", {"provider": provider, "cluster_id": "c1", "dashboard": "http://127.0.0.1:54273",
                             "job": {"submission_id": "tiny-grpo-c1", "status": "SUCCEEDED"}})
    state.end("tiny-grpo")
    assert main(["forward", "tiny-grpo"]) == 1
    err = capsys.readouterr().err
    assert "failed: forwarding tiny-grpo's dashboard: the cluster ended at " in err, err
    assert "its job tiny-grpo-c1 ended SUCCEEDED" in err and "already" not in err


# ---------------------------------------------------------------- issue 37: stop's record (logs of a wrong id: test_cli.py)

def test_stop_of_the_clusters_job_records_it_stopped(rlhf_home, capsys):
    """`stop JOB` answered STOPPED; the record still said RUNNING (last seen) for `status NAME`
    and `down` once the cluster had ended itself."""
    from test_messages import FakeDashboard

    dashboard = FakeDashboard()
    dashboard.jobs["tiny-grpo-c1"] = "RUNNING"
    try:
        state.save("tiny-grpo", {"provider": "dstack", "cluster_id": "c1", "dashboard": dashboard.url,
                                 "job": {"submission_id": "tiny-grpo-c1", "status": "RUNNING"}})
        assert main(["stop", "tiny-grpo-c1", "--cluster", "tiny-grpo", "--wait", "20"]) == 0
        assert "tiny-grpo-c1: STOPPED" in capsys.readouterr().out
    finally:
        dashboard.close()  # the cluster ended itself: only the record answers now
    job = state.load("tiny-grpo")["job"]
    assert job["submission_id"] == "tiny-grpo-c1" and job["status"] == "STOPPED"
    assert "rlhf-tasks stop" in job["how"]
    assert main(["status", "tiny-grpo"]) == 0
    out = capsys.readouterr().out
    assert "job tiny-grpo-c1: STOPPED" in out and "RUNNING" not in out, out


# ---------------------------------------------------------------- issue 37: ps, and list's command column

def test_ps_lists_every_cluster_launched_from_here_with_its_state_age_and_cost(rlhf_home, capsys, monkeypatch):
    """`ps` (and `status` without a name): one line per cluster not ended, its state as its provider
    reports it now (unreachable said as such), its age and its cost so far; exit 0."""
    import subprocess as sp
    import time

    from rlhf_tasks.errors import StepFailed
    from rlhf_tasks.providers.kuberay import KubeRayProvider

    assert main(["ps"]) == 0
    assert capsys.readouterr().out == "no cluster launched from here is running (rlhf-tasks launch TASK.yaml starts one)\n"
    sleeper = sp.Popen(["sleep", "60"])
    try:
        state.save("alive", {"provider": "local", "cluster_id": "c1", "pids": [sleeper.pid],
                             "price_per_hour": 36.0})
        state.update("alive", launched=time.time() - 3600)
        state.save("gone", {"provider": "local", "cluster_id": "c2", "pids": [2**22 + 1]})
        state.save("kube", {"provider": "kuberay", "cluster_id": "c3"})
        state.save("old", {"provider": "local", "cluster_id": "c4", "ended": "2026-11-24 12:00:00"})

        def unreachable(self, name):
            raise StepFailed("asking Kubernetes", "connection refused")
        monkeypatch.setattr(KubeRayProvider, "state_line", unreachable)
        for argv in (["ps"], ["status"]):
            assert main(argv) == 0
            lines = capsys.readouterr().out.splitlines()
            assert len(lines) == 4, lines  # a header, a line each, never the ended one
            alive = next(line for line in lines if line.startswith("alive "))
            assert "local" in alive and "1 h 00 m" in alive and "$36.00" in alive
            assert "running (1 of 1 node agents on this machine)" in alive
            assert "ended on its own" in next(line for line in lines if line.startswith("gone "))
            kube = next(line for line in lines if line.startswith("kube "))
            assert "kuberay" in kube and "unreachable: asking Kubernetes: connection refused" in kube
            assert not any(line.startswith("old ") for line in lines)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_list_shows_the_trainers_command_not_the_gate():
    from rlhf_tasks.jobs import shown_command

    gated = ("python3 /opt/rlhf-tasks/lib/rlhf_tasks/agent/__main__.py gate /tmp/rlhf-tasks/x.gate 900 "
             "--preflight --plan p.json -- python3 -m rlhf_tasks.demo.train --data '/c/data/prompts.jsonl'")
    assert shown_command(gated) == "python3 -m rlhf_tasks.demo.train --data /c/data/prompts.jsonl"
    assert shown_command("python3 -m openrlhf.cli.train_ppo_ray --x 1") == "python3 -m openrlhf.cli.train_ppo_ray --x 1"
    assert shown_command("") == ""


def test_ps_asks_dstack_for_its_run(tmp_path, monkeypatch):
    """dstack's state is its Run as `dstack ps --json` prints it (dstack 0.22.5's PsCommandOutput:
    project, runs[] with run_spec.run_name, status, status_message, cost)."""
    from rlhf_tasks.errors import StepFailed
    from rlhf_tasks.providers import dstack as dmod

    runs = {"project": "main", "runs": [
        {"run_spec": {"run_name": "other"}, "status": "running", "cost": 9.0},
        {"run_spec": {"run_name": "tiny-grpo"}, "status": "running", "status_message": "running", "cost": 1.5}]}
    fake = tmp_path / "dstack"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\ncat <<'EOF'\n{json.dumps(runs)}\nEOF\n")
    fake.chmod(0o755)
    monkeypatch.setattr(dmod, "require_cli", lambda *a: str(fake))
    provider = dmod.DstackProvider()
    assert provider.state_line("tiny-grpo") == "dstack run tiny-grpo: running, $1.50 so far (dstack's)"
    assert (tmp_path / "argv").read_text().split() == ["ps", "--json", "--last", str(dmod.PS_RUNS)]
    assert provider.state_line("absent").startswith("no run named absent among dstack's last")
    fake.write_text("#!/bin/sh\necho 'Server is not reachable' >&2\nexit 1\n")
    with pytest.raises(StepFailed, match="Server is not reachable"):
        provider.state_line("tiny-grpo")


# ---------------------------------------------------------------- issue 37 item 2: render -o overwrites nothing of the user's

def _tree(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_render_never_writes_over_the_task_file(tmp_path, capsys, rlhf_home):
    task = tmp_path / "v.yaml"
    task.write_text((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    before = _tree(tmp_path)
    for extra in ([], ["--force"]):
        assert main(["render", str(task), "--provider", "sky", "-o", str(task), *extra]) == 2
        err = capsys.readouterr().err
        assert f"-o: {task} is the task file itself" in err and "nothing written" in err, err
        assert _tree(tmp_path) == before


def test_render_writes_over_no_file_it_did_not_write_without_force(tmp_path, capsys, rlhf_home):
    out = tmp_path / "out"
    out.mkdir()
    mine = out / "tiny-grpo.sky.yaml"
    mine.write_text("# my own SkyPilot file\nresources: {cpus: 1}\n")
    before = _tree(tmp_path)
    assert main(["render", TINY, "--provider", "sky", "-o", str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"-o: {mine} exists and rlhf-tasks did not write it" in err and "--force" in err, err
    assert _tree(tmp_path) == before  # nothing written: not the plan beside it either
    assert main(["render", TINY, "--provider", "sky", "-o", str(mine), "--force"]) == 0
    capsys.readouterr()
    assert "Rendered by rlhf-tasks" in mine.read_text()
    # What rlhf-tasks wrote (its header says so), it writes again: every file, the plan and the agent's included.
    (out / "rlhf-tasks" / "tiny-grpo.sky.plan.json").write_text('{"version": 0, "name": "x", "provider": "sky", '
                                                                 '"contract": {}, "job": {}}')
    assert main(["render", TINY, "--provider", "sky", "-o", str(mine)]) == 0
    assert json.loads((out / "rlhf-tasks" / "tiny-grpo.sky.plan.json").read_text())["name"] == "tiny-grpo"


def test_renders_for_two_providers_share_a_folder(tmp_path, capsys, rlhf_home):
    """dstack's file ships rlhf-tasks/NAME.dstack.plan.json, SkyPilot's NAME.sky.plan.json: one folder holds both."""
    out = tmp_path / "out"
    out.mkdir()
    assert main(["render", TINY, "--provider", "dstack", "-o", str(out)]) == 0
    assert main(["render", TINY, "--provider", "sky", "-o", str(out)]) == 0
    dstack_plan = json.loads((out / "rlhf-tasks" / "tiny-grpo.dstack.plan.json").read_text())
    sky_plan = json.loads((out / "rlhf-tasks" / "tiny-grpo.sky.plan.json").read_text())
    assert dstack_plan["provider"] == "dstack" and sky_plan["provider"] == "sky"
    import yaml

    dstack_file = yaml.safe_load((out / "tiny-grpo.dstack.yml").read_text())
    assert "rlhf-tasks:/opt/rlhf-tasks" in dstack_file["files"]  # the folder, each plan by its own name in it
    assert any("--plan /opt/rlhf-tasks/tiny-grpo.dstack.plan.json" in c for c in dstack_file["commands"])
    assert "tiny-grpo.sky.plan.json" in (out / "tiny-grpo.sky.yaml").read_text()
    # every file rendered says who wrote it, the fleet's and the shipped sources included
    for path in out.rglob("*"):
        if path.is_file() and not path.name.endswith(".json"):
            assert "Rendered by rlhf-tasks" in "\n".join(path.read_text().splitlines()[:5]), path


# ---------------------------------------------------------------- issue 48 item 8: names never launched, names refused

def test_token_of_a_name_the_schema_refuses_exits_2_and_writes_nothing(rlhf_home, capsys):
    """`token Verl_X` made state for a name no task can have (the spec's NAME_PATTERN)."""
    for name in ("Verl_X", "../x", "x-", "a" * 41, "x\n"):
        assert main(["token", name]) == 2
        err = capsys.readouterr().err
        assert f"NAME: {name!r} is not a cluster's name" in err and "lowercase letters, digits and dashes" in err
    assert not rlhf_home.exists()


def test_status_of_a_name_never_launched_says_so_and_lists_what_was(rlhf_home, capsys, monkeypatch):
    """`status NAME` of a name never launched spoke of `--address`."""
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    state.save("tiny-grpo", {"provider": "local", "cluster_id": "c1", "ended": 1.0})
    state.save("verl-ppo", {"provider": "dstack", "cluster_id": "c2"})
    state.save("verl-ppo-2", {"provider": "dstack", "cluster_id": "c3"})
    assert main(["status", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no cluster named nope was launched from here (launched from here: tiny-grpo (ended), verl-ppo, " \
           "verl-ppo-2)" in err
    assert "--address" not in err
    shutil.rmtree(rlhf_home)
    assert main(["status", "nope"]) == 2
    assert "no cluster named nope was launched from here (none was)" in capsys.readouterr().err


def test_check_json_without_provider_plans_for_local_or_the_provider_the_task_names(rlhf_home, capsys, tmp_path):
    """`check --json` without --provider planned for dstack (the first of the others by name) for a GPU
    task: the JSON plan is one provider's, so it is local's (launch's and render's default) where local
    can run the task, else the one provider the task names (placement.<provider>, checkpoints.shared),
    else none: exit 2 naming those that can run it, as check's text says them."""
    import yaml

    assert main(["check", TINY, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["contract"] == json.loads(_check_json(TINY, "local", capsys))["contract"]
    gpu = yaml.safe_load((ROOT / "tasks" / "verl-ppo-gsm8k.yaml").read_text())
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(gpu))
    assert main(["check", str(path), "--json"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and "--json: the plan is one provider's: give --provider (dstack, kuberay, runpod, sky, " \
                             "slurm can run it" in said.err
    gpu.setdefault("placement", {})["slurm"] = {"partition": "gpu"}
    path.write_text(yaml.safe_dump(gpu))
    assert main(["check", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["contract"] == json.loads(_check_json(str(path), "slurm", capsys))[
        "contract"]


def _check_json(path: str, provider: str, capsys) -> str:
    assert main(["check", path, "--provider", provider, "--json"]) == 0
    return capsys.readouterr().out
