"""Messages that must be true (issue 20, items 6-8): what `submit` says of a job that already
ran and how to run it again, what `down` says of the job it stops and what the record keeps,
and what Ctrl-C before the job's command started does. No cluster: a stand-in for the
dashboard's Jobs and State API, and the head agent's log as a file."""

from __future__ import annotations

import io
import json

import pytest

from rlhf_tasks import state
from played_http import JsonHandler, PlayedServer
from rlhf_tasks.cli import main


class FakeDashboard(PlayedServer):
    """Ray's Jobs API (submit, status, list, logs, stop) and the State API's nodes, in memory."""

    def __init__(self):
        self.jobs: dict[str, str] = {}
        self.logs: dict[str, str] = {}
        self.submitted: list[str] = []
        fake = self

        class Handler(JsonHandler):
            def do_GET(self):
                path = self.path.split("?")[0].rstrip("/")
                if path == "/api/v0/nodes":
                    return self.answer(200, {"data": {"result": {"result": [
                        {"node_ip": "127.0.0.1", "node_id": "h", "is_head_node": True}]}}})
                if path == "/api/jobs":
                    return self.answer(200, [{"submission_id": sid, "status": status, "start_time": i}
                                             for i, (sid, status) in enumerate(fake.jobs.items())])
                parts = path.split("/")
                sid = parts[3] if len(parts) > 3 else ""
                if sid not in fake.jobs:
                    return self.answer(404, {})
                if path.endswith("/logs"):
                    return self.answer(200, {"logs": fake.logs.get(sid, "")})
                return self.answer(200, {"status": fake.jobs[sid]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                path = self.path.rstrip("/")
                if path == "/api/jobs":
                    fake.jobs[body["submission_id"]] = "RUNNING"
                    fake.submitted.append(body["submission_id"])
                    return self.answer(200, {"submission_id": body["submission_id"]})
                sid = path.split("/")[3]
                if sid not in fake.jobs:
                    return self.answer(404, {})
                fake.jobs[sid] = "STOPPED"
                return self.answer(200, {"stopped": True})

        self.serve(Handler)


@pytest.fixture
def dashboard():
    fake = FakeDashboard()
    yield fake
    fake.close()


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nnodes: 2\njob:\n  recipe: command\n  submit: client\n  working_dir: null\n  args: {entrypoint: 'true'}\n")
    return str(path)


def test_submit_of_a_job_that_ended_says_its_state_and_how_to_run_it_again(dashboard, task_file, rlhf_home, capsys):
    state.save("t", {"provider": "local", "cluster_id": "c1", "dashboard": dashboard.url})
    dashboard.jobs["t-c1"] = "SUCCEEDED"
    assert main(["submit", task_file, "--address", dashboard.url]) == 0
    out = capsys.readouterr().out
    assert "t-c1 is already on this cluster and ended SUCCEEDED" in out and "follow it with" not in out
    assert f"run it again (as the next submission id) with: rlhf-tasks submit {task_file} --address " \
           f"{dashboard.url} --again" in out
    assert dashboard.submitted == []

    assert main(["submit", task_file, "--address", dashboard.url, "--again"]) == 0
    assert "submitted t-c1-r1" in capsys.readouterr().out and dashboard.submitted == ["t-c1-r1"]
    # while that one runs, --again refuses a second run beside it (one checkpoint directory)
    assert main(["submit", task_file, "--address", dashboard.url, "--again"]) == 2
    assert "--again: job t-c1-r1 of t is still RUNNING on this cluster" in capsys.readouterr().err
    assert main(["submit", task_file, "--address", dashboard.url]) == 0
    assert "t-c1 is already on this cluster and ended SUCCEEDED" in capsys.readouterr().out
    dashboard.jobs["t-c1-r1"] = "FAILED"
    assert main(["submit", task_file, "--address", dashboard.url, "--again"]) == 0
    assert "submitted t-c1-r2" in capsys.readouterr().out and dashboard.submitted == ["t-c1-r1", "t-c1-r2"]


def local_record(dashboard_url: str, tmp_path) -> dict:
    """A local cluster's record whose agents are gone already: `down` has nothing to kill."""
    return {"provider": "local", "cluster_id": "c1", "pids": [], "temp_dir": str(tmp_path / "ray"),
            "dashboard": dashboard_url, "run_dir": str(tmp_path / "run")}


def test_down_says_which_job_it_stops_and_the_record_keeps_it(dashboard, tmp_path, rlhf_home, capsys):
    state.save("t", local_record(dashboard.url, tmp_path))
    dashboard.jobs.update({"preflight_c1": "SUCCEEDED", "t-c1": "RUNNING"})
    assert main(["down", "t"]) == 0
    out = capsys.readouterr().out
    assert "t: job t-c1 is RUNNING: stopping the cluster stops it" in out
    assert "stopped job t-c1 with the cluster (it was RUNNING)" in out
    record = state.load("t")
    assert record["ended"] and record["job"] == {"submission_id": "t-c1", "status": "STOPPED",
                                                 "how": "stopped by `rlhf-tasks down` while RUNNING"}
    assert main(["down", "t"]) == 0  # what is known of it afterwards
    assert "its job t-c1 ended STOPPED (stopped by `rlhf-tasks down` while RUNNING)" in capsys.readouterr().out


def test_down_after_the_job_ended_keeps_its_end_and_claims_no_stop(dashboard, tmp_path, rlhf_home, capsys):
    state.save("t", local_record(dashboard.url, tmp_path))
    dashboard.jobs.update({"t-c1": "FAILED", "t-c1-r1": "SUCCEEDED"})
    assert main(["down", "t"]) == 0
    assert "stopped job" not in capsys.readouterr().out
    assert state.load("t")["job"] == {"submission_id": "t-c1-r1", "status": "SUCCEEDED"}


def test_down_without_an_answering_dashboard_names_the_job_last_seen(tmp_path, rlhf_home, capsys):
    record = local_record("http://127.0.0.1:9", tmp_path)  # nothing listens there
    state.save("t", {**record, "job": {"submission_id": "t-c1", "status": "RUNNING"}})
    assert main(["down", "t"]) == 0
    assert "job t-c1 was last seen RUNNING (the dashboard did not answer): stopping the cluster stops it" in \
        capsys.readouterr().out
    assert state.load("t")["job"]["status"] == "STOPPED"


def fake_provider(tmp_path, head_log: str):
    """A dstack-planned provider whose cluster is two log files on this machine: Ctrl-C lands
    while the launcher follows the head's log (its `tend`), after `head_log` was written."""
    from rlhf_tasks.providers import Cluster
    from rlhf_tasks.providers.dstack import DstackProvider

    logs = [tmp_path / "node-0.log", tmp_path / "node-1.log"]
    logs[0].write_text(head_log)

    class Fake(DstackProvider):
        downs: list[str] = []

        def ready(self, plan):
            pass

        def apply(self, plan, secrets):
            state.save(plan.name, {"provider": "dstack", "cluster_id": "c1"})

            def tend():
                raise KeyboardInterrupt
            return Cluster(name=plan.name, cluster_id="c1", token=None, head_alive=lambda: True,
                           node_logs=[str(p) for p in logs], tend=tend)

        def down(self, name):
            self.downs.append(name)
            state.end(name)
            return f"stopped {name}"

    return Fake()


def ctrl_c_task():
    from rlhf_tasks.spec import parse_task

    return parse_task({"name": "t", "nodes": 2, "wait": {"head": "1m", "nodes": "1m"},
                       "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}})


def test_ctrl_c_before_the_job_started_cancels_it_by_stopping_the_cluster(tmp_path, rlhf_home, capsys):
    """The head would submit and run the job on its own with nobody following: the launch is
    cancelled instead, and says so (issue 20, item 6)."""
    from rlhf_tasks.launch import launch

    provider = fake_provider(tmp_path, "[10:00:00] node0: Ray head up\n[10:00:01] node0: waiting for 2 nodes\n")
    assert launch(ctrl_c_task(), provider) == 130
    out = capsys.readouterr().out
    assert provider.downs == ["t"]
    assert "interrupted while waiting for the job to end" in out  # what the launcher was waiting for (item 12)
    assert "interrupted before the job's command started: stopping the cluster t, so that the job does not run" in out
    assert "stopped t" in out and "the job of t did not run" in out
    assert "keeps running" not in out
    assert state.load("t")["ended"]


def test_ctrl_c_once_the_job_runs_stops_following_only(tmp_path, rlhf_home, capsys):
    from rlhf_tasks.agent.protocol import JOB_STARTS
    from rlhf_tasks.launch import launch

    provider = fake_provider(tmp_path, "[10:00:00] node0: Ray head up\n[10:00:05] node0: "
                             + JOB_STARTS % "t-c1" + " (it was submitted while the nodes joined)\n")
    assert launch(ctrl_c_task(), provider) == 130
    out = capsys.readouterr().out
    assert provider.downs == []
    assert "stopped following; job t-c1 keeps running. Stop it with: rlhf-tasks stop t-c1 --cluster t" in out
    # Issue 30: without --keep the head ends the cluster when the job ends, launcher or not.
    assert "the cluster ends itself when the job ends (or now: rlhf-tasks down t)" in out


def test_the_launcher_records_the_job_running_once_the_head_lets_it_start(tmp_path):
    """What `down` falls back on where the dashboard does not answer from here (item 8)."""
    from rlhf_tasks.agent.protocol import JOB_STARTS, started_job
    from rlhf_tasks.follow import LogTail, follow_head_log

    provider = fake_provider(tmp_path, "[10:00:00] node0: waiting for 2 nodes\n")
    plan = provider.plan(ctrl_c_task())
    assert started_job((tmp_path / "node-0.log").read_text()) is None
    with open(tmp_path / "node-0.log", "a") as handle:
        handle.write(f"[10:00:05] node0: {JOB_STARTS % 't-c1'} (it was submitted while the nodes joined)\n"
                     "RLHF_TASKS_RESULT " + json.dumps({"exit_code": 0, "job": {"submission_id": "t-c1",
                                                                                 "status": "SUCCEEDED"}}) + "\n")
    from rlhf_tasks.providers import Cluster

    seen = []
    cluster = Cluster(name="t", cluster_id="c1", token=None, head_alive=lambda: False,
                      node_logs=[str(tmp_path / "node-0.log")])
    tail = LogTail(cluster.node_logs, out=io.StringIO())
    assert follow_head_log(cluster, plan, tail, on_start=seen.append).status == "SUCCEEDED"
    assert seen == ["t-c1"]


def preflight_log() -> tuple[str, dict]:
    from rlhf_tasks.agent.protocol import PREFLIGHT_PREFIX

    result = {"passed": True, "failed_step": None, "seconds": 2.4, "nodes": [{"node": f"node{i}"} for i in range(2)],
              "table": ["node   address     gpus  bandwidth", "node0  10.0.0.1    0     -",
                        "node1  10.0.0.2    0     930 Mbit/s"],
              "notes": ["torch 2.13 on every node"], "warnings": ["node1: /dev/shm is 64 MiB"], "failures": [],
              "facts": {"pad": "x" * 4000}}
    log = ("gate: preflight starts\n" + PREFLIGHT_PREFIX + json.dumps(result) + "\n"
           "gate: go\nstep 1/10 reward 0.1\n")
    return log, result


@pytest.mark.parametrize("follow", [False, True])
def test_logs_shows_preflight_as_the_launcher_does_and_raw_only_when_asked(follow, dashboard, rlhf_home, capsys):
    """Issue 32, item 7: not the 4 KB JSON line preflight's gate prints for the head."""
    log, result = preflight_log()
    dashboard.jobs["t-1"] = "SUCCEEDED"
    dashboard.logs["t-1"] = log
    extra = ["--follow"] if follow else []
    assert main(["logs", "t-1", "--address", dashboard.url, *extra]) == 0
    out = capsys.readouterr().out
    assert "RLHF_TASKS_PREFLIGHT" not in out and "xxxx" not in out, out
    assert out == ("gate: preflight starts\npreflight passed in 2.4s: 2 nodes\n" + "\n".join(result["table"]) +
                   "\npreflight: torch 2.13 on every node\npreflight WARNING: node1: /dev/shm is 64 MiB\n"
                   "gate: go\nstep 1/10 reward 0.1\n"), out
    assert main(["logs", "t-1", "--address", dashboard.url, "--raw", *extra]) == 0
    assert capsys.readouterr().out == log


def test_ctrl_c_while_pods_never_left_says_what_was_awaited_and_what_is_left(tmp_path, rlhf_home, capsys):
    """Issue 32, item 12: Ctrl-C while the launcher waits for pods that stay Pending, and a
    `down` whose wait for them to go runs out: not "not ready after 120s", but what was
    awaited, and what is left running as the provider reports it."""
    from rlhf_tasks.agent.protocol import wait_for
    from rlhf_tasks.launch import launch
    from rlhf_tasks.providers.dstack import DstackProvider

    class Stuck(DstackProvider):
        def ready(self, plan):
            pass

        def apply(self, plan, secrets):
            state.save(plan.name, {"provider": "dstack", "cluster_id": "c1"})
            asked = []

            def pending():
                asked.append(1)
                if len(asked) == 3:
                    raise KeyboardInterrupt  # the user's Ctrl-C, in the middle of the wait
                return False, "0/2 pods left Pending"
            wait_for("2 pods to leave Pending", pending, 600, interval=0.01)

        def down(self, name):
            return wait_for(f"the pods of {name} to go", lambda: (False, "2 pods left: t-head, t-worker"), 0.05,
                            interval=0.01)

        def status(self, name):
            return "pod t-head: Pending (Unschedulable)\npod t-worker: Pending (Unschedulable)"

    assert launch(ctrl_c_task(), Stuck()) == 130
    out = capsys.readouterr().out
    assert "interrupted while waiting for 2 pods to leave Pending, 0s of 600s (last: 0/2 pods left Pending)\n" in out
    assert "interrupted before the job's command started" in out, out
    assert "could not stop it (waiting for the pods of t to go failed: still not so after 0s (last: 2 pods left: " \
           "t-head, t-worker))" in out, out
    assert "what is left of it:\n  pod t-head: Pending (Unschedulable)\n  pod t-worker: Pending" in out, out
    assert "not ready" not in out
