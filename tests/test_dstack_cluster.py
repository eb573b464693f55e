"""The dstack provider against the real dstack server and CLI (tests/dstack/README.md): the server and CLI
are dstack's own, the fleet is provisioned by the server over SSH, the shim and runner are ours (played)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import yaml

import testbed as tbmod
from conftest import ROOT

# Most of each test is dstack's own pipeline, which moves a run on at fixed intervals (4-15 s a step) and fails a lost
# node's job after a fixed 2 minutes: a third worker runs these beside two other cluster tests (conftest.CLUSTER_SLOTS).
pytestmark = [pytest.mark.cluster, pytest.mark.waits]


def wait_for(fn, timeout, what, interval=1.0):
    import testbed
    return testbed.poll(fn, timeout, what, interval)


def dump(data):
    return json.dumps(data, indent=1, default=str)


def test_server_answers_and_cli_lists_runs(dstack_bed, dstack_fleet):
    info = dstack_bed.api("/api/server/get_info")
    assert info["server_version"] == "0.22.5"
    out = dstack_bed.cli("ps").output
    assert "NAME" in out.upper() or "No runs" in out or out.strip() == "", out
    projects = dstack_bed.cli("project", "list").output
    assert "main" in projects and "127.0.0.1:3000" in projects, projects


@pytest.fixture(autouse=True)
def no_run_left(request):
    """After each test, pass or fail: no active run on the server, no launcher or `dstack apply` left on the
    laptop (an attached apply holds its forwarded ports), so that one test's failure is not the next one's."""
    yield
    if "dstack_bed" not in request.fixturenames:
        return
    bed = request.getfixturevalue("dstack_bed")

    def left(tunnels: bool) -> list[int]:
        pids = []
        for pid in bed.tb.processes("laptop"):
            try:
                args = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
            except (OSError, UnicodeDecodeError):
                continue
            argv = [os.path.basename(a) for a in args]
            if "rlhf-tasks" in argv[:2] or any(a == "dstack" and b in ("apply", "attach") for a, b in zip(argv, argv[1:])) \
                    or (tunnels and argv[:1] == ["ssh"] and "-f" in args and any("dstack" in a for a in args)):
                pids.append(pid)
        return pids

    def signal_all(pids, sig):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    # SIGINT first, as a terminal's Ctrl-C: dstack's CLI then closes its background `ssh -f` tunnel itself (a SIGKILL
    # leaves it holding the forwarded port); then SIGKILL what is left, and any dstack tunnel left behind
    signal_all(left(False), signal.SIGINT)
    try:
        wait_for(lambda: not left(False), 20, "the launchers and dstack CLIs to end on SIGINT", 0.5)
    except TimeoutError:
        pass
    signal_all(left(True), signal.SIGKILL)
    active = [r["run_spec"]["run_name"] for r in bed.api("/api/runs/list", {"project_name": "main", "only_active": True,
                                                                           "include_jobs": False})]
    if active:
        bed.api("/api/project/main/runs/stop", {"runs_names": active, "abort": True})
        wait_for(lambda: not bed.api("/api/runs/list", {"project_name": "main", "only_active": True,
                                                         "include_jobs": False}), 120, f"runs {active} to end", 2)


def _fleet_instances(bed, name):
    fleet = bed.api(f"/api/project/main/fleets/get", {"name": name})
    return [(i["hostname"], i["status"]) for i in fleet["instances"]]


@pytest.fixture(scope="session")
def session_fleet(dstack_bed, tmp_path_factory):
    """The project's rendered fleet for tiny-grpo with the bed's two hosts as its SSH fleet
    (`placement.dstack.ssh`, as an on-prem user writes it), applied as rendered with the real CLI and
    provisioned by the real server (its own SSH steps, our shim downloaded from the bed). Shared by the tests;
    they run one at a time."""
    bed = dstack_bed
    work = tmp_path_factory.mktemp("fleet-apply")
    task = tiny_grpo(work, steps=10, placement={"dstack": {"ssh": bed.ssh_config()}})
    render = subprocess.run([f"{tbmod.BIN_DIR}/rlhf-tasks", "render", str(task), "--provider", "dstack",
                             "-o", str(work / "tiny-grpo.dstack.yml")], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert render.returncode == 0, render.stderr
    fleet = yaml.safe_load((work / "tiny-grpo-fleet.dstack.yml").read_text())
    assert fleet["ssh_config"]["hosts"] == bed.fleet_hosts() and "nodes" not in fleet, fleet
    started = time.monotonic()
    bed.cli("apply", "-f", "tiny-grpo-fleet.dstack.yml", "-y", "-d", cwd=work, timeout=300)
    name = fleet["name"]

    def idle():
        got = _fleet_instances(bed, name)
        bad = [s for _, s in got if s in ("terminated", "terminating")]
        assert not bad, got
        return len(got) == 2 and all(s == "idle" for _, s in got) and got
    try:
        got = wait_for(idle, 300, "both fleet instances idle", 2)
    except (TimeoutError, AssertionError) as exc:
        raise AssertionError(f"{exc}\nserver log:\n{bed.server.output[-6000:]}") from None
    print(f"fleet {name} provisioned in {time.monotonic() - started:.0f} s: {got}")
    bed.fleet_file = work / "tiny-grpo-fleet.dstack.yml"  # for `dstack_fleet`, to put it back after a test deleted it
    return name


@pytest.fixture
def dstack_fleet(dstack_bed, session_fleet):
    """The session's fleet, there and idle. Where a test before deleted it (its `launch` applied the same file under
    the same name, and its `down` or cancel deleted that): applied again as `session_fleet` did, both idle; a fleet
    of the name left there (that test failed before its `down`) is the same fleet, and stays."""
    bed, name = dstack_bed, session_fleet

    def settled():
        fleets = [f for f in bed.api("/api/project/main/fleets/list", {}) if f["name"] == name]
        return "gone" if not fleets else fleets[0]["status"] not in ("terminating", "submitted") and "there"
    if wait_for(settled, 120, f"the fleet {name} deleted or there", 2) == "gone":
        bed.cli("apply", "-f", bed.fleet_file.name, "-y", "-d", cwd=bed.fleet_file.parent, timeout=300)
        wait_for(lambda: sorted(s for _, s in _fleet_instances(bed, name)) == ["idle", "idle"], 300,
                 "the session's fleet back", 2)
    return name


@pytest.fixture
def no_session_fleet(dstack_bed, session_fleet):
    """For a test whose `launch` applies the fleet itself: the session's fleet deleted, unless a test before left
    it so (the next test that needs it puts it back: two such tests in a row provision it once, not twice)."""
    bed = dstack_bed
    if not _fleet_gone(bed, session_fleet):
        bed.cli("fleet", "delete", session_fleet, "-y", timeout=120)
        wait_for(lambda: _fleet_gone(bed, session_fleet), 120, f"the session's fleet {session_fleet} deleted", 2)
    return session_fleet


def test_fleet_is_provisioned_by_the_server_over_ssh(dstack_bed, dstack_fleet):
    bed = dstack_bed
    assert sorted(h for h, _ in _fleet_instances(bed, dstack_fleet)) == sorted(bed.fleet_hosts())
    for h in bed.tb.hosts:
        # what the server's SSH setup left on the host: the unit, the env file, the shim it downloaded
        unit = bed.tb.sh(h, "cat /etc/systemd/system/dstack-shim.service", cwd="/")
        assert "ExecStart=/usr/local/bin/dstack-shim" in unit
        env = bed.tb.sh(h, "cat /root/.dstack/shim.env", cwd="/")
        assert "DSTACK_RUNNER_DOWNLOAD_URL=" in env and "DSTACK_SERVICE_MODE=\"1\"" in env
        assert "added by dstack" in bed.tb.sh(h, "cat /root/.ssh/authorized_keys", cwd="/")
    out = bed.cli("fleet").output
    assert dstack_fleet in out, out
    # the offer is what each shim's host_info.json said: its played CPUs (2 and 4), no GPU, the free disk under
    # /var/lib/docker
    fleet = bed.api("/api/project/main/fleets/get", {"name": dstack_fleet})
    cpus = {i["hostname"]: i["instance_type"]["resources"]["cpus"] for i in fleet["instances"]}
    assert cpus == bed.cpus() and sorted(cpus.values()) == [2, 4], cpus
    for instance in fleet["instances"]:
        res = instance["instance_type"]["resources"]
        assert res["gpus"] == [] and 150_000 < res["disk"]["size_mib"] <= 204_800, res


def test_multinode_task_gets_dstack_environment(dstack_bed, dstack_fleet, tmp_path):
    """A 2-node task through `dstack apply`: the job spec, the cluster info and the run's states are the
    server's; each node's environment and working directory are what the runner gives."""
    bed = dstack_bed
    task = {"type": "task", "name": "envcheck", "nodes": 2, "fleets": [dstack_fleet],
            "commands": ["echo rank=$DSTACK_NODE_RANK nodes=$DSTACK_NODES_NUM master=$DSTACK_MASTER_NODE_IP",
                         "echo wd=$PWD dwd=$DSTACK_WORKING_DIR gpus=$DSTACK_GPUS_PER_NODE run=$DSTACK_RUN_NAME",
                         "echo ips=$(echo $DSTACK_NODES_IPS | tr '\\n' ,)", "cat data/hello.txt"],
            "files": ["data:/opt/envcheck/data"], "working_dir": "/opt/envcheck",
            "resources": {"cpu": "1..", "memory": "0.1GB..", "disk": "1GB.."}}
    work = tmp_path / "task"
    (work / "data").mkdir(parents=True)
    (work / "data" / "hello.txt").write_text("hello from files\n")
    (work / "task.dstack.yml").write_text(yaml.safe_dump(task))
    bed.cli("apply", "-f", "task.dstack.yml", "-y", "-d", cwd=work, timeout=180)
    run = _wait_run(bed, "envcheck", ("done", "failed", "terminated"), 240)
    assert run["status"] == "done", _why(bed, run, work)
    logs = bed.cli("logs", "envcheck", "--replica", "0", "--job", "1", cwd=work).output
    head_ip, worker_ip = bed.fleet_hosts()[0], bed.fleet_hosts()[1]
    assert "rank=1 nodes=2 master=" in logs, logs
    assert "wd=/opt/envcheck dwd=/opt/envcheck gpus=0 run=envcheck" in logs, logs
    assert "hello from files" in logs, logs
    logs0 = bed.cli("logs", "envcheck", cwd=work).output
    assert "rank=0 nodes=2" in logs0, logs0
    master = logs0.split("master=")[1].split()[0]  # which host is job 0's is the server's choice
    ips = logs0.split("ips=")[1].split(",")[0].split()
    assert sorted(ips) == sorted([head_ip, worker_ip]) and ips[0] == master, logs0
    assert f"master={master}" in logs, logs


def _wait_run(bed, name, statuses, timeout, interval=2.0):
    """The run once its status is one of `statuses` (the server's API asked every `interval` s: a run that takes
    minutes is asked less often)."""
    def finished():
        run = bed.api("/api/project/main/runs/get", {"run_name": name})
        return run if run["status"] in statuses else None
    try:
        return wait_for(finished, timeout, f"run {name} to reach one of {statuses}", interval)
    except TimeoutError as exc:
        run = bed.api("/api/project/main/runs/get", {"run_name": name})
        raise AssertionError(f"{exc}\n{dump(run)[-4000:]}\nserver log:\n{bed.server.output[-6000:]}") from None


def _why(bed, run, cwd):
    """What a failed run's jobs say: each job's state and reason, its log, the runners' own logs."""
    lines = [f"run {run['run_spec']['run_name']}: {run['status']} {run.get('termination_reason')}"]
    for job in run["jobs"]:
        sub = job["job_submissions"][-1]
        lines.append(f"job {job['job_spec']['job_num']}: {sub['status']} {sub.get('termination_reason')} "
                     f"{sub.get('termination_reason_message')} exit={sub.get('exit_status')}")
        proc = bed.cli("logs", run["run_spec"]["run_name"], "--job", str(job["job_spec"]["job_num"]), "-d",
                       cwd=cwd, check=False)
        lines.append(proc.output[-3000:])
    for h in bed.tb.hosts:
        lines.append(f"--- {h.name} runner and shim")
        lines.append(bed.tb.run(h, "tail -n 40 /tmp/runner/runner.out /root/.systemctl/*.log /tmp/runner/sshd/sshd.log", cwd="/",
                                background=False).output[-4000:])
    lines.append("--- server log (warnings, errors, the run's jobs)")
    lines += [line for line in bed.server.output.splitlines() if "gpuhunt" not in line and "catalog" not in line
              and ("WARNING" in line or "ERROR" in line or run["run_spec"]["run_name"] in line)][-40:]
    return "\n".join(lines)


def tiny_grpo(tmp_path, steps: int, nodes: int = 2, **changes):
    """tasks/tiny-grpo.yaml on `nodes` hosts with fewer steps (its `resources.cpus: 1` renders `cpu: 1..`, which
    every host's CPUs meet), or on node groups (`groups=`: instead of its nodes and resources)."""
    task = yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    task["nodes"] = nodes
    if "groups" in changes:
        del task["nodes"], task["resources"]
    task["job"]["args"].update(steps=steps, save_every=5)
    task["preflight"] = "off"
    task.update(changes)
    path = tmp_path / "tiny-grpo.yaml"
    path.write_text(yaml.safe_dump(task))
    return path


#: What `running_job`'s job prints once it runs (its source spells it in pieces: the launcher's own lines may echo the
#: entrypoint, the job's output is what says it runs).
RUNNING = "the job runs until stopped"


def running_job() -> dict:
    """A `command` job (`submit: head`) that prints RUNNING and sleeps: for the tests whose claims are about dstack
    and the launcher while a job runs (status, down, Ctrl-C, forward, stop), which a training would only load."""
    words = ", ".join(f'"{w}"' for w in RUNNING.split())
    return {"recipe": "command", "working_dir": None, "timeout": "15m", "max_restarts": 0,
            "args": {"entrypoint": f"python3 -c 'import time; print({words}, flush=True); time.sleep(3600)'"}}


def user_env(bed, tmp_path, **extra) -> dict[str, str]:
    """The user's environment on the laptop: dstack's CLI, this checkout's `rlhf-tasks` first on the path."""
    env = bed.env(PYTHONPATH=str(ROOT), RLHF_TASKS_HOME=str(tmp_path / "rlhf-home"), PYTHONUNBUFFERED="1", **extra)
    env["PATH"] = f"{tbmod.BIN_DIR}:{env['PATH']}"
    return env


def launcher(bed, tmp_path, args, background=False, timeout=600, **extra):
    """`rlhf-tasks` on the laptop, beside the dstack server, this checkout first on the path (`extra`: more of
    the user's environment)."""
    return bed.tb.run("laptop", [f"{tbmod.BIN_DIR}/rlhf-tasks", *args], env=user_env(bed, tmp_path, **extra),
                      cwd=tmp_path, background=background, timeout=timeout, name=args[0])


def test_launch_refuses_a_run_no_offer_fits_before_it_submits(dstack_bed, dstack_fleet, tmp_path):
    """8 H100s on the CPU-only fleet: dstack's own plan has no offer, so `launch` exits 2 before `dstack apply`
    of the task (which with -d would submit it and exit 0), no run is submitted, and the user's fleet stays."""
    bed = dstack_bed
    task = tiny_grpo(tmp_path, steps=10, name="nogpu", resources={"gpus": "H100:8"})
    run = launcher(bed, tmp_path, ["launch", str(task), "--provider", "dstack"], timeout=180)
    assert run.returncode == 2, run.output[-4000:]
    assert "dstack's plan for nogpu has no offer for 2 of its 2 jobs" in run.output and "gpu=H100:8" in run.output, \
        run.output[-3000:]
    runs = bed.api("/api/runs/list", {"project_name": "main", "only_active": False, "include_jobs": False})
    assert "nogpu" not in [r["run_spec"]["run_name"] for r in runs]
    assert sorted(h for h, _ in _fleet_instances(bed, dstack_fleet)) == sorted(bed.fleet_hosts())
    # node groups: dstack plans each group apart (server/services/runs/plan.py), and the refusal names the one no
    # host fits (8 CPUs: the hosts have 2 and 4), not the one that fits
    task = tiny_grpo(tmp_path, steps=10, name="nocpus", groups=[{"name": "trainer", "resources": {"cpus": 2}},
                                                                {"name": "big", "resources": {"cpus": 8}}])
    run = launcher(bed, tmp_path, ["launch", str(task), "--provider", "dstack"], timeout=180)
    assert run.returncode == 2, run.output[-4000:]
    said = re.search(r"dstack's plan for nocpus has no offer for 1 of its 2 jobs \(group big, groups\[1\]\.resources: "
                     r"cpu=(x86:)?8\.\. ", run.output)
    assert said and "then change groups[1].resources" in run.output, run.output[-3000:]
    runs = bed.api("/api/runs/list", {"project_name": "main", "only_active": False, "include_jobs": False})
    assert "nocpus" not in [r["run_spec"]["run_name"] for r in runs]


def test_launch_refuses_a_cap_it_cannot_price_then_a_priced_job_of_a_second_succeeds_from_the_heads_result_line(
        dstack_bed, dstack_fleet, tmp_path):
    """dstack's own plan prices an SSH fleet's hosts at $0: a cap without placement.price_per_hour is refused (exit 2)
    before anything is submitted, naming the fields (issue 48, item 2). With a price: the rendered max_price (per
    instance) still lets the fleet's hosts match and the head counts the task's price; the job, `submit: head` on the
    two-host fleet, ends within a second: the head submits it, sees it end and leaves, and the run can be done before
    the launcher follows it (or before `dstack apply` attaches at all). `launch` exits 0 and reports the head's result
    line (SUCCEEDED, the job's own output), not "the head's process exited"; the run ends `done`, both its jobs
    `done`."""
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
    started = time.monotonic()
    launch = launcher(bed, tmp_path, ["launch", str(priced), "--provider", "dstack"], timeout=300)
    out = launch.output
    assert launch.returncode == 0, out[-6000:] + "\n" + _why(bed, bed.api("/api/project/main/runs/get",
                                                                         {"run_name": "priced"}), tmp_path)
    print(f"launch took {time.monotonic() - started:.0f} s")
    rendered = yaml.safe_load((tmp_path / "rlhf-home" / "runs" / "priced" / "dstack" / "priced.dstack.yml").read_text())
    assert rendered["max_price"] == 1.0, rendered
    assert "$2.00/h for the 2 nodes" in out, out[-4000:]  # the head's budget line
    assert "job priced-priced: SUCCEEDED" in out and "process exited" not in out, out[-4000:]
    assert "priced job says hello" in out, out[-4000:]
    final = _wait_run(bed, "priced", ("done", "failed", "terminated"), 120)
    assert final["status"] == "done", _why(bed, final, tmp_path)
    assert [j["job_submissions"][-1]["status"] for j in final["jobs"]] == ["done", "done"], dump(final)[-3000:]


#: Two node groups on the fleet's hosts that differ (tests/dstack/server.py PLAYED_CPUS: 2 and 4 CPUs): the head's
#: group asks 4 CPUs or more, which only the second host has, the other exactly 2, which only the first has.
TWO_GROUPS = [{"name": "trainer", "nodes": 1, "resources": {"cpus": 4}},
              {"name": "reward", "nodes": 1, "resources": {"cpus": 2, "exact": ["cpus"]}}]


def test_the_tasks_working_dir_reaches_the_job(dstack_bed, dstack_fleet, tmp_path):
    """job.working_dir (src/ beside the task) goes through dstack's `files:` to the directory the job's commands
    run in, and the head submits the job from there: the job imports the module it holds (issue 37, item 1).
    The render applied by hand, as README says (`launch` of a job this short races its own end: the launcher
    takes `dstack apply`'s exit before the cluster's for a lost head, whatever the head's result line says).
    On two node groups (issue 46, item 6): dstack's own offer matching puts each group's job on the host whose
    CPUs fit it (the first group's, job 0 and the head, on the 4-CPU host: not the fleet's first), as the
    server's jobs say, and the head, which waits for every group's node with its group's Ray label, runs the job."""
    bed = dstack_bed
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "reward_fn.py").write_text("def score(x):\n    return 1.5\n")
    entry = "python3 -c 'import reward_fn; print(\"REWARD\", reward_fn.score(0))'"
    task = tiny_grpo(tmp_path, steps=10, name="wd", job={"recipe": "command", "working_dir": "src", "timeout": "5m",
                                                          "max_restarts": 0, "args": {"entrypoint": entry}},
                     groups=TWO_GROUPS)
    render = launcher(bed, tmp_path, ["render", str(task), "--provider", "dstack", "-o", "out/"], timeout=120)
    assert render.returncode == 0, render.output
    # the Ray token as a dstack project secret, set by hand as the rendered file's header says
    by_hand = [line[4:] for line in (tmp_path / "out" / "wd.dstack.yml").read_text().splitlines()
               if line.startswith("#   dstack secret set ")]
    assert by_hand == ['dstack secret set rlhf_tasks__wd__RAY_AUTH_TOKEN "$(rlhf-tasks token wd)"'], by_hand
    bed._no_update_check()
    typed = bed.tb.run("laptop", ["bash", "-c", by_hand[0]], env=user_env(bed, tmp_path), cwd=tmp_path,
                       background=False, timeout=120, name="secret-set")
    assert typed.returncode == 0, typed.output
    bed.cli("apply", "-f", "wd.dstack.yml", "-y", "-d", cwd=tmp_path / "out", timeout=180)
    run = _wait_run(bed, "wd", ("done", "failed", "terminated"), 300)
    bed.cli("secret", "delete", "rlhf_tasks__wd__RAY_AUTH_TOKEN", "-y")
    assert run["status"] == "done", _why(bed, run, tmp_path / "out")
    logs = bed.cli("logs", "wd", cwd=tmp_path / "out").output
    assert "REWARD 1.5" in logs and "job wd-wd SUCCEEDED" in logs, logs[-4000:]
    assert "submitting job wd-wd with working_dir /opt/rlhf-tasks-workdir" in logs, logs[-4000:]
    # where dstack put each group's job: its JobSpec's group and number, the instance it was provisioned on
    by_cpus = {cpus: ip for ip, cpus in bed.cpus().items()}
    placed = [(j["job_spec"]["job_num"], j["job_spec"]["node_group_name"],
               j["job_submissions"][-1]["job_provisioning_data"]["hostname"], j["job_submissions"][-1]["status"])
              for j in run["jobs"]]
    assert sorted(placed) == [(0, "trainer", by_cpus[4], "done"), (1, "reward", by_cpus[2], "done")], dump(run)[-3000:]


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


def _run_processes(bed, h) -> list[str]:
    """What runs on a fleet host beyond its own sshd, the shim and the testbed's probes."""
    out = bed.tb.sh(h, "ps -eo pid=,args=", cwd="/")
    keep = ("sshd", "dstack-shim", "hostinit", "ps -eo", "wait_port", "bash -c ps")
    return [line.strip() for line in out.splitlines() if line.strip() and not any(k in line for k in keep)]


def _stored(bed) -> str:
    """What dstack's server stores of its runs and jobs (its SQLite database: each run's spec, each job's spec and
    submissions), as one text."""
    import sqlite3

    db = sqlite3.connect(f"file:{bed.server_dir / 'data' / 'sqlite.db'}?mode=ro", uri=True)
    try:
        return "\n".join(repr(row) for table in ("runs", "jobs") for row in db.execute(f"SELECT * FROM {table}"))
    finally:
        db.close()


def _project_secrets(bed) -> list[str]:
    return sorted(s["name"] for s in bed.api("/api/project/main/secrets/list"))


def test_status_then_down_in_the_middle_of_a_run_leaves_nothing_running(dstack_bed, no_session_fleet, tmp_path):
    """`status` while the task's job runs says so; `down` (`dstack stop`, then `dstack fleet delete` of the fleet
    `launch` applied) ends the run in dstack, deletes that fleet and leaves no process of the run on the hosts (the shim
    tears the job down as a container's end would). The task's fleet is its own SSH hosts (placement.dstack.ssh),
    which `launch` applies: the session's fleet, deleted for this test, is put back by the next test that needs it.
    The task's secret and the Ray token go as dstack project secrets (issue 48, item 6): the run spec and the job
    specs the server stores hold no value, every node's job has both values, and `down` deletes the secrets."""
    bed = dstack_bed
    value = "hf-test-value-" + os.urandom(8).hex()
    task = tiny_grpo(tmp_path, steps=10, placement={"dstack": {"ssh": bed.ssh_config()}}, secrets=["HF_TOKEN"],
                     job=running_job())
    launch = launcher(bed, tmp_path, ["launch", str(task), "--provider", "dstack"], background=True, HF_TOKEN=value)
    names = ["rlhf_tasks__tiny_grpo__HF_TOKEN", "rlhf_tasks__tiny_grpo__RAY_AUTH_TOKEN"]
    try:
        wait_for(lambda: RUNNING in launch.output or not launch.running(), 300,
                 "the launcher to show the job's output", 1)
        assert launch.running(), launch.output[-4000:]
        assert "dstack: applying the fleet tiny-grpo-fleet" in launch.output, launch.output[-3000:]
        token = (tmp_path / "rlhf-home" / "clusters" / "tiny-grpo" / "token").read_text().strip()
        assert set(names) <= set(_project_secrets(bed)), _project_secrets(bed)
        run = bed.api("/api/project/main/runs/get", {"run_name": "tiny-grpo"})
        env = run["run_spec"]["configuration"]["env"]
        assert env["HF_TOKEN"] == "${{ secrets.rlhf_tasks__tiny_grpo__HF_TOKEN }}", env
        stored = _stored(bed)
        assert "rlhf_tasks__tiny_grpo__RAY_AUTH_TOKEN" in stored  # what the server stores: references, no value
        for secret in (value, token):
            assert secret not in json.dumps(run) and secret not in stored and secret not in launch.output
        for h in bed.tb.hosts:  # each node's job has both values in its environment, from dstack's server
            seen = bed.tb.sh(h, "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | "
                                "grep -E '^(HF_TOKEN|RAY_AUTH_TOKEN)=' | sort -u", cwd="/").split()
            assert seen == [f"HF_TOKEN={value}", f"RAY_AUTH_TOKEN={token}"], (h.name, len(seen))
        status = launcher(bed, tmp_path, ["status", "tiny-grpo"], timeout=120)
        assert status.returncode == 0 and "RUNNING" in status.output, status.output
        down = launcher(bed, tmp_path, ["down", "tiny-grpo"], timeout=180)
        assert down.returncode == 0, down.output
        assert f"dstack: deleted 2 project secret(s) of tiny-grpo: {', '.join(names)}" in down.output, down.output
        assert not [n for n in _project_secrets(bed) if n.startswith("rlhf_tasks__tiny_grpo__")], _project_secrets(bed)
        run = _wait_run(bed, "tiny-grpo", ("terminated", "failed", "done"), 120)
        assert run["status"] == "terminated", _why(bed, run, tmp_path)
        assert "Fleet tiny-grpo-fleet deleted" in down.output or "deleted" in down.output, down.output
        wait_for(lambda: _fleet_gone(bed, no_session_fleet), 60, "the fleet launch applied to be gone after `down`", 2)
        for h in bed.tb.hosts:
            wait_for(lambda: not _run_processes(bed, h), 60, f"the run's processes on {h.name} to be gone")
        launch.wait(120)
    finally:
        if launch.running():
            launch.kill()


def test_ctrl_c_before_the_jobs_start_stops_the_run_and_deletes_the_fleet_launch_applied(dstack_bed, no_session_fleet,
                                                                                          tmp_path):
    """The task's fleet is its own SSH hosts (placement.dstack.ssh) and not there yet: `launch` applies it, then the
    task. Ctrl-C (the terminal's) once the run is submitted, before the job's command runs: launch exits 130 and
    nothing is left: the run stopped, the fleet launch applied deleted (the session's fleet, deleted for this test,
    is put back by the next test that needs it)."""
    bed = dstack_bed
    task = tiny_grpo(tmp_path, steps=10, placement={"dstack": {"ssh": bed.ssh_config()}}, job=running_job())
    launch = launcher(bed, tmp_path, ["launch", str(task), "--provider", "dstack"], background=True)
    started = time.monotonic()
    try:
        def submitted():
            runs = bed.api("/api/runs/list", {"project_name": "main", "only_active": True, "include_jobs": False})
            return any(r["run_spec"]["run_name"] == "tiny-grpo" for r in runs) or not launch.running()
        wait_for(submitted, 300, "launch to apply its fleet and submit the run", 1)
        assert launch.running(), launch.output[-4000:]
        assert "dstack: applying the fleet tiny-grpo-fleet" in launch.output, launch.output[-3000:]
        assert "the command runs" not in launch.output  # not started yet
        launch.kill(signal.SIGINT)
        assert launch.wait(240) == 130, launch.output[-4000:]
        out = launch.output
        print(out[out.rindex("interrupted"):])
        assert "interrupted before the job's command started: stopping the cluster tiny-grpo" in out, out[-3000:]
        assert "the job of tiny-grpo did not run" in out, out[-3000:]
        run = _wait_run(bed, "tiny-grpo", ("terminated", "failed", "done"), 120)
        assert run["status"] == "terminated", _why(bed, run, tmp_path)
        gone = time.monotonic()  # `dstack fleet delete` said "deleted"; the server removes it in the background
        wait_for(lambda: _fleet_gone(bed, no_session_fleet), 120, "the fleet launch applied to be gone", 2)
        print(f"the fleet was gone {time.monotonic() - gone:.0f} s after `down` said it was deleted")
        for h in bed.tb.hosts:
            wait_for(lambda: not _run_processes(bed, h), 60, f"the run's processes on {h.name} to be gone")
        print(f"Ctrl-C before the start: {time.monotonic() - started:.0f} s")
    finally:
        if launch.running():
            launch.kill()


def _port_open(bed, port: int) -> bool:
    return bed.tb.run("laptop", ["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)"],
                      cwd="/", background=False).returncode == 0


def test_ctrl_c_after_the_jobs_start_then_forward_bundle_and_stop_as_it_says(dstack_bed, dstack_fleet, tmp_path):
    """Ctrl-C (the terminal's: the launcher and its `dstack apply`) once the job runs: launch exits 130 saying the job
    keeps running, how to stop it, and that the cluster ends itself when the job ends; each is true: the run runs on
    in dstack, `forward` (dstack attach) reaches its dashboard, which lists the job RUNNING, `logs --bundle` gathers
    both nodes through it, `stop` through it ends the job, and the run then ends without `down`. Ctrl-C closes the
    forward's tunnel."""
    bed = dstack_bed
    task = tiny_grpo(tmp_path, steps=10, name="cc", job=running_job())
    launch = launcher(bed, tmp_path, ["launch", str(task), "--provider", "dstack"], background=True)
    forward = None
    try:
        wait_for(lambda: RUNNING in launch.output or not launch.running(), 300,
                 "the launcher to show the job's output", 1)
        assert launch.running(), launch.output[-4000:]
        launch.kill(signal.SIGINT)
        assert launch.wait(60) == 130, launch.output[-4000:]
        said = launch.output[launch.output.rindex("stopped following"):]
        print(said)
        assert "job cc-cc keeps running" in said and "rlhf-tasks stop cc-cc --cluster cc (with `rlhf-tasks forward " \
            "cc` running in another shell: the launch's own forward of the dashboard has ended)" in said, said
        wait_for(lambda: not _port_open(bed, 8265), 30, "`dstack apply`'s forward to close (it detached on Ctrl-C)")
        assert "the cluster ends itself when the job ends (or now: rlhf-tasks down cc)" in said, said
        run = bed.api("/api/project/main/runs/get", {"run_name": "cc"})
        assert run["status"] == "running", _why(bed, run, tmp_path)
        assert [j["job_submissions"][-1]["status"] for j in run["jobs"]] == ["running", "running"], dump(run)[-3000:]

        forward = launcher(bed, tmp_path, ["forward", "cc", "--port", "8301"], background=True)
        wait_for(lambda: "is at http://localhost:8301" in forward.output or not forward.running(), 120,
                 "the forward's dashboard", 1)
        assert forward.running(), forward.output
        listed = launcher(bed, tmp_path, ["list", "--cluster", "cc"], timeout=60)
        assert listed.returncode == 0 and re.search(r"cc-cc\s.*RUNNING", listed.output), listed.output
        bundle = launcher(bed, tmp_path, ["logs", "cc", "--bundle"], timeout=120)
        assert bundle.returncode == 0, bundle.output
        path = re.search(r"every node's logs: (\S+\.tar\.gz)", bundle.output)
        assert path and os.path.isfile(path.group(1)), bundle.output
        with tarfile.open(path.group(1)) as tar:
            index = json.load(tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/index.json"))))
        assert len(index["nodes"]) == 2 and all(n["state"] == "ALIVE" for n in index["nodes"]), index["nodes"]

        stop = launcher(bed, tmp_path, ["stop", "cc-cc", "--cluster", "cc"], timeout=120)
        assert stop.returncode == 0, stop.output
        run = _wait_run(bed, "cc", ("done", "failed", "terminated"), 120)  # the cluster ends itself, no `down`
        print(f"after stop: the run {run['status']}")
        forward.kill(signal.SIGINT)
        assert forward.wait(30) == 0, forward.output
        wait_for(lambda: not _port_open(bed, 8301), 20, "the forward's port to close")
    finally:
        for proc in (launch, forward):
            if proc is not None and proc.running():
                proc.kill()


def _fleet_gone(bed, name) -> bool:
    fleets = bed.api("/api/project/main/fleets/list", {})  # the project's fleets, a deleted one gone from it
    return not [f for f in fleets if f["name"] == name]


def _job_host(run: dict, num: int) -> str:
    """The address of the fleet host dstack put job `num` of the run on (its provisioning data)."""
    job = next(j for j in run["jobs"] if j["job_spec"]["job_num"] == num)
    return job["job_submissions"][-1]["job_provisioning_data"]["hostname"]


def _instances(bed, name) -> dict[str, dict]:
    return {i["hostname"]: i for i in bed.api("/api/project/main/fleets/get", {"name": name})["instances"]}


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
    of the session's fleet, restored after it pass or fail."""
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
        run = _wait_run(bed, "lost", ("done", "failed", "terminated"), 360, interval=5)
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
    # the Ray token as each run's dstack project secret, which its render references (set through the server's API,
    # as `dstack secret set` would: the CLI typed by hand is test_the_tasks_working_dir_reaches_the_job's)
    for name in runs:
        bed.api("/api/project/main/secrets/create_or_update", {"name": f"rlhf_tasks__{name}__RAY_AUTH_TOKEN",
                                                               "value": "0123456789abcdef" * 4})
    started = time.monotonic()
    for name in runs:
        bed.cli("apply", "-f", f"{name}.dstack.yml", "-y", "-d", cwd=tmp_path / name, timeout=180)
    final = {name: _wait_run(bed, name, ("done", "failed", "terminated"), 900, interval=5) for name in runs}
    bed.api("/api/project/main/secrets/delete",
            {"secrets_names": [f"rlhf_tasks__{name}__RAY_AUTH_TOKEN" for name in runs]})
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
