"""Issue 30 on real local clusters: one live cluster per name (the issue's scenario, the second
launch through a stand-in `dstack` on PATH), the head stopping a run at its budget cap, a
cluster ending itself with its launcher SIGKILLed, and a kept cluster ending itself when idle."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml

from conftest import ROOT
from rlhf_tasks.agent.processes import pid_alive
from test_e2e_local import no_leftovers
from test_provider_launch import fake_cli
from testbed import poll

#: A job that checkpoints every second into $CKPT, and on SIGTERM writes a last checkpoint (with
#: when the signal came) and exits: what a framework does with placement.stop_grace.
CHECKPOINTING = r"""
import json, os, signal, sys, time
ckpt = sys.argv[1]
os.makedirs(ckpt, exist_ok=True)
def last(signum, frame):
    with open(os.path.join(ckpt, "final.json"), "w") as out:
        json.dump({"sigterm_at": time.time()}, out)
    print("checkpointed at SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, last)
print("started", flush=True)
step = 0
while True:
    step += 1
    with open(os.path.join(ckpt, "step-%d" % step), "w") as out:
        out.write(str(step))
    time.sleep(1)
"""


def write_task(tmp_path: Path, name: str, entrypoint: str, placement: dict | None = None,
               checkpoints: Path | None = None) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "nodes": 2, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
        "placement": placement or {}, **({"checkpoints": {"path": str(checkpoints)}} if checkpoints else {}),
        "job": {"recipe": "command", "submit": "head", "working_dir": None, "args": {"entrypoint": entrypoint}}}))
    return path


def cli(tmp_path, env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "rlhf_tasks.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def launch_until(task: Path, cwd: Path, env: dict, word: str, *extra: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_tasks.cli", "launch", str(task), *extra], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(word):
            return proc, seen
    raise AssertionError("the launch ended before its job said %r:\n%s" % (word, "".join(seen)))


def record(home: Path, name: str) -> dict:
    return json.loads((home / "clusters" / name / "cluster.json").read_text())


def head_started(log: Path) -> float:
    """When the head agent began: its log's first timestamp, today."""
    stamp = re.match(r"\[(\d\d:\d\d:\d\d)\]", log.read_text()).group(1)
    today = datetime.now().strftime("%Y-%m-%d")
    return datetime.strptime(f"{today} {stamp}", "%Y-%m-%d %H:%M:%S").timestamp()


def test_a_second_provider_under_the_name_of_a_live_cluster_is_refused(tmp_path, cli_env, rlhf_home):
    """The issue's scenario: a local cluster kept with its job RUNNING, then the same task on
    another provider (dstack's CLI a stand-in on PATH): refused, exit 2, nothing written; the
    local cluster stays reachable with `env`, `status` and `down`, which names the job it stops,
    and the record keeps it (issue 20, item 8)."""
    task = write_task(tmp_path, "named", "python3 -c 'import time; print(\"started\", flush=True); time.sleep(600)'")
    proc, seen = launch_until(task, tmp_path, cli_env, "started", "--keep")
    bin_dir, calls = tmp_path / "bin", tmp_path / "dstack-calls.jsonl"
    bin_dir.mkdir()
    fake_cli(bin_dir, "dstack", calls, code=0)
    try:
        proc.send_signal(signal.SIGINT)  # stop following; the kept cluster and its job run on
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 130 and "keeps running" in rest, "".join(seen) + rest
        before = (rlhf_home / "clusters" / "named" / "cluster.json").read_text()
        token = (rlhf_home / "clusters" / "named" / "token").read_text()
        sid = f"named-{json.loads(before)['cluster_id']}"
        env = dict(cli_env, PATH=f"{bin_dir}{os.pathsep}{cli_env['PATH']}")
        second = cli(tmp_path, env, "launch", str(task), "--provider", "dstack")
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"name: a cluster named named is live on local (its job {sid} is RUNNING)" in second.stderr
        assert "`rlhf-tasks down named`" in second.stderr
        assert not calls.exists() and not (rlhf_home / "runs" / "named" / "dstack").exists()
        assert (rlhf_home / "clusters" / "named" / "cluster.json").read_text() == before
        assert (rlhf_home / "clusters" / "named" / "token").read_text() == token
        # Still reachable: its shell setup, its job, and `down`.
        shell = cli(tmp_path, cli_env, "env", "named")
        assert shell.returncode == 0 and f"export RAY_API_SERVER_ADDRESS={json.loads(before)['dashboard']}" in shell.stdout
        status = cli(tmp_path, cli_env, "status", sid, "--cluster", "named")
        assert status.returncode == 0 and status.stdout.strip() == "RUNNING", status.stdout + status.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        down = cli(tmp_path, cli_env, "down", "named")
    assert down.returncode == 0 and "stopped local cluster named" in down.stdout, down.stdout + down.stderr
    assert f"named: job {sid} is RUNNING: stopping the cluster stops it" in down.stdout, down.stdout
    assert f"stopped job {sid} with the cluster (it was RUNNING)" in down.stdout, down.stdout
    ended = record(rlhf_home, "named")
    assert ended["ended"] and ended["job"] == {"submission_id": sid, "status": "STOPPED",
                                              "how": "stopped by `rlhf-tasks down` while RUNNING"}
    assert no_leftovers(ended["cluster_id"])


def test_the_head_stops_the_run_at_its_budget_cap(tmp_path, cli_env, rlhf_home):
    """$36/h is a cent a second: max_cost $0.45 is reached 45 s after the head starts. The job's
    driver gets SIGTERM then (within 10%), checkpoints in its grace, and the summary says so."""
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "job.py"
    script.write_text(CHECKPOINTING)
    task = write_task(tmp_path, "capped", f"python3 {script} {ckpt}",
                      {"price_per_hour": 36, "max_cost": 0.45, "stop_grace": "20s"}, checkpoints=ckpt)
    out = cli(tmp_path, cli_env, "launch", str(task), timeout=400)
    said = out.stdout + out.stderr
    (tmp_path / "launch.out").write_text(said)
    assert out.returncode == 1, said[-5000:]
    assert "failed: the budget cap: stopped at the budget cap: $0.45 after 0 h 01 m" in out.stderr, said[-3000:]
    head_log = rlhf_home / "runs" / "capped" / "nodes" / "node-0.log"
    sigterm_at = json.loads((ckpt / "final.json").read_text())["sigterm_at"]
    after = sigterm_at - head_started(head_log)
    assert abs(after - 45) <= 4.5 + 1, f"SIGTERM {after:.1f}s after the head started, not 45s"
    assert "budget: $36.00/h for the 2 nodes" in out.stdout and "80% of the cap reached" in out.stdout
    assert "checkpointed at SIGTERM" in out.stdout
    summary = out.stdout.split("== summary ==")[1]
    assert "stopped at the budget cap: $0.45 after 0 h 01 m (placement.max_cost $0.45)" in summary
    assert f"the last checkpoint: {ckpt / 'final.json'}" in summary
    assert "the job's last line: checkpointed at SIGTERM" in summary  # its own, not Ray's (issue 37)
    assert "Exception ignored" not in said  # the budget watch's after-fork TypeError (issue 37)
    rec = record(rlhf_home, "capped")
    assert rec["ended"] and rec["budget"]["checkpoint"] == str(ckpt / "final.json")
    ended = cli(tmp_path, cli_env, "status", "capped")
    said = ended.stdout + ended.stderr  # `status NAME` shows an ended cluster (how it ended) on stdout
    assert "stopped at the budget cap: $0.45" in said and str(ckpt / "final.json") in said
    assert no_leftovers(rec["cluster_id"])
    # The cap is the training's (issue 48): the launcher keeps its spend from the head's result line, the head
    # its record beside the checkpoints, and a launch again without --fresh is refused before anything starts
    kept = json.loads((rlhf_home / "runs" / "capped" / "spend.json").read_text())
    beside = json.loads((ckpt / ".rlhf-tasks-spend.json").read_text())
    assert kept["training"] == beside["training"] == "capped" and kept["attempts"] == beside["attempts"], (kept, beside)
    assert [a["ended"] for a in kept["attempts"].values()] == ["capped"], kept
    again = cli(tmp_path, cli_env, "launch", str(task), timeout=120)
    assert again.returncode == 2 and "placement.max_cost: the training capped spent $0.4" in again.stderr and \
        "launch --fresh" in again.stderr, again.stdout + again.stderr


def test_with_its_launcher_killed_the_cluster_ends_itself_after_the_job(tmp_path, cli_env, rlhf_home):
    task = write_task(tmp_path, "orphan", "python3 -c 'import time; print(\"started\", flush=True); time.sleep(15); "
                                          "print(\"finished\", flush=True)'")
    proc, seen = launch_until(task, tmp_path, cli_env, "started")
    proc.kill()  # SIGKILL: no `down`, nobody follows
    proc.wait(30)
    rec = record(rlhf_home, "orphan")
    head_log = rlhf_home / "runs" / "orphan" / "nodes" / "node-0.log"
    poll(lambda: "RLHF_TASKS_RESULT" in head_log.read_text(), 120, "the head's result line")
    said_at = time.monotonic()
    result = json.loads(head_log.read_text().split("RLHF_TASKS_RESULT ")[1].splitlines()[0])
    assert result["job"]["status"] == "SUCCEEDED" and result["exit_code"] == 0
    poll(lambda: not any(pid_alive(pid) for pid in rec["pids"]) and no_leftovers(rec["cluster_id"]), 60,
         "every node agent and its Ray to end")
    assert time.monotonic() - said_at <= 60
    # The name is free for another provider now that nothing of it runs (its record never said it ended).
    assert not record(rlhf_home, "orphan").get("ended")
    from rlhf_tasks.providers.local import LocalProvider
    assert not LocalProvider.live(record(rlhf_home, "orphan"))


def test_a_kept_cluster_ends_itself_once_idle_past_placement_idle(tmp_path, cli_env, rlhf_home):
    task = write_task(tmp_path, "idler", "python3 -c 'print(\"done\")'", {"idle": "20s"})
    out = cli(tmp_path, cli_env, "launch", str(task), "--keep")
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    assert "it ends itself after 20s without a running job (placement.idle)" in said
    rec = record(rlhf_home, "idler")
    assert any(pid_alive(pid) for pid in rec["pids"])  # kept
    kept_at = time.monotonic()
    poll(lambda: not any(pid_alive(pid) for pid in rec["pids"]) and no_leftovers(rec["cluster_id"]), 20 + 60,
         "the kept cluster to end itself")
    assert time.monotonic() - kept_at >= 15  # not before its idle time (counted from the job's end)
    head_log = (rlhf_home / "runs" / "idler" / "nodes" / "node-0.log").read_text()
    assert "no job has run for 20s (placement.idle): the cluster ends itself" in head_log
