"""dstack's real server and CLI (tests/dstack/README.md) with runs that fail and runs that cost: a job that
fails, a worker lost mid-run, dstack's own retries against one budget cap, and the price dstack's plan gives.
On a bed of its own (the module's `dstack_bed`), beside test_dstack_cluster.py's, whose fixtures and helpers
these tests use."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from test_dstack_cluster import (  # noqa: F401 (the fixtures, imported so that pytest finds them here)
    _fleet_instances, _run_processes, _wait_run, _why, dstack_fleet, dump, launcher, no_run_left, bed_fleet,
    tiny_grpo, wait_for)

# As in test_dstack_cluster.py: mostly dstack's fixed intervals, beside two other cluster tests.
pytestmark = [pytest.mark.cluster, pytest.mark.waits]


def test_launch_counts_dstacks_plan_price_or_refuses_a_cap_it_cannot_price(dstack_bed, dstack_fleet, tmp_path):
    """dstack's own plan prices an SSH fleet's hosts at $0: a cap without placement.price_per_hour is refused (exit 2)
    before anything is submitted, naming the fields; with a price, the rendered max_price (per instance) still lets the
    fleet's hosts match, and the head counts the task's price (issue 48, item 2)."""
    bed = dstack_bed
    capped = tiny_grpo(tmp_path, steps=10, name="capped", placement={"max_cost": 5})
    run = launcher(bed, tmp_path, ["launch", str(capped), "--provider", "dstack"], timeout=180)
    assert run.returncode == 2, run.output[-4000:]
    assert "placement.max_cost: dstack's plan for capped prices its offers at $0" in run.output, run.output[-3000:]
    runs = bed.api("/api/runs/list", {"project_name": "main", "only_active": False, "include_jobs": False})
    assert "capped" not in [r["run_spec"]["run_name"] for r in runs]
    entry = "python3 -c 'print(\"priced job says hello\")'"
    priced = tiny_grpo(tmp_path, steps=10, name="priced", placement={"max_cost": 5, "price_per_hour": 2},
                       job={"recipe": "command", "working_dir": None, "timeout": "5m", "max_restarts": 0,
                            "args": {"entrypoint": entry}})
    launch = launcher(bed, tmp_path, ["launch", str(priced), "--provider", "dstack"], timeout=300)
    assert launch.returncode == 0, launch.output[-6000:]
    rendered = yaml.safe_load((tmp_path / "rlhf-home" / "runs" / "priced" / "dstack" / "priced.dstack.yml").read_text())
    assert rendered["max_price"] == 1.0, rendered
    assert "$2.00/h for the 2 nodes" in launch.output, launch.output[-4000:]  # the head's budget line
    _wait_run(bed, "priced", ("done", "failed", "terminated"), 60)


def test_a_failing_job_ends_failed_with_the_node_named_then_down_leaves_nothing(dstack_bed, dstack_fleet, tmp_path):
    """The job raises on the head: `launch` exits 1 and its summary names the node and its first error; the run
    ends failed in dstack (the head's agent exits 1, the master-done run ends); `down` stops it and the fleet's
    hosts run no job afterwards. Whatever the timing: when dstack ends the run (its failed job ends every job of
    it) before the launcher follows the job, or before `dstack apply` attaches at all, the first errors come
    from the head's result line (in `dstack logs` where apply showed none of it)."""
    bed = dstack_bed
    task = tmp_path / "fail.yaml"
    task.write_text(yaml.safe_dump({
        "name": "fail", "nodes": 2, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
        "checkpoints": {"path": str(tmp_path / "ckpt")}, "wait": {"head": "3m", "nodes": "3m"},
        "job": {"recipe": "command", "working_dir": None, "timeout": "5m", "max_restarts": 0,
                "args": {"entrypoint": "python3 -c 'import json; json.loads(\"{\")'"}}}))
    launch = launcher(bed, tmp_path, ["launch", str(task), "--provider", "dstack"], timeout=600)
    out = launch.output
    assert launch.returncode == 1, out[-6000:]
    assert "first error on each node:" in out, out[-4000:]
    print(out[out.find("== summary =="):])
    firsts = out[out.index("first error on each node:"):].split("\nfailed:")[0].splitlines()[1:]
    assert any(f.strip().startswith("node0 (") and "JSONDecodeError" in f for f in firsts), out[-3000:]
    summary = out[out.rindex("== summary =="):]
    bundle = re.search(r"every node's logs: (\S+\.tar\.gz)", summary)  # gathered here, by the dashboard or dstack
    assert bundle and os.path.isfile(bundle.group(1)), out[-3000:]
    with tarfile.open(bundle.group(1)) as tar:
        names = [m.name.split("/", 1)[1] for m in tar.getmembers()]
    assert "index.txt" in names and any(n.startswith("node0/") for n in names), names
    run = _wait_run(bed, "fail", ("done", "failed", "terminated"), 180)
    assert run["status"] in ("failed", "terminated"), _why(bed, run, tmp_path)
    down = launcher(bed, tmp_path, ["down", "fail"], timeout=120)
    assert down.returncode == 0, down.output
    for h in bed.tb.hosts:  # nothing of the run is left on a host: no runner, no Ray, no agent
        wait_for(lambda: not _run_processes(bed, h), 60, f"the run's processes on {h.name} to be gone")
    fleet = _fleet_instances(bed, dstack_fleet)
    assert all(s == "idle" for _, s in fleet), fleet


def test_a_worker_lost_mid_run_dstack_fails_the_run_and_launch_names_the_lost_node(dstack_bed, dstack_fleet,
                                                                                   tmp_path):
    """tiny-grpo through `launch` on the two-host fleet; once its steps run, the worker's machine is lost: its
    link goes down, as a machine that is powered off or cut from the network (its processes go on, nothing closes
    their connections, the server's SSH to it gets no answer). dstack's server, not our head, ends the run (the
    task's wait.nodes, 3 min, outlasts dstack's 2 min): the worker's job FAILED `instance_unreachable` about 2 min
    after the cut (jobs_running.py JOB_DISCONNECTED_RETRY_TIMEOUT, a constant, no setting), the run FAILED
    `job_failed`, the head's job terminated by the server. `launch` exits 1 and its summary names the lost node
    with dstack's reason. The instance stays in the fleet, unreachable (an SSH fleet's instance is never
    terminated for it); once the link is back dstack finds it reachable and ends the job's leftovers there (its
    dangling task): nothing of the run runs on either host, both instances idle. Last in the file: it cuts a host
    of the bed's fleet, restored after it pass or fail."""
    bed = dstack_bed
    task = tiny_grpo(tmp_path, steps=100000, name="lost")
    launch = launcher(bed, tmp_path, ["launch", str(task), "--provider", "dstack"], background=True)
    lost = None
    started = time.monotonic()
    try:
        wait_for(lambda: re.search(r"step \d+/100000", launch.output) or not launch.running(), 300,
                 "the launcher to show the job's steps", 1)
        assert launch.running(), launch.output[-4000:]
        run = bed.api("/api/project/main/runs/get", {"run_name": "lost"})
        head_ip, worker_ip = _job_host(run, 0), _job_host(run, 1)
        lost = next(h for h in bed.tb.hosts if h.ip == worker_ip)
        subprocess.run(["ip", "-n", lost.netns, "link", "set", "eth0", "down"], check=True)
        cut = time.monotonic()
        run = _wait_run(bed, "lost", ("done", "failed", "terminated"), 360)
        ended = time.monotonic() - cut
        subs = {j["job_spec"]["job_num"]: j["job_submissions"][-1] for j in run["jobs"]}
        print(f"dstack ended the run {ended:.0f} s after the cut: {run['status']} {run.get('termination_reason')}; "
              + "; ".join(f"job {n}: {s['status']} {s.get('termination_reason')} {s.get('termination_reason_message')}"
                          for n, s in sorted(subs.items())))
        assert run["status"] == "failed" and run["termination_reason"] == "job_failed", _why(bed, run, tmp_path)
        assert subs[1]["status"] == "failed" and subs[1]["termination_reason"] == "instance_unreachable", dump(subs)
        assert subs[1]["termination_reason_message"] == "Instance is unreachable", dump(subs)
        assert subs[0]["status"] == "terminated" and subs[0]["termination_reason"] == "terminated_by_server", dump(subs)
        assert 120 <= ended <= 300, f"dstack ended the run {ended:.0f} s after the cut"
        instances = _instances(bed, dstack_fleet)
        print("the fleet's instances after the run:", {ip: (i["status"], i.get("unreachable"))
                                                      for ip, i in instances.items()})
        assert instances[worker_ip]["unreachable"] is True and instances[worker_ip]["status"] == "idle", instances
        assert instances[head_ip]["unreachable"] is False and instances[head_ip]["status"] == "idle", instances

        code = launch.wait(120)
        out = launch.output
        summary = out[out.rindex("== summary =="):] if "== summary ==" in out else out[-3000:]
        print(summary)
        assert code == 1, out[-6000:]
        # the head's word (it saw the node leave, and was waiting for it) and dstack's (why it ended the run)
        assert f"cut short, with no end state" in summary and f"node {worker_ip} left the cluster" in summary, summary
        assert f"node1 ({worker_ip}) failed: instance unreachable" in summary, summary
        assert f"dstack: the run lost failed (job failed)" in summary, summary
        assert "process exited" not in out and "STOPPED before it finished" not in out, out[-5000:]
    finally:
        if lost is not None:
            subprocess.run(["ip", "-n", lost.netns, "link", "set", "eth0", "up"], check=True)
        if launch.running():
            launch.kill()
    restored = time.monotonic()

    def back():
        got = _instances(bed, dstack_fleet)
        return all(i["status"] == "idle" and not i["unreachable"] for i in got.values()) and got
    wait_for(back, 120, "both fleet instances idle and reachable again", 2)
    for h in bed.tb.hosts:  # the lost host's leftovers: ended by dstack's server (its dangling task), not by us
        wait_for(lambda: not _run_processes(bed, h), 120, f"the run's processes on {h.name} to be gone")
    print(f"the host was back in the fleet and clean {time.monotonic() - restored:.0f} s after its link came back; "
          f"the test took {time.monotonic() - started:.0f} s")


def _spend_task(tmp_path, name: str, entrypoint: str, placement: dict):
    """A one-node command task with the training's spend record on storage both fleet hosts see (the test's
    tmp_path, shared by the testbed as an NFS mount would be: checkpoints.shared.dstack.host_path), so that an
    attempt dstack relaunches on either host finds what the attempts before it spent."""
    ckpt = str(tmp_path / f"{name}-ckpt")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "nodes": 1, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
        "checkpoints": {"path": ckpt, "shared": {"dstack": {"host_path": ckpt}}},
        "wait": {"head": "3m", "nodes": "3m"}, "placement": placement,
        "job": {"recipe": "command", "working_dir": None, "timeout": "5m", "max_restarts": 0,
                "args": {"entrypoint": entrypoint}}}))
    return (path, Path(ckpt) / ".rlhf-tasks-spend.json")


def test_dstacks_retries_keep_one_cap_for_the_training_and_end_without_another_submission(dstack_bed, dstack_fleet,
                                                                                           tmp_path):
    """Issue 48 (1), on dstack's own server: two runs side by side, each retried by dstack (`retry` rendered from
    placement.retry with `error`), each priced by a played placement.price_per_hour. `capped` ($3.60/h, max_cost
    $0.09: 90 s of head time for the training): its first attempt's job fails at once and dstack relaunches it;
    the second attempt's job would run for 10 minutes, and its head stops it at what is left of the training's cap
    after the first attempt (read from the spend record), not at its own 90 s. `bounded` ($36/h): its job fails on
    every attempt, retry.errors 1: the second failure is the last. Each run ends with the head's exit 0
    (DONE_BY_RUNNER, which dstack never retries): `done`, two submissions and none after them, and the spend
    record's total (at the played price) within the cap and its grace."""
    bed = dstack_bed
    marker = tmp_path / "capped-ckpt" / "first-attempt-failed"
    first_fails = f"bash -c 'test -e {marker} || {{ touch {marker}; exit 3; }}; sleep 600'"
    every_fails = "python3 -c 'import time; time.sleep(4); raise SystemExit(3)'"
    grace = 5.0
    runs = {"capped": (3.6, 0.09) + _spend_task(tmp_path, "capped", first_fails, {
                "retry": {"errors": 10}, "price_per_hour": 3.6, "max_cost": 0.09, "stop_grace": "5s"}),
            "bounded": (36.0, 50.0) + _spend_task(tmp_path, "bounded", every_fails, {
                "retry": {"errors": 1}, "price_per_hour": 36.0, "max_cost": 50, "stop_grace": "5s"})}
    for name, (_, _, task, _) in runs.items():
        render = launcher(bed, tmp_path, ["render", str(task), "--provider", "dstack", "-o", f"{name}/"], timeout=120)
        assert render.returncode == 0, render.output
        rendered = yaml.safe_load((tmp_path / name / f"{name}.dstack.yml").read_text())
        assert rendered["retry"] == {"on_events": ["no-capacity", "interruption", "error"]}, rendered
    # the Ray token as each run's dstack project secret, which its render references (the header says how)
    for name in runs:
        bed.cli("secret", "set", f"rlhf_tasks__{name}__RAY_AUTH_TOKEN", "0123456789abcdef" * 4, timeout=120)
    started = time.monotonic()
    for name in runs:
        bed.cli("apply", "-f", f"{name}.dstack.yml", "-y", "-d", cwd=tmp_path / name, timeout=180)
    final = {name: _wait_run(bed, name, ("done", "failed", "terminated"), 900) for name in runs}
    for name in runs:
        bed.cli("secret", "delete", f"rlhf_tasks__{name}__RAY_AUTH_TOKEN", "-y", timeout=120)
    print(f"both runs over {time.monotonic() - started:.0f} s after their submission")
    for name, (price, cap, _, record_path) in runs.items():
        run = final[name]
        subs = next(j for j in run["jobs"] if j["job_spec"]["job_num"] == 0)["job_submissions"]
        record = json.loads(record_path.read_text())
        attempts = sorted(record["attempts"].values(), key=lambda a: a["started"])
        total = sum(a["cost"] for a in attempts)
        print(f"{name}: the run {run['status']} ({run.get('termination_reason')}), {len(subs)} submissions "
              f"({', '.join(str(s.get('termination_reason')) for s in subs)}); the spend record: "
              + "; ".join(f"{a['ended']} ${a['cost']:.3f} after {a['seconds']:.0f}s" for a in attempts)
              + f"; total ${total:.3f} of ${cap}")
        assert run["status"] == "done", _why(bed, run, tmp_path / name)
        assert record["training"] == name and len(attempts) == len(subs) == 2, (dump(record), dump(subs))
        assert [s["termination_reason"] for s in subs] == ["container_exited_with_error", "done_by_runner"], dump(subs)
        assert total <= cap + price * (grace + 2) / 3600, f"{name}: ${total:.3f} spent, cap ${cap}"
        logs = bed.cli("logs", name, cwd=tmp_path / name).output
        if name == "capped":
            assert [a["ended"] for a in attempts] == ["failed", "capped"], dump(record)
            assert total >= cap - 0.005, f"stopped before the cap: ${total:.3f}"
            assert attempts[1]["seconds"] <= 90 - attempts[0]["seconds"] + grace + 2, dump(record)
            assert "before this attempt (1 attempts, 1 failed" in logs, logs[-3000:]
            assert "stopped at the budget cap" in logs and "over 2 attempts (placement.max_cost $0.09)" in logs, \
                logs[-3000:]
        else:
            assert [a["ended"] for a in attempts] == ["failed", "failed"], dump(record)
            assert "the job failed on 2 attempts of the training (placement.retry.errors 1): this attempt ends " \
                   "with exit status 0, which the provider does not relaunch" in logs, logs[-3000:]
    for h in bed.tb.hosts:
        wait_for(lambda: not _run_processes(bed, h), 60, f"the runs' processes on {h.name} to be gone")


def _job_host(run: dict, num: int) -> str:
    """The address of the fleet host dstack put job `num` of the run on (its provisioning data)."""
    job = next(j for j in run["jobs"] if j["job_spec"]["job_num"] == num)
    return job["job_submissions"][-1]["job_provisioning_data"]["hostname"]


def _instances(bed, name) -> dict[str, dict]:
    return {i["hostname"]: i for i in bed.api("/api/project/main/fleets/get", {"name": name})["instances"]}
