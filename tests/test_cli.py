"""CLI contract: light start-up, exit codes, render purity, no fixed sleeps in the product."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from rlhf_tasks.cli import main

from conftest import ROOT

HEAVY = ("ray", "torch", "sky", "dstack", "runpod")


@pytest.mark.parametrize("argv", [["--help"], ["render", "tasks/tiny-grpo.yaml", "--provider", "local"],
                                  ["render", "tasks/tiny-grpo.yaml", "--provider", "sky"],
                                  ["render", "tasks/tiny-grpo.yaml", "--provider", "dstack"],
                                  ["check", "tasks/tiny-grpo.yaml", "--provider", "local"], ["recipes"]])
def test_no_heavy_imports(argv):
    """`render` never asks a provider's own code (`check` does, tests/test_check_own_code.py)."""
    code = ("import sys\nfrom rlhf_tasks.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stderr, out.stderr


def test_check_json_is_the_plan_with_an_argument_list(capsys):
    assert main(["check", str(ROOT / "tasks/tiny-grpo.yaml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nodes"] == 3 and plan["job"]["recipe"] == "tiny-grpo"
    assert isinstance(plan["job"]["entrypoint"], list) and plan["job"]["entrypoint"][:3] == ["python3", "-m", "rlhf_tasks.demo.train"]
    assert plan["services"][0]["ready"]["method"] == "POST"


def test_render_is_pure_and_writes_beside_the_main_file(tmp_path, capsys, rlhf_home):
    out = tmp_path / "r" / "start-nodes.sh"
    assert main(["render", str(ROOT / "tasks/tiny-grpo.yaml"), "--provider", "local", "-o", str(out)]) == 0
    assert "rlhf_tasks/agent/__main__.py --plan" in out.read_text()
    assert json.loads((tmp_path / "r" / "plan.json").read_text())["name"] == "tiny-grpo"
    assert not rlhf_home.exists()  # no token, no cluster record: nothing happened


def test_unknown_provider_is_bad_input(capsys):
    assert main(["render", str(ROOT / "tasks/tiny-grpo.yaml"), "--provider", "nope"]) == 2
    assert "--provider" in capsys.readouterr().err


def test_placement_slurm_is_read_by_the_slurm_provider_and_named_in_its_errors(tmp_path, capsys, rlhf_home):
    """spec.py keeps `placement.slurm` as a mapping; the slurm provider's model reads it: bad
    options are bad input (exit 2) naming the field, a near-miss key gets a suggestion."""
    task = tmp_path / "t.yaml"
    task.write_text(json.dumps({"name": "t", "nodes": 2, "job": {"recipe": "command", "args": {"entrypoint": "true"}},
                                "placement": {"slurm": {"partion": "gpu", "qos": "a b"}}}))
    assert main(["render", str(task), "--provider", "slurm"]) == 2
    err = capsys.readouterr().err
    assert "placement.slurm.partion: unknown field (did you mean partition?)" in err
    assert "placement.slurm.qos: 'a b': one word" in err
    assert main(["render", str(task), "--provider", "dstack"]) == 0  # another provider's options: not dstack's


def test_schema_spells_out_the_slurm_options_and_the_task_files_fit_it(capsys):
    from jsonschema import Draft202012Validator
    import yaml

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$defs"]["Placement"]["properties"]["slurm"]["$ref"] == "#/$defs/SlurmPlacement"
    assert {"partition", "gres", "container", "mounts"} <= set(schema["$defs"]["SlurmPlacement"]["properties"])
    validator = Draft202012Validator(schema)
    for path in sorted((ROOT / "tasks").glob("*.yaml")):
        assert not [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))], path
    bad = {"name": "t", "nodes": 1, "job": {"recipe": "command", "args": {"entrypoint": "true"}},
           "placement": {"slurm": {"container": "singularity"}}}
    assert list(validator.iter_errors(bad))


def test_usage_error_exits_2():
    with pytest.raises(SystemExit) as info:
        main(["launch"])
    assert info.value.code == 2


def _sleeps_outside_loops(tree: ast.AST) -> list[int]:
    bad = []

    def visit(node, in_loop):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("time.sleep", "sleep"):
            if not in_loop:
                bad.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            else:
                visit(child, in_loop or isinstance(node, (ast.While, ast.For)))

    visit(tree, False)
    return bad


def test_no_fixed_sleeps_in_the_product():
    """A sleep is allowed only as the pause of a polling loop, never to wait blindly."""
    offenders = {}
    for path in sorted((ROOT / "rlhf_tasks").rglob("*.py")):
        lines = _sleeps_outside_loops(ast.parse(path.read_text()))
        if lines:
            offenders[str(path.relative_to(ROOT))] = lines
    assert offenders == {}
    assert _sleeps_outside_loops(ast.parse("import time\ntime.sleep(30)\n")) == [2]


def test_token_is_made_once_with_mode_0600(rlhf_home, capsys):
    assert main(["token", "mycluster"]) == 0
    first = capsys.readouterr().out.strip()
    path = rlhf_home / "clusters" / "mycluster" / "token"
    assert path.read_text() == first and len(first) >= 32 and oct(path.stat().st_mode & 0o777) == "0o600"
    assert main(["token", "mycluster"]) == 0 and capsys.readouterr().out.strip() == first
    assert main(["token", "mycluster", "--new"]) == 0 and capsys.readouterr().out.strip() != first


def test_check_without_provider_says_which_providers_can_run_a_gpu_task(capsys):
    task = str(ROOT / "tasks" / "verl-ppo-gsm8k.yaml")
    assert main(["check", task]) == 0
    out = capsys.readouterr().out
    assert "providers dstack, kuberay, runpod, sky, slurm can run it" in out and "not local: the local provider runs CPU-only nodes" in out
    assert main(["check", task, "--provider", "local"]) == 2  # what launch would refuse, check refuses too
    err = capsys.readouterr().err
    assert f"{task}: resources.gpus: the local provider runs CPU-only nodes" in err


def test_summary_says_what_this_run_did(tmp_path, capsys):
    """Rows of earlier runs (other clusters' nodes) are not this run's; a run that trained nothing says so."""
    from rlhf_tasks import providers
    from rlhf_tasks.outcome import Outcome, summarise
    from rlhf_tasks.spec import parse_task

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "mean_reward": s / 10, "world_size": 3, "node_ids": ["a", "b", "c"]} for s in (1, 2)]
    rows += [{"step": 3, "mean_reward": 0.9, "world_size": 3, "node_ids": ["x", "y", "z"]}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = providers.get("dstack").plan(parse_task({"name": "t", "nodes": 3, "job": {"recipe": "command",
                                                    "working_dir": None, "args": {"entrypoint": "true"}}}))
    plan = plan.replace(job=plan.job.model_copy(update={"summary": {"metrics": str(metrics)}}))
    summarise(plan, Outcome("t-1", "SUCCEEDED", node_ids={"x", "y", "z", "head"}), 0.0)
    out = capsys.readouterr().out
    assert "over steps 3..3, resumed after step 2 (world size 3, 3 nodes took part)" in out
    summarise(plan, Outcome("t-2", "SUCCEEDED", node_ids={"p", "q", "r"}), 0.0)
    assert "trained nothing: the checkpoint was already at step 3" in capsys.readouterr().out


def test_check_and_render_warn_when_a_multi_node_resume_has_no_shared_storage(tmp_path, capsys):
    task = str(ROOT / "tasks" / "verl-ppo-gsm8k.yaml")
    assert main(["check", task, "--provider", "dstack"]) == 0
    assert capsys.readouterr().err.startswith("warning: checkpoints /checkpoints/verl-ppo-gsm8k is a directory on each")
    assert main(["render", task, "--provider", "sky", "-o", str(tmp_path / "x.sky.yaml")]) == 0
    assert "add checkpoints.shared.sky" in capsys.readouterr().err


def test_stop_of_the_last_job_is_stopped_when_its_cluster_then_ends_itself(tmp_path):
    """A cluster ends itself once its job is over (unless kept), so the dashboard that took the
    stop may be gone before `stop` sees the job STOPPED: that is the stop done, not a failure."""
    import threading

    def cluster_ends(server):  # nothing answers after this answer (no race with stop's next ask)
        server.socket.close()
        threading.Thread(target=server.shutdown).start()

    server, address = _dashboard({}, on_stop=cluster_ends)
    out = _cli(tmp_path, "stop", "last-job", "--address", address)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[0] == "last-job: STOPPED"
    assert "the cluster ended itself with its job" in out.stdout


def _dashboard(jobs: dict, on_stop=None):
    """A stand-in Ray dashboard: GET /api/jobs/ID (404 for an unknown id), its /logs, and POST
    /api/jobs/ID/stop (`on_stop(server)` before the answer)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Dashboard(BaseHTTPRequestHandler):
        def _answer(self, code, payload):
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            parts = self.path.strip("/").split("/")  # api jobs ID [logs]
            if parts[:2] != ["api", "jobs"]:
                return self._answer(404, {})
            if len(parts) == 2:
                return self._answer(200, [{"submission_id": s, "status": st} for s, st in jobs.items()])
            if parts[2] not in jobs:
                return self._answer(404, {"error": f"Job {parts[2]} does not exist"})
            if parts[3:] == ["logs"]:
                return self._answer(200, {"logs": f"the log of {parts[2]}\n"})
            return self._answer(200, {"submission_id": parts[2], "status": jobs[parts[2]]})

        def do_POST(self):
            if on_stop:
                on_stop(server)
            self._answer(200, {"stopped": True})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _cli(tmp_path, *argv):
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLHF_TASKS_"))}
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *argv], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT),
                                                         RLHF_TASKS_HOME=str(tmp_path / "home")))


def _launched(tmp_path, name, address, sid, status="RUNNING"):
    """A cluster's record as launch writes it (state.save, then state.update(job=...))."""
    import os
    from rlhf_tasks import state
    old = os.environ.get("RLHF_TASKS_HOME")
    os.environ["RLHF_TASKS_HOME"] = str(tmp_path / "home")
    try:
        state.save(name, {"provider": "local", "dashboard": address, "cluster_id": "abcd1234"})
        state.update(name, job={"submission_id": sid, "status": status})
        return state.load(name)
    finally:
        if old is None:
            del os.environ["RLHF_TASKS_HOME"]
        else:
            os.environ["RLHF_TASKS_HOME"] = old


def test_logs_of_an_unknown_job_or_of_a_clusters_name_exits_2_saying_so(tmp_path):
    """Issue 37 (6): `logs` with a wrong id said nothing and exited 0."""
    server, address = _dashboard({"tiny-grpo-abcd1234": "RUNNING"})
    try:
        _launched(tmp_path, "tiny-grpo", address, "tiny-grpo-abcd1234")
        out = _cli(tmp_path, "logs", "tiny-grpo-abcd1234", "--cluster", "tiny-grpo", "--raw")
        assert out.returncode == 0 and out.stdout == "the log of tiny-grpo-abcd1234\n", out.stderr
        out = _cli(tmp_path, "logs", "nonexistent-job", "--cluster", "tiny-grpo")
        assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
        assert "no job nonexistent-job on this cluster" in out.stderr
        out = _cli(tmp_path, "logs", "nonexistent-job", "--address", address, "--follow")
        assert out.returncode == 2 and "no job nonexistent-job on this cluster" in out.stderr, out.stderr
        out = _cli(tmp_path, "logs", "tiny-grpo")  # a cluster's name as the job
        assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
        assert "tiny-grpo is a cluster's name" in out.stderr
        assert "--cluster tiny-grpo" in out.stderr and "logs tiny-grpo --bundle" in out.stderr
        assert "rlhf-tasks logs tiny-grpo-abcd1234 --cluster tiny-grpo" in out.stderr  # its job, named
        _launched(tmp_path, "other", "http://127.0.0.1:9", "other-abcd1234")  # two known: still said, nothing asked
        out = _cli(tmp_path, "logs", "tiny-grpo")
        assert out.returncode == 2 and "tiny-grpo is a cluster's name" in out.stderr, out.stdout + out.stderr
    finally:
        server.shutdown()


def test_stop_records_the_clusters_last_job_stopped_when_the_cluster_then_ends_itself(tmp_path):
    """Issue 37 (7): after `stop JOB` answered STOPPED and the cluster ended itself, the record
    still said RUNNING (`status NAME` showed it; `down` recorded 'stopped ... while RUNNING')."""
    def ends(server):
        import threading
        server.socket.close()
        threading.Thread(target=server.shutdown).start()

    sid = "tiny-grpo-abcd1234"
    server, address = _dashboard({sid: "RUNNING"}, on_stop=ends)
    _launched(tmp_path, "tiny-grpo", address, sid)
    _launched(tmp_path, "other", "http://127.0.0.1:9", "other-abcd1234")
    out = _cli(tmp_path, "stop", sid, "--cluster", "tiny-grpo")
    assert out.returncode == 0 and out.stdout.splitlines()[0] == f"{sid}: STOPPED", out.stdout + out.stderr
    record = json.loads((tmp_path / "home" / "clusters" / "tiny-grpo" / "cluster.json").read_text())
    assert record["job"]["submission_id"] == sid and record["job"]["status"] == "STOPPED", record
    other = json.loads((tmp_path / "home" / "clusters" / "other" / "cluster.json").read_text())
    assert other["job"]["status"] == "RUNNING"  # another cluster's job is not touched
    from rlhf_tasks.jobs import last_job  # what `status NAME` and `down` read: the dashboard is gone, the record says
    assert last_job("tiny-grpo", record, None) == {**record["job"], "seen": "last seen"}


def test_stop_by_address_records_the_job_whose_record_names_it(tmp_path):
    def ends(server):
        import threading
        server.socket.close()
        threading.Thread(target=server.shutdown).start()

    sid = "tiny-grpo-abcd1234"
    server, address = _dashboard({sid: "RUNNING", "tiny-grpo-older": "SUCCEEDED"}, on_stop=ends)
    _launched(tmp_path, "tiny-grpo", address, sid)
    out = _cli(tmp_path, "stop", sid, "--address", address)
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads((tmp_path / "home" / "clusters" / "tiny-grpo" / "cluster.json").read_text())
    assert record["job"]["status"] == "STOPPED", record


@pytest.mark.parametrize("provider", ["dstack", "sky", "slurm", "runpod"])
def test_a_bundle_scrubs_the_secrets_of_the_plan_staged_for_any_provider(provider, rlhf_home):
    """`logs --bundle` scrubs the task's secrets by the plans staged for it here: a remote provider
    stages NAME.PROVIDER.plan.json (its secrets were not scrubbed while only plan.json was read)."""
    from rlhf_tasks import providers, state
    from rlhf_tasks.commands.job import bundle_secret_names
    from rlhf_tasks.spec import load_task

    task = load_task(str(ROOT / "tasks" / "verl-ppo-gsm8k.yaml"))
    assert task.secrets, "the task names secrets"
    chosen = providers.get(provider)
    plan = chosen.plan(task)
    chosen.stage(plan, {})  # as launch stages it (local's plan.json: test_e2e_local's bundle test)
    if provider in ("dstack", "sky"):  # a plan file staged beside the render
        assert bundle_secret_names(task.name) == sorted(task.secrets)
    else:  # the plan travels inside the sbatch script or the pods' start: the launch's record says them
        assert bundle_secret_names(task.name) == []
    state.save(task.name, {"provider": provider, "secrets": plan.secrets})
    assert bundle_secret_names(task.name) == sorted(task.secrets)
