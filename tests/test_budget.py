"""Issue 30 without a cluster: the budget fields of a task and what `check` refuses, the head's
budget arithmetic and words, finding a job's driver, a machine ending itself (a real HTTP
server stands for RunPod's API), and one live cluster per name (a live record, a stand-in
`dstack` on PATH that must never be called)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from rlhf_tasks.agent import budget as bmod
from rlhf_tasks.agent.ending import end_machine
from test_provider_launch import env_with, fake_cli, run_cli


def task(tmp_path: Path, placement: dict | None = None, name: str = "cost", **extra) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "nodes": 2, "placement": placement or {}, **extra,
        "job": {"recipe": "command", "submit": "head", "working_dir": None, "args": {"entrypoint": "true"}}}))
    return path


def check(tmp_path, path, *args):
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "check", str(path), *args, "--json"], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), RLHF_TASKS_HOME=str(tmp_path / "home")),
                          capture_output=True, text=True, timeout=120)


def test_the_budget_reaches_the_plan(tmp_path):
    out = check(tmp_path, task(tmp_path, {"max_cost": 12.5, "price_per_hour": 5, "max_duration": "3h",
                                          "stop_grace": "30s", "idle": "never"}))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["budget"] == {"price_per_hour": 5.0, "max_cost": 12.5, "max_duration_s": 10800.0,
                                                "stop_grace_s": 30.0, "idle_s": None, "training": "cost",
                                                "spent": {}, "cap_exit": 1, "error_retries": None,
                                                "machine_price": None}
    plain = json.loads(check(tmp_path, task(tmp_path)).stdout)
    assert plain["budget"]["idle_s"] == 3600.0 and plain["budget"]["max_cost"] is None and plain["self_end"] is None


@pytest.mark.parametrize("provider", ["local", "sky", "slurm"])  # dstack prices it from its plan (test_price.py)
def test_a_cost_cap_without_a_price_is_refused_at_check(tmp_path, provider):
    out = check(tmp_path, task(tmp_path, {"max_cost": 10}, resources={"cpus": 1}), "--provider", provider)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "placement.max_cost:" in out.stderr and "placement.price_per_hour" in out.stderr
    assert f"the {provider} provider does not know it" in out.stderr


def test_runpod_prices_from_its_catalog_and_its_pods_end_themselves(tmp_path):
    out = check(tmp_path, task(tmp_path, {"max_cost": 10, "max_duration": "2h"}), "--provider", "runpod")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["budget"]["max_duration_s"] == 7200.0 and plan["budget"]["price_per_hour"] is None  # filled at launch
    assert plan["budget"]["machine_price"] == {"url": "{RUNPOD_API_URL}/pods/{RUNPOD_POD_ID}", "field": "cost",
                                               "defaults": {"RUNPOD_API_URL": "https://api.runpod.io/v2"},
                                               "bearer_env": "RUNPOD_API_KEY", "what": "RunPod's `cost` of this pod"}
    assert plan["self_end"]["url"] == "{RUNPOD_API_URL}/pods/{RUNPOD_POD_ID}/action"
    assert plan["self_end"]["bearer_env"] == "RUNPOD_API_KEY" and plan["self_end"]["json_body"] == {"action": "terminate"}
    # An Instant Cluster's pods cannot be ended through the pod endpoints: no self_end.
    cluster = json.loads(check(tmp_path, task(tmp_path, {"max_duration": "2h"}, network="runpod-cluster"),
                               "--provider", "runpod").stdout)
    assert cluster["self_end"] is None
    own_price = check(tmp_path, task(tmp_path, {"price_per_hour": 3}), "--provider", "runpod")  # said, ignored
    assert own_price.returncode == 0 and json.loads(own_price.stdout)["budget"]["price_per_hour"] is None
    assert "placement.price_per_hour: ignored on runpod: RunPod's own price is counted" in own_price.stderr
    key = check(tmp_path, task(tmp_path, secrets=["RUNPOD_API_KEY"]), "--provider", "runpod")
    assert key.returncode == 2 and "secrets: RUNPOD_API_KEY: your RunPod API key is never written into a pod" in key.stderr


def test_cap_arithmetic_and_words():
    assert bmod.cap_seconds({"price_per_hour": 36.0, "max_cost": 1.0}) == pytest.approx(100.0)
    assert bmod.cap_seconds({"price_per_hour": 36.0, "max_cost": 1.0, "max_duration_s": 50}) == 50
    assert bmod.cap_seconds({"price_per_hour": 0.0, "max_cost": 1.0}) is None  # free: no cost cap
    assert bmod.cap_seconds({"price_per_hour": 2.0}) is None
    assert bmod.hm(5400) == "1 h 30 m" and bmod.hm(59) == "0 h 01 m"
    assert bmod.cap_words({"price_per_hour": 8.0, "max_cost": 12.0}, 5400) == \
        "stopped at the budget cap: $12.00 after 1 h 30 m (placement.max_cost $12.00)"
    assert bmod.cap_words({"price_per_hour": 8.0, "max_cost": 100.0, "max_duration_s": 3600}, 3600) == \
        "stopped at the budget cap: $8.00 after 1 h 00 m (placement.max_duration 1 h 00 m)"
    assert bmod.cap_words({"max_duration_s": 3600}, 3600).startswith("stopped at the budget cap: cost unknown after")


def test_a_jobs_driver_is_found_by_its_submission_in_its_environment(tmp_path):
    """What Ray's job supervisor gives the entrypoint (a session of its own, the submission in
    RAY_JOB_CONFIG_JSON_ENV_VAR), and SIGTERM reaches it and its children."""
    config = json.dumps({"runtime_env": {}, "metadata": {"job_submission_id": "cost-ab12", "job_name": "cost-ab12"}})
    marker = tmp_path / "got-term"
    script = (f"import signal, subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').write('x'), child.wait(), sys.exit(0)))\n"
              f"print('up', flush=True)\n"
              f"time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, RAY_JOB_CONFIG_JSON_ENV_VAR=config))
    try:
        assert proc.stdout.readline().strip() == "up"
        assert bmod.job_sessions("cost-ab12") == [proc.pid]
        assert bmod.job_sessions("cost-ab1") == []  # the whole id, not a prefix
        assert bmod.term_driver("cost-ab12") == [proc.pid]
        assert proc.wait(20) == 0 and marker.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


class _Api(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        self.seen.append((self.path, self.headers.get("Authorization"), body))
        self.send_response(204 if self.headers.get("Authorization") == "Bearer pod-key" else 403)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_a_machine_ends_itself_with_its_own_key_and_says_what_it_cannot(capsys):
    from rlhf_tasks.providers.runpod.render import SELF_END

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rule = SELF_END.model_dump()
    url = f"http://127.0.0.1:{server.server_address[1]}/v2"
    try:
        assert end_machine(rule, env={"RUNPOD_API_URL": url, "RUNPOD_POD_ID": "p1", "RUNPOD_API_KEY": "pod-key"})
        assert _Api.seen[-1] == ("/v2/pods/p1/action", "Bearer pod-key", {"action": "terminate"})
        assert not end_machine(rule, env={"RUNPOD_API_URL": url, "RUNPOD_POD_ID": "p1", "RUNPOD_API_KEY": "other"})
        assert not end_machine(rule, env={"RUNPOD_POD_ID": "p1"})  # no key here: said, nothing sent
    finally:
        server.shutdown()
    said = capsys.readouterr().out
    assert "could not terminate this pod (RunPod's pod-scoped key): HTTP 403" in said
    assert "cannot terminate this pod (RunPod's pod-scoped key): RUNPOD_API_KEY not set here" in said
    assert "pod-key" not in said and "other" not in said


def test_a_launch_under_the_name_of_a_live_cluster_on_another_provider_is_refused(tmp_path):
    """The record of a live local cluster (one of its agents runs) stays, and the other provider's
    CLI is never called; once its agents are gone (it ended itself, no launcher attached), the
    name is free again."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", log, code=1)
    env = env_with(tmp_path, bin_dir)
    agent = subprocess.Popen(["sleep", "120"])
    try:
        record = {"provider": "local", "cluster_id": "c0ffee00", "pids": [agent.pid], "dashboard": "http://127.0.0.1:1",
                  "job": {"submission_id": "boundary-c0ffee00-r2", "status": "RUNNING"}}
        directory = Path(env["RLHF_TASKS_HOME"]) / "clusters" / "boundary"
        directory.mkdir(parents=True)
        (directory / "cluster.json").write_text(json.dumps(record))
        (directory / "token").write_text("the-token")
        path = tmp_path / "t.yaml"
        path.write_text(yaml.safe_dump({"name": "boundary", "nodes": 2, "job": {
            "recipe": "command", "submit": "head", "working_dir": None, "args": {"entrypoint": "true"}}}))
        out = run_cli(["launch", str(path), "--provider", "dstack"], tmp_path, env)
        assert out.returncode == 2, out.stdout + out.stderr
        assert ("name: a cluster named boundary is live on local (its job boundary-c0ffee00-r2 was last seen "
                "RUNNING)") in out.stderr
        assert "`rlhf-tasks down boundary`" in out.stderr and "nothing was launched" in out.stderr
        assert not log.exists()  # dstack was never called
        assert json.loads((directory / "cluster.json").read_text()) == record
        assert (directory / "token").read_text() == "the-token"
        assert not (Path(env["RLHF_TASKS_HOME"]) / "runs" / "boundary" / "dstack").exists()
    finally:
        agent.kill()
        agent.wait()
    # Its agents are gone: the cluster ended on its own, and the name can be launched elsewhere.
    again = run_cli(["launch", str(path), "--provider", "dstack"], tmp_path, env)
    assert "is live on local" not in again.stderr and log.exists(), again.stderr


def test_a_fork_beside_the_running_watch_prints_no_traceback(tmp_path):
    """Issue 37 (5): the watch is a Thread; an attribute of its own may not hide Thread's `_stop()`,
    which Python calls in every forked child (`Exception ignored in: <function _after_fork>`)."""
    snippet = (
        "import os, sys\n"
        "from rlhf_tasks.agent.budget import Watch\n"
        "w = Watch({'nodes': 1}, lambda: None, kept=False, client=False)\n"
        "w.start()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "w.close(); w.join(10)\n"
        "print('forked')\n")
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert done.returncode == 0 and "forked" in done.stdout, done.stderr
    assert "Exception ignored" not in done.stderr and "not callable" not in done.stderr, done.stderr


def test_the_last_checkpoint_is_the_recipes_newest_checkpoint_file(tmp_path):
    """Issue 37: tiny-grpo's checkpoint dir also holds metrics.jsonl and the prepared data, both
    newer than its last step_NNNNNN.pt: the recipe's own file names decide; none yet: None."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "data").mkdir(parents=True)
    (ckpt / "data" / "prompts.jsonl").write_text("{}\n")
    assert bmod.newest_checkpoint(str(ckpt), ["step_*.pt"]) is None  # only the prepared data: none yet
    for age, name in ((30, "step_000460.pt"), (20, "step_000480.pt"), (10, "metrics.jsonl")):
        (ckpt / name).write_text(name)
        os.utime(ckpt / name, (time.time() - age, time.time() - age))
    (ckpt / "data" / "prompts.jsonl").write_text("{}\n")  # the newest entry of all
    assert bmod.newest_checkpoint(str(ckpt), ["step_*.pt"]) == str(ckpt / "step_000480.pt")
    # verl's global_step_N directories (their files inside count as theirs)
    (ckpt / "global_step_40" / "actor").mkdir(parents=True)
    assert bmod.newest_checkpoint(str(ckpt), ["global_step_*"]) == str(ckpt / "global_step_40")
    # A recipe that knows none (a free command): the newest file, as before
    assert bmod.newest_checkpoint(str(ckpt), []) == str(ckpt / "data" / "prompts.jsonl")
    # but never the head's spend record nor the models' cache, both rewritten there by the agent, not the job
    from rlhf_tasks.agent.protocol import CACHE_DIR
    from rlhf_tasks.agent.protocol.spend import SPEND_FILE
    (ckpt / CACHE_DIR / "huggingface").mkdir(parents=True)
    (ckpt / CACHE_DIR / "huggingface" / "fetched").write_text("done")
    (ckpt / SPEND_FILE).write_text("{}")
    assert bmod.newest_checkpoint(str(ckpt), []) == str(ckpt / "data" / "prompts.jsonl")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / SPEND_FILE).write_text("{}")
    assert bmod.newest_checkpoint(str(empty), []) is None  # a job that never ran has no last checkpoint


def test_the_recipes_say_their_checkpoint_files(tmp_path):
    from rlhf_tasks.spec import load_task
    from rlhf_tasks.providers.local import LocalProvider

    plan = LocalProvider().plan(load_task(str(ROOT / "tasks" / "tiny-grpo.yaml")))
    assert plan.checkpoint_files == ["step_*.pt"]


def test_the_jobs_last_line_is_its_own_not_rays_sigterm_dump():
    from rlhf_tasks.outcome import job_said

    tail = "\n".join([
        "step 480 reward 0.91",
        "saved step_000480.pt",
        "*** SIGTERM received at time=1764318000 on cpu 1 ***",
        "PC: @     0x7f50a1b2c3d4  (unknown)  pthread_cond_timedwait@@GLIBC_2.3.2",
        "    @     0x7f50a1b2c3d4  (unknown)  (unknown)",
        "[2026-11-28 08:00:00,123 E 4242 4242] logging.cc:474: *** SIGTERM received at time=1764318000 on cpu 1 ***",
        "[2026-11-28 08:00:00,124 E 4242 4242] logging.cc:474: PC: @     0x7f50a1b2c3d4  (unknown)  (unknown)",
        "[2026-11-28 08:00:00,124 E 4242 4242] logging.cc:474:     @     0x7f50a1b2c3d4  (unknown)  (unknown)",
        "",
    ])
    assert job_said(tail) == "saved step_000480.pt"


# ---------------------------------------------------------------- issue 48 (1): one cap per training

def test_retry_renders_the_jobs_own_failure_only_when_asked(tmp_path):
    """`retry: true`: dstack's no-capacity and interruption, SkyPilot's max_restarts_on_errors 0; `{errors: N}`:
    dstack's `error` too (the head counts N), SkyPilot's max_restarts_on_errors N."""
    from rlhf_tasks.providers.dstack import DstackProvider
    from rlhf_tasks.providers.sky import SkyProvider
    from rlhf_tasks.spec import load_task

    def plan(provider, retry):
        return provider.plan(load_task(str(task(tmp_path, {"retry": retry}))))
    dstack = DstackProvider()
    assert dstack.task_config(plan(dstack, True), {})["retry"] == {"on_events": ["no-capacity", "interruption"]}
    two = plan(dstack, {"errors": 2})
    assert dstack.task_config(two, {})["retry"] == {"on_events": ["no-capacity", "interruption", "error"]}
    assert two.budget.error_retries == 2 and two.budget.cap_exit == 0
    assert plan(dstack, False).budget.cap_exit == 1 and "retry" not in dstack.task_config(plan(dstack, False), {})
    sky = SkyProvider(managed=True)
    assert sky.task_config(plan(sky, True))["resources"]["job_recovery"] == {
        "strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 0}
    managed = plan(sky, {"errors": 3})
    assert sky.task_config(managed)["resources"]["job_recovery"]["max_restarts_on_errors"] == 3
    assert managed.budget.cap_exit == 0 and managed.budget.error_retries is None  # SkyPilot counts them itself


def test_check_refuses_retries_that_could_spend_past_the_cap_and_says_the_worst_case(tmp_path):
    capped = {"retry": True, "max_cost": 800, "price_per_hour": 40}
    out = check(tmp_path, task(tmp_path, capped), "--provider", "dstack")
    assert out.returncode == 2, out.stdout + out.stderr
    said = " ".join(out.stderr.split())
    assert "placement.retry: dstack relaunches the run after no capacity or an interruption" in said, said
    assert "checkpoints.path /checkpoints/cost is a directory on each node" in said, said
    assert "each attempt may spend up to $801.33 (placement.max_cost $800.00, then placement.stop_grace 120s at " \
           "$40.00/h), with no bound on the attempts" in said, said
    assert "checkpoints.shared.dstack" in said, said
    # SkyPilot: `check` cannot know whether `launch --managed` runs it (SkyPilot recovers a managed job's
    # preempted cluster, with no count): said at check, refused by `launch --managed`
    unshared = task(tmp_path, capped, checkpoints={"path": "/ckpt"})
    sky = check(tmp_path, unshared, "--provider", "sky")
    assert sky.returncode == 0 and "warning: with `launch --managed`: placement.retry: sky relaunches the run after " \
        "a preemption" in sky.stderr, sky.stderr
    from rlhf_tasks.errors import BadInput
    from rlhf_tasks.providers.sky import SkyProvider
    from rlhf_tasks.spec import load_task
    with pytest.raises(BadInput, match="a preempted cluster is recovered with no count"):
        SkyProvider(managed=True).plan(load_task(str(unshared)))
    # Shared checkpoints: every attempt's head reads the spend record there, and `check` says so
    shared = {"path": "/checkpoints/cost", "shared": {"dstack": {"host_path": "/mnt/nfs/cost"}}}
    ok = subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", "check", str(task(tmp_path, capped, checkpoints=shared)),
                         "--provider", "dstack"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=str(ROOT), RLHF_TASKS_HOME=str(tmp_path / "home")))
    assert ok.returncode == 0, ok.stderr
    words = " ".join(ok.stdout.split())
    assert "at most about $801.33" in words and "over every attempt of the training" in words, words
    assert "one cap for the training, whatever restarts it" in words and \
        "/checkpoints/cost/.rlhf-tasks-spend.json" in words and "exit status 0, which dstack does not relaunch" in words
    # No cap: nothing to hold across attempts; errors where the provider relaunches none: refused
    assert check(tmp_path, task(tmp_path, {"retry": True}), "--provider", "dstack").returncode == 0
    slurm = check(tmp_path, task(tmp_path, {"retry": {"errors": 2}}), "--provider", "slurm")
    assert slurm.returncode == 2 and "placement.retry.errors: the slurm provider does not relaunch" in slurm.stderr


def test_the_head_counts_the_trainings_spend_over_its_attempts(tmp_path):
    """A relaunched attempt's head reads the spend record the attempts before it wrote (and the launcher's
    own, the plan's `spent`), stops at what is left of the training's cap, and writes its own attempt there."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    path = ckpt / bmod.SPEND_FILE
    earlier = {"a1": {"seconds": 1.5, "cost": 1.5, "ended": "failed"}}
    bmod.write_spend(str(path), {"version": 1, "training": "cost", "attempts": earlier})
    budget = {"price_per_hour": 3600.0, "max_cost": 2.5, "stop_grace_s": 0.0, "training": "cost",
              "spent": {"a0": {"seconds": 0.5, "cost": 0.5, "ended": "failed"}, "a1": {"seconds": 1.0, "cost": 1.0}}}
    ended = []
    watch = bmod.Watch({"nodes": 1, "budget": budget, "checkpoint_dir": str(ckpt)}, lambda: [], kept=False,
                       client=False)
    watch._end = lambda ending, report, followed=False: ended.append((ending, report))
    assert (watch.spend.seconds_before, watch.spend.cost_before, watch.spend.failed_before) == (2.0, 2.0, 2)
    started = time.monotonic()
    watch.start()
    watch.join(20)
    took = time.monotonic() - started
    assert ended and 0.4 <= took < 5, (ended, took)  # $0.50 left at $1 a second
    report = ended[0][1]
    assert report["capped"] and report["attempts"] == 3 and 2.45 <= report["cost"] <= 2.7, report
    assert report["words"].startswith("stopped at the budget cap: $2.5") and \
        "over 3 attempts (placement.max_cost $2.50)" in report["words"], report["words"]
    record = json.loads(path.read_text())
    assert record["training"] == "cost" and set(record["attempts"]) == {"a0", "a1", watch.spend.attempt}
    assert record["attempts"][watch.spend.attempt]["ended"] == "capped"
    # Another training's record (moved aside by --fresh, a name reused) counts for nothing
    assert bmod.read_spend(str(path), "cost-20261201T000000Z") == {}


def test_a_head_ends_at_the_cap_and_at_the_last_allowed_failure_with_the_providers_exit(tmp_path):
    """The head agent's exit status (what the provider's retry reads) at a cap, and at a failure once the
    training used its placement.retry.errors; the result line keeps saying the run did not finish."""
    from rlhf_tasks.agent.__main__ import settle_spend

    def flow(before, error_retries, capped=False):
        budget = {"price_per_hour": 1.0, "max_cost": 100.0, "training": "t", "cap_exit": 0,
                  "error_retries": error_retries, "spent": before}
        watch = bmod.Watch({"nodes": 1, "budget": budget, "checkpoint_dir": str(tmp_path / "ckpt")}, lambda: [],
                           kept=False, client=False)
        if capped:
            watch.report = {"capped": True}

        class Flow:
            plan = {"budget": budget}
        Flow.watch = watch
        return Flow()
    failed = {"a": {"seconds": 1, "cost": 0.1, "ended": "failed"}}
    result = {"exit_code": 1}
    assert settle_spend(flow({}, 1), result, signalled=False) is None  # the first failure: the provider relaunches it
    assert result["spend"]["attempts"] and list(result["spend"]["attempts"].values())[0]["ended"] == "failed"
    assert settle_spend(flow(failed, 1), {"exit_code": 1}, signalled=False) == 0  # the last one allowed
    assert settle_spend(flow(failed, None), {"exit_code": 1}, signalled=False) is None  # the head counts none
    assert settle_spend(flow({}, None, capped=True), {"exit_code": 1}, signalled=False) == 0
    assert settle_spend(flow(failed, 1), {"exit_code": 143}, signalled=True) is None  # stopped: no failure of its own


def test_a_launch_continues_the_trainings_spend_and_refuses_one_already_at_its_cap(tmp_path):
    """The launcher's record of the training (runs/NAME/spend.json): a launch without --fresh hands it to the
    head (the plan's budget.spent) and refuses, before anything is rented, a training already at its cap;
    `--fresh` starts a new training."""
    from rlhf_tasks import state

    home = tmp_path / "home"
    spend = home / "runs" / "cost" / "spend.json"
    spend.parent.mkdir(parents=True)
    spend.write_text(json.dumps({"version": 1, "training": "cost", "attempts": {
        "a": {"seconds": 3000, "cost": 8.0, "ended": "failed"}, "b": {"seconds": 700, "cost": 2.0, "ended": "capped"}}}))
    path = task(tmp_path, {"max_cost": 10, "price_per_hour": 9.6})
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", log, code=1)
    env = dict(env_with(tmp_path, bin_dir), RLHF_TASKS_HOME=str(home))
    out = run_cli(["launch", str(path), "--provider", "dstack"], tmp_path, env)
    assert out.returncode == 2, out.stdout + out.stderr
    said = " ".join(out.stderr.split())
    assert "placement.max_cost: the training cost spent $10.00 over 1 h 02 m in 2 attempts already" in said, said
    assert "launch --fresh" in said and "nothing was launched" in said, said
    assert not log.exists()  # dstack was never called
    os.environ["RLHF_TASKS_HOME"], old = str(home), os.environ.get("RLHF_TASKS_HOME")
    try:
        assert state.training("cost")["training"] == "cost" and len(state.training("cost")["attempts"]) == 2
        fresh = state.training("cost", "20261201T000000Z")
        assert fresh == {"version": 1, "training": "cost-20261201T000000Z", "attempts": {}}
    finally:
        if old is None:
            del os.environ["RLHF_TASKS_HOME"]
        else:
            os.environ["RLHF_TASKS_HOME"] = old


SKY_RECOVERY = '''
import asyncio, json, sys
from rlhf_tasks.providers.sky import SkyProvider
from rlhf_tasks.spec import parse_task
import sky
from sky import backends
from sky.jobs import recovery_strategy

async def restarts(retry):
    task = {"name": "rj", "nodes": 1, "placement": {"retry": retry},
            "job": {"recipe": "command", "submit": "head", "working_dir": None, "args": {"entrypoint": "true"}}}
    provider = SkyProvider(managed=True)
    config = provider.task_config(provider.plan(parse_task(task, "t.yaml")))
    executor = recovery_strategy.StrategyExecutor.make("rj", backends.CloudVmRayBackend(), sky.Task.from_yaml_config(
        config), 1, 0, None, set(), asyncio.Lock(), asyncio.Condition())
    return [executor.should_restart_on_failure(exit_codes=[1]) for _ in range(4)]

print(json.dumps({"true": asyncio.run(restarts(True)), "errors": asyncio.run(restarts({"errors": 2}))}))
'''


def test_skypilots_managed_job_restarts_the_jobs_failure_only_as_often_as_retry_errors_says(tmp_path):
    """SkyPilot's own managed-jobs code (sky/jobs/recovery_strategy.py: StrategyExecutor.make from the rendered
    task, should_restart_on_failure as its controller asks it after each user-code failure): `retry: true`
    restarts no failure; `retry: {errors: 2}` two, then none."""
    out = subprocess.run([sys.executable, "-c", SKY_RECOVERY], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"true": [False] * 4,
                                                               "errors": [True, True, False, False]}
