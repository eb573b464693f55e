"""End to end on the local provider, for real: the demo task on a 3-node Ray cluster,
a relaunch that resumes from the checkpoint, and token auth on the Jobs API."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT


def launch(args, cwd, env, timeout=600):
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cli(cwd, env, *args):
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def no_leftovers(cluster_id: str) -> bool:
    """No process of ours still runs: our temp dir names the cluster in every Ray command line."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return f"rlhf-{cluster_id}" not in out


#: A job that prints the secret FX_SECRET (which no failure bundle may hold), then fails with a traceback.
FAIL_WITH_SECRET = "python3 -c 'import json, os; print(\"the key is\", os.environ[\"FX_SECRET\"], flush=True); json.loads(\"{\")'"


def sleeping_task(path: Path, name: str) -> None:
    """A 2-node task whose job prints "started" and then sleeps for 10 minutes."""
    path.write_text(yaml.safe_dump({
        "name": name, "nodes": 2, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
        "job": {"recipe": "command", "submit": "head", "working_dir": None,
                "args": {"entrypoint": "python3 -c 'import time; print(\"started\", flush=True); time.sleep(600)'"}}}))


def test_tiny_grpo_learns_on_three_nodes_and_resumes(tmp_path, cli_env, rlhf_home):
    """Also (issue 47): a model the task lists is fetched once for the three nodes, from a played hub
    (tests/hub/) by huggingface_hub's own download, each file asked for once, the token by its secret's
    name and never written down; the relaunch asks the hub nothing."""
    from hub.played_hub import PlayedHub, tiny_model

    shipped = ROOT / "tasks" / "tiny-grpo.yaml"
    task = tmp_path / "tiny-grpo.yaml"
    data = yaml.safe_load(shipped.read_text())
    data.update(models=["rlhf-tests/tiny-model"], secrets=["HF_TOKEN"])
    # Preflight with torch on the local provider is test_preflight.py's (the launcher's table, doctor), and the
    # shipped demo's own preflight runs in test_contracts.py's demo on the testbed: ~8 s and a torch import a node.
    data["preflight"] = "off"
    task.write_text(yaml.safe_dump(data))
    token = "hf_" + "Q7wT2" * 7  # no real one: the played hub accepts this one only
    files = tiny_model()
    with PlayedHub({"rlhf-tests/tiny-model": files}, tmp_path / "hub.log", token=token) as hub:
        cli_env = dict(cli_env, HF_HOME=str(tmp_path / "hf"), HF_TOKEN=token, RLHF_TASKS_FETCH_EVERY="0")
        first = launch([str(task)], tmp_path, dict(cli_env, HF_ENDPOINT=hub.url))
        asked = hub.total()
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-6000:]
    # one download for three nodes: the hub's API once, each file's metadata and content once
    assert hub.count("GET", "rlhf-tests/tiny-model", "api") == 1, hub.requests
    for name in files:
        assert hub.count("HEAD", "rlhf-tests/tiny-model", name) == 1, hub.requests
        got = name + " (cdn)" if name.endswith(".safetensors") else name
        assert hub.count("GET", "rlhf-tests/tiny-model", got) == 1, hub.requests
    assert asked == 1 + 2 * len(files), hub.requests
    assert "token=yes" in (tmp_path / "hub.log").read_text()  # it reached the hub, by its secret's name
    assert "models: fetching rlhf-tests/tiny-model from" in out and "fetching rlhf-tests/tiny-model: " in out
    assert "models: fetched rlhf-tests/tiny-model: 3 files" in out
    assert "the head fetches rlhf-tests/tiny-model" in out  # the other two nodes fetch nothing
    for text in [out, (tmp_path / "hub.log").read_text(),
                 *(p.read_text(errors="replace") for p in (rlhf_home / "runs" / "tiny-grpo").rglob("*") if p.is_file()
                   and p.suffix in (".log", ".json", ".sh", ".txt", ".yaml", ""))]:
        assert token not in text
    assert "== summary ==" in out and "SUCCEEDED" in out
    assert f"its files go to {rlhf_home / 'runs' / 'tiny-grpo'}" in out  # printed, and not under the cwd
    # the cluster ends with its run: its agents end themselves after the job (issue 30), and the launcher
    # stops what may be left
    assert "stopped local cluster tiny-grpo: " in out
    assert json.loads((rlhf_home / "clusters" / "tiny-grpo" / "cluster.json").read_text()).get("ended")

    ckpt = rlhf_home / "runs" / "tiny-grpo" / "checkpoints"
    rows = metrics(ckpt / "metrics.jsonl")
    steps = yaml.safe_load(task.read_text())["job"]["args"]["steps"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    start, end = rows[0]["mean_reward"], rows[-1]["mean_reward"]
    assert end >= 0.7 and end >= 3 * start, (start, end)
    assert rows[-1]["world_size"] == 3 and len(set(rows[-1]["node_ids"])) == 3  # every node took part
    assert f"reward {start:.2f} -> {end:.2f}" in out
    assert sorted(p.name for p in ckpt.glob("step_*.pt"))[-1] == f"step_{steps:06d}.pt"
    record_id = next(line.split("job tiny-grpo-")[1].split(":")[0] for line in out.splitlines() if "job tiny-grpo-" in line)
    assert no_leftovers(record_id)
    for log in (rlhf_home / "runs" / "tiny-grpo" / "nodes").glob("agent-node*.log"):  # each node's Ray ended on SIGTERM
        assert "did not end within" not in log.read_text(), (log.name, log.read_text()[-3000:])

    more = yaml.safe_load(task.read_text())
    more["job"]["args"]["steps"] = steps + 5
    (tmp_path / "tiny-grpo-more.yaml").write_text(yaml.safe_dump(more))
    elsewhere = tmp_path / "elsewhere"  # the run's files do not depend on the current directory
    elsewhere.mkdir()
    with PlayedHub({"rlhf-tests/tiny-model": files}, tmp_path / "hub.log", token=token) as hub:
        second = launch([str(tmp_path / "tiny-grpo-more.yaml")], elsewhere, dict(cli_env, HF_ENDPOINT=hub.url))
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-6000:]
    assert hub.total() == 0 and "models: rlhf-tests/tiny-model already fetched in" in out  # the hub is not asked
    rows = metrics(ckpt / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 6))  # continued, not restarted
    assert rows[-1]["mean_reward"] >= 0.7
    # The summary says what this run did: its own steps and nodes, not the first cluster's too.
    assert f"over steps {steps + 1}..{steps + 5}, resumed after step {steps} (world size 3, 3 nodes took part)" in out
    assert not (elsewhere / "runs").exists()


def test_jobs_api_refuses_requests_without_the_token(tmp_path, cli_env, rlhf_home):
    task = tmp_path / "auth.yaml"
    task.write_text(yaml.safe_dump({
        "name": "auth", "nodes": 2, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"},
        "job": {"recipe": "command", "submit": "head", "working_dir": str(tmp_path / "code"),
                "args": {"entrypoint": "python3 hello.py"},
                # job.runtime_env reaches the job through the head's `ray job submit` (issue 47, item 4)
                "runtime_env": {"env_vars": {"GREETING": "runtime-env-greeting"}, "py_modules": ["mods/greet"]}}}))
    (tmp_path / "code").mkdir()
    (tmp_path / "mods" / "greet").mkdir(parents=True)
    (tmp_path / "mods" / "greet" / "__init__.py").write_text("WORD = 'module-from-py-modules'\n")
    (tmp_path / "code" / "hello.py").write_text("import os, greet\nprint('hello from the working_dir')\n"
                                                "print(os.environ['GREETING'], greet.WORD)\n")
    (tmp_path / "code" / "weights.safetensors").write_bytes(b"0" * 1024)  # excluded from the upload
    try:
        run = launch([str(task), "--keep"], tmp_path, cli_env)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        assert "hello from the working_dir" in out
        assert "runtime-env-greeting module-from-py-modules" in out  # Ray's env_vars and py_modules, in the job
        assert "RLHF_TASKS_PREFLIGHT" not in out  # the job's log is shown from after its preflight part

        record = json.loads((rlhf_home / "clusters" / "auth" / "cluster.json").read_text())
        token_path = rlhf_home / "clusters" / "auth" / "token"
        token = token_path.read_text()
        assert oct(token_path.stat().st_mode & 0o777) == "0o600"
        for request in (urllib.request.Request(record["dashboard"] + "/api/jobs/"),
                        urllib.request.Request(record["dashboard"] + "/api/jobs/", method="POST",
                                               data=b'{"entrypoint": "id"}', headers={"Content-Type": "application/json"})):
            try:
                urllib.request.urlopen(request, timeout=10)
                raise AssertionError("the Jobs API answered a request without the token")
            except urllib.error.HTTPError as exc:
                assert exc.code in (401, 403)
        authed = urllib.request.Request(record["dashboard"] + "/api/jobs/", headers={"Authorization": f"Bearer {token}"})
        jobs = json.loads(urllib.request.urlopen(authed, timeout=10).read())
        # The job only: the head's preflight ran in the job's gate, before its command.
        assert [j["submission_id"] for j in jobs] == [f"auth-{record['cluster_id']}"]

        # --keep keeps the cluster after a head-submitted job: our CLI and Ray's own work on it until `down`.
        sid = f"auth-{record['cluster_id']}"
        listed = cli(tmp_path, cli_env, "list", "--cluster", "auth")
        assert listed.returncode == 0 and "SUCCEEDED" in listed.stdout, listed.stderr
        assert cli(tmp_path, cli_env, "status", sid, "--cluster", "auth").stdout.strip() == "SUCCEEDED"
        # the job's log: preflight's part as the launcher shows it (its table), then the command's;
        # the raw line only with --raw
        logged = cli(tmp_path, cli_env, "logs", sid, "--cluster", "auth").stdout
        assert 0 <= logged.find("preflight passed") < logged.find("hello from the working_dir"), logged[-3000:]
        assert "RLHF_TASKS_PREFLIGHT " not in logged
        raw = cli(tmp_path, cli_env, "logs", sid, "--cluster", "auth", "--raw").stdout
        assert 0 <= raw.find("RLHF_TASKS_PREFLIGHT ") < raw.find("hello from the working_dir"), raw[-3000:]
        shell = cli(tmp_path, cli_env, "env", "auth")
        assert shell.returncode == 0 and "RAY_AUTH_MODE=token" in shell.stdout, shell.stderr
        ray_cli = {k: v for k, v in cli_env.items() if not k.startswith("RAY_")}
        init = "python3 -c 'import ray; ray.init(); print(len(ray.nodes()), \"nodes\")'"
        for command in ("ray job list", f"ray job status {sid}", f"ray job logs {sid}", "ray status", init):
            ours = subprocess.run(["bash", "-c", f'eval "$({sys.executable} -m rlhf_tasks.cli env auth)" && {command}'],
                                  cwd=tmp_path, env=ray_cli, capture_output=True, text=True, timeout=120)
            assert ours.returncode == 0, (command, ours.stdout[-2000:], ours.stderr[-2000:])
            if command == init:  # the GCS in RAY_ADDRESS: ray.init() joins the cluster from here
                assert "2 nodes" in ours.stdout, ours.stdout[-2000:]
            if command.startswith("ray job logs"):
                assert "hello from the working_dir" in ours.stdout

        # A retried submission finds the first job instead of starting a second one.
        again = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "submit", str(task), "--address",
                                record["dashboard"]], cwd=tmp_path, env=cli_env, capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 0 and "already on this cluster" in again.stdout, again.stdout + again.stderr
        submitted = [j for j in json.loads(urllib.request.urlopen(authed, timeout=10).read()) if j["type"] == "SUBMISSION"]
        assert len(submitted) == 1  # still the one job (ray.init() above left a driver's entry too)

        logs = "".join(p.read_text() for p in (rlhf_home / "runs" / "auth" / "nodes").glob("*.log"))
        assert token not in out and token not in logs
        assert not (rlhf_home / "runs" / "auth" / "plan.json").read_text().count(token)
    finally:
        down = cli(tmp_path, cli_env, "down", "auth")
    assert down.returncode == 0, down.stderr
    assert "stopping auth on local" in down.stdout and "stopped local cluster auth: 2 node agents" in down.stdout
    assert no_leftovers(record["cluster_id"])
    assert not token_path.exists()
    # Asking about it now says that it ended, how its job ended, and where its logs are.
    gone = cli(tmp_path, cli_env, "status", sid, "--cluster", "auth")
    assert gone.returncode == 1 and "the cluster ended at" in gone.stderr, gone.stderr
    assert f"its job {sid} ended SUCCEEDED" in gone.stderr and str(rlhf_home / "runs" / "auth" / "nodes") in gone.stderr


def test_ctrl_c_while_following_leaves_the_job_running(tmp_path, cli_env, rlhf_home):
    import signal

    task = tmp_path / "long.yaml"
    sleeping_task(task, "long")
    # A secret the job prints: the bundle of its logs must not hold its value.
    spec = yaml.safe_load(task.read_text())
    spec["secrets"] = ["LONG_SECRET"]
    spec["job"]["args"]["entrypoint"] = spec["job"]["args"]["entrypoint"].replace(
        "import time;", "import os, time; print(os.environ[\"LONG_SECRET\"]);")
    task.write_text(yaml.safe_dump(spec))
    cli_env = dict(cli_env, LONG_SECRET="long-secret-value-7")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], cwd=tmp_path, env=cli_env,
                              capture_output=True, text=True, timeout=120)

    proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(task)], cwd=tmp_path, env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("started"):
                break
        assert any("following job" in line for line in seen), "".join(seen)
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 130, rest
        assert "keeps running" in rest and "rlhf-tasks stop long-" in rest and "rlhf-tasks down long" in rest
        job = next(w for w in rest.split() if w.startswith("long-"))
        assert cli("status", job, "--cluster", "long").stdout.strip() == "RUNNING"
        # Every node's logs of the running cluster, on demand (issue 22), through its dashboard.
        made = cli("logs", "long", "--bundle")
        assert made.returncode == 0, made.stdout + made.stderr
        bundle = re.search(r"every node's logs: (\S+\.tar\.gz)", made.stdout).group(1)
        assert bundle.startswith(str(rlhf_home / "runs" / "long"))
        with tarfile.open(bundle) as tar:
            names = tar.getnames()
            held = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
        assert b"long-secret-value-7" not in held and b"[secret LONG_SECRET]" in held  # printed, scrubbed
        assert any("/node0/rlhf-tasks/agent-node0.log" in n for n in names), names
        assert any("/node1/rlhf-tasks/agent-node1.log" in n for n in names), names
        stop = cli("stop", job, "--cluster", "long")
        # (its cluster may end itself before `stop` sees the job STOPPED: the job was its last)
        assert stop.returncode == 0 and stop.stdout.splitlines()[0] == f"{job}: STOPPED", stop.stdout + stop.stderr
        # Issue 30: the job is over, so the cluster ends itself (no --keep), with nobody following.
        from rlhf_tasks.agent.processes import pid_alive
        from testbed import poll

        record = json.loads((rlhf_home / "clusters" / "long" / "cluster.json").read_text())
        assert record["secrets"] == ["LONG_SECRET"]  # names only, for the bundles of any provider's run
        poll(lambda: not any(pid_alive(pid) for pid in record["pids"]) and no_leftovers(record["cluster_id"]), 60,
             "the cluster to end itself after its job was stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
        assert cli("down", "long").returncode == 0


def test_a_failing_job_exits_1_naming_the_step(tmp_path, cli_env):
    """Also: a setup such as `pip install ...` must not run once per node at the same time into the
    one environment the local nodes share; it runs on the head only (issue 20, item 5). And the
    failure's forensics (issue 22): the summary names the head's first error (its driver's
    traceback; a worker's own traceback is tests/test_contracts.py's) and the bundle holds both
    nodes' logs, without the secret the job printed."""
    ran = tmp_path / "setup-ran"
    task = tmp_path / "failing.yaml"
    secret = "fx-secret-value-0123456789"
    task.write_text(yaml.safe_dump({
        "name": "failing", "nodes": 2, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
        "setup": [f"echo ran >> {ran}"], "secrets": ["FX_SECRET"],
        "job": {"recipe": "command", "working_dir": None, "max_restarts": 0,  # restarts have their own tests
                "args": {"entrypoint": FAIL_WITH_SECRET}}}))
    run = launch([str(task)], tmp_path, dict(cli_env, FX_SECRET=secret))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "failed: running job failing-" in run.stderr and "ended FAILED" in run.stderr
    assert "stopped local cluster failing" in run.stdout  # torn down after a failure too
    assert ran.read_text().splitlines() == ["ran"]
    summary = run.stdout[run.stdout.index("== summary =="):]
    firsts = summary[summary.index("first error on each node:"):].splitlines()
    assert firsts[1].strip().startswith("node0 (") and "json.decoder.JSONDecodeError: Expecting" in firsts[1], summary
    assert "[job-driver-failing-" in firsts[1], summary
    bundle = Path(re.search(r"every node's logs: (\S+\.tar\.gz)", summary).group(1))
    with tarfile.open(bundle) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert {"node0/rlhf-tasks/agent-node0.log", "node1/rlhf-tasks/agent-node1.log", "node0/gcs_server.out",
            "node1/raylet.out", "index.json", "index.txt"} <= set(members), sorted(members)
    assert any(n.startswith("node0/job-driver-") for n in members)
    assert "the key is [secret FX_SECRET]" in "".join(members.values())  # the job printed it: scrubbed
    assert not any(secret in text for text in members.values())
    index = json.loads(members["index.json"])
    assert {f["node"] for f in index["files"]} == {"node0", "node1"}


@pytest.mark.parametrize("mode, cause", [
    ("task", "RuntimeError: checksum mismatch in shard 7 (raised in ray::work(), pid "),
    ("actor", "ValueError: loss is nan at step 3 (raised in ray::Shard.step(), pid "),
    ("actor-killed", "ActorDiedError: actor Shard (pid "),
])
def test_an_error_raised_on_another_node_is_named_with_that_node_and_its_cause(mode, cause, tmp_path, cli_env):
    """A task, an actor's method, or an actor that died on node1: the summary's first error names
    node1 and the cause (the traceback's last exception line), not the driver's node and Ray's
    wrapper line (issue 32, item 4a)."""
    task = tmp_path / "raise.yaml"
    task.write_text(yaml.safe_dump({
        "name": "raise", "nodes": 2, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
        "job": {"recipe": "command", "working_dir": None, "max_restarts": 0, "args": {
            "entrypoint": f"python3 {ROOT / 'tests' / 'data' / 'raise_on_another_node.py'} {mode}"}}}))
    run = launch([str(task)], tmp_path, cli_env)
    assert run.returncode == 1, run.stdout + run.stderr
    summary = run.stdout[run.stdout.index("== summary =="):]
    firsts = summary[summary.index("first error on each node:"):].splitlines()
    assert firsts[1].strip().startswith("node1 (") and cause in firsts[1], summary
    assert "[node0/job-driver-raise-" in firsts[1], summary  # where it was read: the driver's log, on the head
    if mode == "actor-killed":
        assert "worker process has died" in firsts[1] and "OOM killer" in firsts[1], summary
    assert not any(line.strip().startswith("node0 (") for line in firsts[1:] if line.startswith("  ")), summary


def _lose_node(rlhf_home: Path, name: str, rank: int) -> None:
    """Kill one local node as a machine is lost: its agent, its Ray and its services, at once."""
    import os
    import signal

    record = json.loads((rlhf_home / "clusters" / name / "cluster.json").read_text())
    groups = [record["pids"][rank]]
    for pgid_file in (Path(record["temp_dir"]) / "rlhf-tasks").glob(f"{name}-node{rank}-*.pgid"):
        groups.append(int(pgid_file.read_text()))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _loss_task(tmp_path: Path, steps: int) -> Path:
    task = yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    task["name"] = "loss"
    task["preflight"] = "off"  # its own tests cover it; ~8 s a cluster
    task["job"]["args"].update(steps=steps, save_every=20)
    path = tmp_path / "loss.yaml"
    path.write_text(yaml.safe_dump(task))
    return path


def _launch_until_step(tmp_path, cli_env, rlhf_home, args, step):
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", *args], cwd=tmp_path, env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = rlhf_home / "runs" / "loss" / "checkpoints" / "metrics.jsonl"
    _wait_step(proc, path, step)
    return proc, path


def _wait_step(proc: subprocess.Popen, path: Path, step: int, timeout: float = 300) -> None:
    _wait_rows(proc, path, lambda rows: rows and rows[-1]["step"] >= step, timeout)


def _wait_rows(proc: subprocess.Popen, path: Path, found, timeout: float = 300):
    """Poll the metrics rows until `found(rows)` is truthy, and return it (the launch must keep running)."""
    import time

    deadline = time.monotonic() + timeout
    while not (result := found(metrics(path) if path.exists() else [])):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    return result


def test_a_lost_worker_is_replaced_then_a_lost_head_relaunches_the_task_which_resumes(tmp_path, cli_env, rlhf_home):
    """One run, both losses: a worker machine lost mid-job (the local provider replaces it, the
    head restarts the job from its checkpoint), then the head machine lost (the launcher
    relaunches the task, which resumes); every step once."""
    # Long enough (20-30 ms a step) that each loss comes mid-job: the head is lost by step ~145 at the latest
    # (the restart resumes from a checkpoint of the first attempt, which fails tens of steps after step 45),
    # seconds before the last; every step after that is training the relaunched cluster does for nothing.
    steps = 300
    proc, path = _launch_until_step(tmp_path, cli_env, rlhf_home,
                                    [str(_loss_task(tmp_path, steps)), "--retry", "1"], 45)
    from rlhf_tasks.providers.local import node_address

    first_cluster = json.loads((rlhf_home / "clusters" / "loss" / "cluster.json").read_text())["cluster_id"]
    _lose_node(rlhf_home, "loss", 2)
    # The job fails once rank 2's actor notices its raylet is gone (a second or two, tens of steps), and
    # the head restarts it from the latest checkpoint: once that attempt has saved a newer one, lose the head.
    restarted = _wait_rows(proc, path, lambda rows: [r["resumed_from"] for r in rows if "resumed_from" in r])[0]
    _wait_step(proc, path, max(100, restarted + 25))
    _lose_node(rlhf_home, "loss", 0)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-6000:]
    assert "the node agent of rank 2 died; started it again" in out  # the local provider replaced the machine
    assert "restarting the job, attempt 1 of 2" in out and node_address(first_cluster, 2) in out  # which node
    assert "the head is lost" in out and "relaunching loss, 1 of 1" in out
    rows = metrics(path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # none lost, none twice
    assert any(r.get("resumed_from", 0) >= max(100, restarted + 20) for r in rows)  # the new cluster resumed
    assert no_leftovers(first_cluster)
    assert no_leftovers(json.loads((rlhf_home / "clusters" / "loss" / "cluster.json").read_text())["cluster_id"])


def _launch_until(task: Path, cwd: Path, env: dict, until) -> tuple[subprocess.Popen, list[str]]:
    """Start `launch TASK` and read its output until a line for which `until(line)` holds."""
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(task)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if until(line):
            break
    return proc, seen


def test_ctrl_c_before_the_job_started_stops_the_cluster_and_the_job_never_runs(tmp_path, cli_env, rlhf_home):
    """Ctrl-C after the head submitted the job behind its gate, while a head service keeps the
    cluster forming: the launch is cancelled, nothing of it keeps running (issue 20, item 6)."""
    import signal
    from rlhf_tasks.agent.protocol.ports import free_port

    port = free_port()  # a port nothing listens on: the service never answers
    ran = tmp_path / "ran"
    task = tmp_path / "early.yaml"
    task.write_text(yaml.safe_dump({
        "name": "early", "nodes": 2, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
        "services": [{"name": "hold", "where": "head", "command": "sleep 600", "ready": {"tcp": port}, "timeout": "5m"}],
        "job": {"recipe": "command", "submit": "head", "working_dir": None, "args": {"entrypoint": f"touch {ran}"}}}))
    proc, seen = _launch_until(task, tmp_path, cli_env, lambda line: "starting service hold" in line)
    try:
        assert any("submitting job early-" in line for line in seen), "".join(seen)  # the gated job is in Ray
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 130, rest
        assert "interrupted before the job's command started: stopping the cluster early" in rest, rest
        assert "stopped local cluster early" in rest and "the job of early did not run" in rest, rest
        assert "keeps running" not in rest, rest
        record = json.loads((rlhf_home / "clusters" / "early" / "cluster.json").read_text())
        assert record.get("ended") and no_leftovers(record["cluster_id"])
        assert not ran.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "down", "early"], cwd=tmp_path, env=cli_env,
                       capture_output=True, timeout=120)
