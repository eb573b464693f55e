"""Issue 30 on the RunPod stand-in, each pod a namespace host: pods that end themselves with the
key RunPod scopes to each pod (the launcher SIGKILLed once the job's command started), and
placement.max_duration enforced by the head agent at the price RunPod bills its pod (its `cost`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import yaml

import testbed as tbmod
from conftest import ROOT
from runpod_standin import RunPodStandIn, TestbedRunner
from test_runpod_provider import (KEY, NetnsRelay, assert_key_nowhere, cli_env, command_task, image, live_pods,
                                  run_cli, write_task)
from testbed import LAPTOP_IP, poll

testbed3 = tbmod.make_testbed_fixture(3, scope="module")


def standin(tb) -> tuple[RunPodStandIn, NetnsRelay]:
    """The stand-in, reachable from the pods through a relay on the laptop's address (as RunPod's
    pods reach api.runpod.io)."""
    api = RunPodStandIn(TestbedRunner(tb, entrypoint=image(tb)), api_key=KEY)
    api.start()
    relay = NetnsRelay(tb.laptop.netns, int(api.url.split(":")[2].split("/")[0]), address=LAPTOP_IP)
    api.pod_api_url = f"http://{LAPTOP_IP}:{relay.port}/v2"
    return api, relay


def finish(tb, api: RunPodStandIn, relay: NetnsRelay) -> None:
    api.close()
    relay.close()
    for host in range(3):
        assert tb.processes(host) == [], f"processes left on node{host}"
    assert api.errors == [], "the stand-in broke RunPod's contract or crashed"


def head_log(api: RunPodStandIn) -> str:
    head = next(p for p in api.pods.values() if p.name.endswith("-head"))
    return "\n".join(entry.line for entry in head.logs)


def terminates(api: RunPodStandIn) -> dict[str, str]:
    """Pod id -> whose key ended it, for each terminate the stand-in has answered."""
    with api._cond:
        return {r.path.split("/")[3]: r.by for r in api.requests if r.path.endswith("/action") and r.status == 204}


def test_with_the_launcher_killed_every_pod_ends_itself_after_the_head_said_its_result(testbed3, tmp_path):
    api, relay = standin(testbed3)
    try:
        entry = "python3 -c 'import time; print(\"started\", flush=True); time.sleep(20); print(\"finished\", flush=True)'"
        task = write_task(tmp_path, command_task(nodes=3, preflight="off", job={
            "recipe": "command", "submit": "head", "working_dir": None, "args": {"entrypoint": entry}}))
        launch = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", task, "--provider", "runpod", "-y"],
                                  env=cli_env(tmp_path, api.url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=tmp_path)
        seen = []
        for line in launch.stdout:
            seen.append(line)
            if line.startswith("started"):
                break
        assert seen and seen[-1].startswith("started"), "".join(seen)
        launch.send_signal(signal.SIGKILL)  # no `down`, no log streams: only the pods themselves
        launch.wait(30)
        said = "".join(seen)
        pods = sorted(p.id for p in api.pods.values())
        assert len(pods) == 3 and len(live_pods(api)) == 3
        poll(lambda: "RLHF_TASKS_RESULT" in head_log(api), 180, "the head's result line")
        said_at = time.monotonic()
        result = json.loads(head_log(api).split("RLHF_TASKS_RESULT ")[1].splitlines()[0])
        assert result["job"]["status"] == "SUCCEEDED" and "finished" in head_log(api)
        # The stand-in marks a pod TERMINATED, stops its container, then answers (and records) the
        # terminate: wait for the answers, not only the status.
        poll(lambda: live_pods(api) == [] and len(terminates(api)) == 3, 60, "every pod to be terminated")
        assert time.monotonic() - said_at <= 60
        # Each pod ended itself, with its own key; nothing used the account's key after the launcher died.
        assert terminates(api) == {pod: f"pod:{pod}" for pod in pods}, terminates(api)
        assert all(r.body == {"action": "terminate"} for r in api.requests if r.path.endswith("/action"))
        assert_key_nowhere(said, directories=(tmp_path, testbed3.dir))
    finally:
        if launch.poll() is None:
            launch.kill()
        finish(testbed3, api, relay)


def test_max_duration_on_runpod_stops_the_job_and_the_pods_end(testbed3, tmp_path):
    api, relay = standin(testbed3)
    try:
        ckpt = tmp_path / "ckpt"
        script = tmp_path / "job.py"
        from test_cost_local import CHECKPOINTING
        script.write_text(CHECKPOINTING)
        task = command_task(nodes=2, preflight="off", placement={"max_duration": "40s", "stop_grace": "15s"},
                            checkpoints={"path": str(ckpt), "resume": "never"},
                            job={"recipe": "command", "submit": "head", "working_dir": None,
                                 "args": {"entrypoint": f"python3 {script} {ckpt}"}})
        out = run_cli(["launch", write_task(tmp_path, task), "--provider", "runpod", "-y"],
                      cli_env(tmp_path, api.url), timeout=600)
        said = out.stdout + out.stderr
        (tmp_path / "launch.out").write_text(said)
        assert out.returncode == 1, said[-5000:]
        assert "budget: $" in out.stdout and "the job is stopped after 0 h 01 m (max_duration)" in out.stdout
        # The head counts what RunPod bills its pod (the stand-in: 1.1 x the catalog's $0.40), read with its own key.
        assert "budget: counting RunPod's `cost` of this pod, $0.4400/h, for each of the 2 nodes: $0.88/h (the " \
               "plan's price, from the catalog: $0.80/h)" in out.stdout, out.stdout[-3000:]
        assert "budget: $0.88/h for the 2 nodes" in out.stdout
        summary = out.stdout.split("== summary ==")[1]
        assert "stopped at the budget cap: $" in summary and "(placement.max_duration 0 h 01 m)" in summary
        assert f"the last checkpoint: {ckpt / 'final.json'}" in summary and (ckpt / "final.json").exists()
        assert "failed: the budget cap" in out.stderr
        poll(lambda: live_pods(api) == [], 60, "every pod to be terminated")
        assert_key_nowhere(said, directories=(tmp_path, testbed3.dir))
    finally:
        finish(testbed3, api, relay)
