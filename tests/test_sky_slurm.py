"""`sky launch --infra slurm` run by SkyPilot itself on the project's real Slurm.

SkyPilot 0.14.1's own CLI and API server (on the testbed's laptop, loopback), its optimizer, its
Slurm provisioner (an sbatch "virtual instance" job, srun --overlap into it over SSH through the
login node) and its setup and run machinery, against tests/slurm_testbed.py's Slurm
(slurmctld + one slurmd per namespace host).  tests/sky/README.md ("Slurm") says what is real
and what is played; tests/sky/slurm_infra.py builds it.
"""

from __future__ import annotations

import re
import sys
import tarfile
import time
from pathlib import Path

import pytest

import slurm_testbed as stmod
import testbed as tbmod
from conftest import ROOT, starts_cluster

sys.path.insert(0, str(ROOT / "tests" / "sky"))
import slurm_infra  # noqa: E402  (tests/sky has no __init__: a package named sky would hide SkyPilot's)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain(text: str) -> str:
    return ANSI.sub("", text)


@pytest.fixture(scope="module")
@starts_cluster
def sky_slurm(tmp_path_factory):
    """Two Slurm nodes (no test's claim needs more), the site's Python active on them, SkyPilot's API
    server started and Slurm enabled by one `sky check slurm` (SkyPilot keeps it in its state: the
    launches need no check of their own; its output is kept for the test of it). One setting for the
    module: each takes a minute to make."""
    reason = tbmod.require_root() or stmod.slurm_missing()
    if reason:
        if tbmod.in_ci():
            pytest.fail(f"required in CI: {reason}")
        pytest.skip(reason)
    pytest.importorskip("sky")
    base = tmp_path_factory.mktemp("skyslurm-")
    tb = tbmod.Testbed(2, base / "testbed", shared=[tmp_path_factory.getbasetemp()])
    cluster = infra = None
    try:
        cluster = stmod.SlurmCluster(tb, base / "slurm", real_memory_mb=8192)
        infra = slurm_infra.SkySlurm(cluster, base / "sky", slurm_infra.prepare(), site_python=True)
        infra.checked = plain(infra.sky("check", "slurm", timeout=240, check=True).output)
        yield infra
    finally:
        if infra is not None:
            infra.close()
        if cluster is not None:
            cluster.close()
        tb.close()


def node_sh(infra, cmd: str) -> str:
    """A shell command on the login node (its /root is the cluster's shared home)."""
    return infra.slurm.run(["/bin/bash", "-c", cmd], 0, cwd="/root", timeout=60).output


def test_sky_check_enables_the_testbed_slurm(sky_slurm):
    """`sky check slurm` (the module fixture's) reaches the login node over SSH, runs sinfo there and enables the
    cluster named in ~/.slurm/config; `sky gpus list` asks the same Slurm for its GPUs."""
    out = sky_slurm.checked
    assert re.search(r"Slurm: enabled", out), out
    assert re.search(rf"{slurm_infra.SLURM_CLUSTER}: enabled", out), out
    gpus = plain(sky_slurm.sky("show-gpus", "--infra", "slurm", timeout=120, check=True).output)
    assert "No GPUs found in any Slurm partition" in gpus, gpus  # the testbed's nodes have none


TOKEN = "sky-slurm-test-token-0123456789abcdef"

#: What a node's service writes of the `run` SkyPilot gave it: its rank, host, node IPs, the OMP_NUM_THREADS its run
#: script got (the environment of the agent's parent, `bash -i sky_app_*`: the render unsets it before the agent) and
#: the directory the run went to.
RUN_FACTS = ("echo rank=$SKYPILOT_NODE_RANK host=$(hostname) ips=$(echo $SKYPILOT_NODE_IPS) "
             "omp=$(tr '\\0' '\\n' < /proc/$(awk '{print $4}' /proc/$PPID/stat)/environ "
             "| sed -n 's/^OMP_NUM_THREADS=//p') pwd=$(pwd) > {facts}/run-$SKYPILOT_NODE_RANK; exec sleep 600")


def test_a_rendered_task_through_sky_launch_infra_slurm_runs_setup_and_run_per_node_and_its_workdir(sky_slurm, tmp_path):
    """`rlhf-tasks render --provider sky` of a two-node task, then, from the rendered file's directory, `sky launch -c
    wd wd.sky.yaml --infra slurm --secret RAY_AUTH_TOKEN`: SkyPilot's sbatch job holds both nodes, its runtime is
    installed on them, the task's setup runs on each node with its SKYPILOT_SETUP_NODE_RANK, the rendered run on each
    with SKYPILOT_NODE_RANK (one Slurm task per node, SkyPilot's prefixes, its runner's OMP_NUM_THREADS=1, in the
    cluster's ~/sky_workdir); the render's `workdir:` (job.working_dir, submit: head) is rsynced there leaving out what
    its .gitignore names, and the head submits the job from it: the job imports the module it holds and reads its file
    (issue 39, item 1; as dstack's and Ray's providers). The job SUCCEEDS (`sky queue`), `sky status` shows the
    cluster, `sky down` cancels the Slurm job."""
    import yaml
    infra = sky_slurm
    src = tmp_path / "src"
    src.mkdir()
    (src / "reward_fn.py").write_text("def score(x):\n    return 1.5\n")
    (src / "data.txt").write_text("from-the-working-dir\n")
    (src / "ignored.txt").write_text("left out\n")
    (src / ".gitignore").write_text("ignored.txt\n")
    entry = ("python3 -c \"import os, reward_fn; print('REWARD', reward_fn.score(0), open('data.txt').read().strip(), "
             "'ignored' if os.path.exists('ignored.txt') else 'no-ignored')\"")
    facts = tmp_path / "facts"  # shared by the nodes
    facts.mkdir()
    task = {"name": "wd", "nodes": 2, "preflight": False, "resources": {"cpus": 1},
            "setup": ["echo SETUP rank=$SKYPILOT_SETUP_NODE_RANK"], "checkpoints": {"path": str(tmp_path / "ckpt")},
            "services": [{"name": "facts", "where": "every_node", "timeout": "1m",
                          "command": RUN_FACTS.replace("{facts}", str(facts))}],
            "job": {"recipe": "command", "submit": "head", "working_dir": str(src), "timeout": "3m",
                    "max_restarts": 0, "args": {"entrypoint": entry}}}
    (tmp_path / "wd.yaml").write_text(yaml.safe_dump(task))
    render_dir = infra.laptop_home / "render"
    render_dir.mkdir()
    r = infra.tb.run(infra.tb.laptop, [str(Path(sys.executable).parent / "rlhf-tasks"), "render", str(tmp_path / "wd.yaml"),
                                       "--provider", "sky", "-o", str(render_dir / "wd.sky.yaml")],
                     env=infra.env(), timeout=120, background=False)
    assert r.returncode == 0, r.output
    assert "workdir: ../" in (render_dir / "wd.sky.yaml").read_text()  # resolved by sky launch from its directory
    started = time.monotonic()
    launch = infra.sky("launch", "-c", "wd", "wd.sky.yaml", "--infra", "slurm", "--secret", "RAY_AUTH_TOKEN", "-y",
                       timeout=600, cwd=render_dir, env=infra.env(RAY_AUTH_TOKEN=TOKEN))
    out = plain(launch.output)
    logs = node_sh(infra, "cd /root/.sky_clusters/wd-*/ && for f in $(find sky_logs -name '*.log'); "
                          "do echo \"--- $f\"; tail -40 \"$f\"; done")
    print(f"sky launch took {time.monotonic() - started:.0f} s\n{out}\n{logs}")
    try:
        assert launch.returncode == 0, out + logs
        assert "Job finished (status: SUCCEEDED)" in out, out + logs
        assert re.search(r"\(setup pid=\d+\) SETUP rank=0", out), out
        assert re.search(r"\(setup pid=\d+, ip=10\.77\.0\.11\) SETUP rank=1", out), out
        # run: one Slurm task per node (SlurmCodeGen: srun --ntasks-per-node=1, rank = SLURM_PROCID), SkyPilot's
        # prefixes on each node's agent; the agent on the head says the job's end, the worker's its result
        assert re.search(r"\(head, rank=0, pid=\d+\) \[[\d:]+\] node0: job \S+ SUCCEEDED after", out), out
        assert re.search(r"\(worker1, rank=1, pid=\d+, ip=10\.77\.0\.11\) .*"
                         r'RLHF_TASKS_RESULT {"error": null, "exit_code": 0, "rank": 1', out), out
        # in ~/sky_workdir of the cluster's own home; SkyPilot's runner's OMP_NUM_THREADS=1 reaches it
        ips = "10.77.0.10 10.77.0.11"
        for rank in (0, 1):
            said = (facts / f"run-{rank}").read_text() if (facts / f"run-{rank}").exists() else "(no facts file)"
            assert re.fullmatch(rf"rank={rank} host=node{rank} ips={ips} omp=1 "
                                r"pwd=/root/\.sky_clusters/wd-\w+/sky_workdir\n", said), said
        # the job ran from the rsynced workdir
        assert "REWARD 1.5 from-the-working-dir no-ignored" in out, out
        assert re.search(r"submitting job wd-\S+ with working_dir \. \(its command waits", out), out
        synced = node_sh(infra, "ls -A /root/.sky_clusters/wd-*/sky_workdir")  # SkyPilot's rsync, .gitignore applied
        assert set(synced.split()) == {".gitignore", "data.txt", "reward_fn.py"}, synced
        jobs = node_sh(infra, "squeue -h -o '%i %j %T %D'")
        assert re.search(r"^\d+ wd-\w+ RUNNING 2$", jobs, re.M), jobs  # SkyPilot's virtual instance
        queue = plain(infra.sky("queue", "wd", timeout=120, check=True).output)
        assert re.search(r"^1\s+wd\s+root\s.*SUCCEEDED", queue, re.M), queue
        status = plain(infra.sky("status", timeout=120, check=True).output)
        print(status)  # the render's autostop (idle 1 min, down) on a Slurm cluster without containers
        assert re.search(r"^wd\s+Slurm \(testbed\)\s+2x", status, re.M), status
    finally:
        down = infra.sky("down", "wd", "-y", timeout=300)
    assert down.returncode == 0, down.output
    tbmod.poll(lambda: not node_sh(infra, "squeue -h -o '%j'").strip(), 60, "SkyPilot's Slurm job to end")
    status = plain(infra.sky("status", timeout=120, check=True).output)
    assert "No existing clusters." in status, status


# ----------------------------------------------------------------------------- rlhf-tasks launch --provider sky

RLHF_TASKS = str(Path(sys.executable).parent / "rlhf-tasks")


def rt(infra, *args: str, timeout: float = 120, env: dict[str, str] | None = None):
    """`rlhf-tasks ...` on the laptop, as the user runs it there (their HOME: ~/.rlhf-tasks, ~/.ssh)."""
    p = infra.tb.run(infra.tb.laptop, [RLHF_TASKS, *args], env=env or infra.env(), background=True,
                     cwd=infra.laptop_home, name="rlhf-tasks-" + args[0])
    if timeout:
        try:
            p.wait(timeout)
        except Exception:
            p.kill()
            raise TimeoutError(f"`rlhf-tasks {' '.join(args)}` still running after {timeout}s:\n{p.output[-6000:]}")
    return p


def tiny_grpo(tmp_path, **changes) -> Path:
    """tasks/tiny-grpo.yaml on 2 nodes, 4 steps, no preflight (test_preflight.py's claim, ~8 s a cluster)."""
    import yaml
    task = yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    task["job"]["args"].update(steps=4, save_every=10)
    task.update(nodes=2, preflight=False)
    task["checkpoints"]["path"] = str(tmp_path / "ckpt")
    task.setdefault("placement", {})["backends"] = ["slurm"]  # how a user points SkyPilot at Slurm
    task.update(changes)
    src = tmp_path / f"{task['name']}.yaml"
    src.write_text(yaml.safe_dump(task))
    return src


def test_rlhf_tasks_launch_provider_sky_on_slurm(sky_slurm, tmp_path):
    """`rlhf-tasks launch tiny-grpo.yaml --provider sky --keep` (2 nodes) on SkyPilot's Slurm infra: `sky launch
    --detach-run` of the render (placement.backends [slurm] is SkyPilot's `cloud: slurm`; file_mounts
    /opt/rlhf-tasks rsynced onto each node), the head's dashboard through `ssh -L` over the ssh config SkyPilot
    writes for the cluster, the job followed to SUCCEEDED with every step once and the reward's first and last
    value (world size 2, both nodes took part); then `status`, `forward`, `logs --bundle` and `down` (nothing left
    in squeue)."""
    infra = sky_slurm
    src = tiny_grpo(tmp_path)
    try:
        _launch_follow_and_down(infra, src)
    except BaseException:
        infra.sky("down", "tiny-grpo", "-y", timeout=300)  # a kept cluster must not hold the nodes' ports for the next
        raise


def _launch_follow_and_down(infra, src):
    started = time.monotonic()
    launch = rt(infra, "launch", str(src), "--provider", "sky", "--keep", timeout=900,
                env=infra.env(RAY_AUTH_TOKEN=TOKEN))
    out = plain(launch.output)
    print(f"rlhf-tasks launch took {time.monotonic() - started:.0f} s\n{out}")
    assert launch.returncode == 0, out
    assert re.search(r"job tiny-grpo-\S+: SUCCEEDED in \d+s", out), out
    # launch asked SkyPilot's optimizer for the price (providers/sky/catalog.py optimizer_price): none on Slurm, said
    assert "sky: SkyPilot prices nothing on Slurm (the cluster's own machines: its optimizer counts them at $0)" in out
    assert re.search(r"reward [\d.]+ -> [\d.]+ over steps 1\.\.4 \(world size 2, 2 nodes took part\)", out), out
    steps = [int(n) for n in re.findall(r"^step (\d+)/4 ", out, re.M)]
    assert steps == sorted(set(steps)) and steps[-1] == 4, out  # every step once (the log shows 1 and 4)
    # the forward goes through the ssh config SkyPilot writes for the cluster: its websocket proxy via the
    # API server, then `srun --overlap ... sshd -i` on the head node in the cluster's Slurm job
    generated = (infra.laptop_home / ".sky" / "generated" / "ssh" / "tiny-grpo").read_text()
    assert "Include ~/.sky/generated/ssh/*" in (infra.laptop_home / ".ssh" / "config").read_text()
    assert re.search(r"ProxyCommand \S+ \S+/sky/templates/websocket_proxy\.py http://127\.0\.0\.1:46580 tiny-grpo "
                     r"slurm-job-ssh-proxy 0", generated), generated
    status = rt(infra, "status", "tiny-grpo", timeout=300)
    print(plain(status.output))
    assert status.returncode == 0 and re.search(r"^\s*tiny-grpo\s+Slurm \(testbed\)\s+2x.*\sUP\s", plain(status.output), re.M), \
        status.output
    forward = rt(infra, "forward", "tiny-grpo", "--port", "18265", timeout=0)
    try:
        tbmod.poll(lambda: "is at http://localhost:18265" in forward.output or not forward.running(), 180,
                   "rlhf-tasks forward to say the dashboard answers")
        assert forward.running(), forward.output
        bundle = rt(infra, "logs", "tiny-grpo", "--bundle", timeout=300)  # the token the launch made
        print(plain(bundle.output))
        assert bundle.returncode == 0 and "every node's logs:" in bundle.output, bundle.output
        forward.send_signal(2)  # Ctrl-C
        assert forward.wait(30) == 0, forward.output
    finally:
        if forward.running():
            forward.kill()
    down = rt(infra, "down", "tiny-grpo", timeout=300)
    print(plain(down.output))
    assert down.returncode == 0, down.output
    tbmod.poll(lambda: not node_sh(infra, "squeue -h -o '%j'").strip(), 60, "SkyPilot's Slurm job to end")
    assert "No existing clusters." in plain(infra.sky("status", timeout=120, check=True).output)


def test_a_failing_node_through_rlhf_tasks_launch_provider_sky(sky_slurm, tmp_path):
    """A node whose `run` exits non-zero, launched with `rlhf-tasks launch --provider sky` on the Slurm
    infra: SkyPilot's job is FAILED (`sky queue`), the launcher's summary names the node and its first
    error, `logs --bundle` gathers every node's logs with the task's secret scrubbed; `down` leaves no
    Slurm job."""
    import yaml
    infra = sky_slurm
    secret = "sky-fail-secret-value-42"
    task = {"name": "sky-fail", "nodes": 2, "preflight": False, "resources": {"cpus": 1},
            "secrets": ["FAIL_SECRET"], "setup": ["echo setup sees secret=$FAIL_SECRET"], "checkpoints": {"path": str(tmp_path / "ckpt")},
            "placement": {"backends": ["slurm"]}, "wait": {"head": "2m", "nodes": "2m"},
            "services": [{"name": "web", "where": "every_node", "timeout": "1m",
                          "command": "echo secret=$FAIL_SECRET; "
                                     "if [ \"$SKYPILOT_NODE_RANK\" = 1 ]; then "
                                     "echo 'node1: broken on purpose' >&2; exit 3; fi; "
                                     "exec python3 -m http.server --bind {node_addr} 23111",
                          "ready": {"http": "http://{node_addr}:23111/"}}],
            "job": {"recipe": "command", "submit": "head", "working_dir": None, "timeout": "3m",
                    "args": {"entrypoint": "python3 -c 'print(1)'"}}}
    src = tmp_path / "sky-fail.yaml"
    src.write_text(yaml.safe_dump(task))
    started = time.monotonic()
    launch = rt(infra, "launch", str(src), "--provider", "sky", timeout=900,
                env=infra.env(RAY_AUTH_TOKEN=TOKEN, FAIL_SECRET=secret))
    out = plain(launch.output)
    print(f"rlhf-tasks launch took {time.monotonic() - started:.0f} s\n{out}")
    queue = plain(infra.sky("queue", "sky-fail", timeout=120, check=True).output)  # before autostop takes it
    print(queue)
    assert re.search(r"^1\s+sky-fail\s+root\s.*FAILED", queue, re.M), queue
    assert launch.returncode == 1, out
    assert "SkyPilot: the job on sky-fail ended FAILED" in out, out
    # the headline is the job's failure as SkyPilot says it, not a lost head
    assert "running the job: SkyPilot: the job on sky-fail ended FAILED" in out and "process exited" not in out, out
    assert re.search(r"first error on each node.*: node1 at [\d:]+: starting service web failed: it exited with "
                     r"code 3", out), out
    assert secret not in out
    bundle = rt(infra, "logs", "sky-fail", "--bundle", timeout=300, env=infra.env(FAIL_SECRET=secret))
    said = plain(bundle.output)
    print(said)
    assert bundle.returncode == 0, said
    path = re.search(r"kept them here: (\S+\.tar\.gz)", said).group(1)
    with tarfile.open(infra.laptop_home / path.removeprefix("/root/")) as tar:
        texts = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar if m.isfile()}
    assert "broken on purpose" in texts["node1/node1.log"], texts
    # SkyPilot's job log (setup's lines among it) with the secret's value scrubbed, in every file
    assert "setup sees secret=[secret FAIL_SECRET]" in texts["skypilot/sky-logs.log"], texts["skypilot/sky-logs.log"]
    assert not any(secret in t for t in texts.values())
    down = rt(infra, "down", "sky-fail", timeout=300)
    print(plain(down.output))
    assert down.returncode == 0, down.output
    tbmod.poll(lambda: not node_sh(infra, "squeue -h -o '%j'").strip(), 120, "SkyPilot's Slurm job to end")


def test_ctrl_c_during_sky_launch_leaves_no_cluster_and_no_slurm_job(sky_slurm, tmp_path):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it: the launcher and its `sky launch`)
    while SkyPilot is still provisioning on Slurm (its sbatch job is in squeue, `sky launch` has not returned):
    SkyPilot's API server goes on with the launch, so the launcher `sky down`s the cluster, says so, and exits 130
    (docs/cli.md); afterwards `sky status` has no cluster and squeue no job (issue 39, Ctrl-C)."""
    import signal

    import yaml
    infra = sky_slurm
    task = {"name": "cc", "nodes": 1, "preflight": False, "resources": {"cpus": 1},
            "checkpoints": {"path": str(tmp_path / "ckpt")}, "placement": {"backends": ["slurm"]},
            "job": {"recipe": "command", "submit": "head", "working_dir": None, "timeout": "3m",
                    "max_restarts": 0, "args": {"entrypoint": "python3 -c 'print(1)'"}}}
    (tmp_path / "cc.yaml").write_text(yaml.safe_dump(task))
    started = time.monotonic()
    launch = rt(infra, "launch", str(tmp_path / "cc.yaml"), "--provider", "sky", timeout=0,
                env=infra.env(RAY_AUTH_TOKEN=TOKEN))
    try:
        tbmod.poll(lambda: re.search(r"^cc-\S+$", node_sh(infra, "squeue -h -o '%j'"), re.M) or not launch.running(),
                   300, "SkyPilot's sbatch job for cc")
        assert launch.running() and "Job submitted" not in launch.output, launch.output  # still in `sky launch`
        print(f"Ctrl-C {time.monotonic() - started:.0f} s after the launch began")
        launch.kill(signal.SIGINT)
        code = launch.wait(400)
    finally:
        if launch.running():
            launch.kill()
    out = plain(launch.output)
    print(f"the launcher ended {time.monotonic() - started:.0f} s after it began\n{out}")
    assert code == 130, out
    assert "interrupted before the job's command started: stopping the cluster cc" in out, out
    assert "the job of cc did not run" in out, out
    tbmod.poll(lambda: not node_sh(infra, "squeue -h -o '%j'").strip(), 120, "SkyPilot's Slurm job to end")
    status = plain(infra.sky("status", timeout=120, check=True).output)
    assert "No existing clusters." in status, status
    # the launch request the API server went on with is over, not left to make the cluster again
    request = re.search(r"sky api cancel (\w+)", out).group(1)
    api = plain(infra.sky("api", "status", "-a", timeout=120, check=True).output)
    print(api)
    assert re.search(rf"^{request}\S*\s+\S+\s+sky\.launch\s.*\s(CANCELLED|FAILED)\s*$", api, re.M), api


def test_managed_job_through_the_jobs_controller_in_the_api_server(sky_slurm, tmp_path):
    """`rlhf-tasks launch --provider sky --managed` (`sky jobs launch`) with SkyPilot's jobs controller in
    consolidation mode (`jobs.controller.consolidation_mode: true`: the controller runs inside the local API
    server, no controller cluster): the job's cluster is launched on the Slurm infra, the managed job SUCCEEDS
    (`sky jobs queue`) and its cluster is gone after (squeue empty) (issue 39, managed)."""
    import yaml
    infra = sky_slurm
    config = infra.laptop_home / ".sky" / "config.yaml"
    config.parent.mkdir(exist_ok=True)
    config.write_text(yaml.safe_dump({"jobs": {"controller": {"consolidation_mode": True}}}))
    infra.sky("api", "stop", timeout=120)  # the server reads it at its start
    try:
        # the controller looks at its job only once HEAD https://8.8.8.8 or https://1.1.1.1 answers: played here
        infra.api_start(timeout=240, env=infra.env(**infra.play_connectivity_probe()))
        task = {"name": "mj", "nodes": 1, "preflight": False, "resources": {"cpus": 1},
                "checkpoints": {"path": str(tmp_path / "ckpt")}, "placement": {"backends": ["slurm"]},
                "job": {"recipe": "command", "submit": "head", "working_dir": None, "timeout": "3m",
                        "max_restarts": 0, "args": {"entrypoint": "python3 -c 'print(\"managed job says hi\")'"}}}
        (tmp_path / "mj.yaml").write_text(yaml.safe_dump(task))
        ca = str(infra.play / "probe-tls" / "ca.pem")
        probe = "import requests; print('probe', requests.head('https://1.1.1.1', timeout=5).status_code)"
        tbmod.poll(lambda: "probe 200" in infra.tb.run(infra.tb.laptop, [sys.executable, "-c", probe], background=False,
                                                       timeout=60, env=infra.env(REQUESTS_CA_BUNDLE=ca)).output,
                   60, "the played https://1.1.1.1 to answer", interval=1)
        started = time.monotonic()
        launch = rt(infra, "launch", str(tmp_path / "mj.yaml"), "--provider", "sky", "--managed", timeout=900,
                    env=infra.env(RAY_AUTH_TOKEN=TOKEN))
        out = plain(launch.output)
        log = infra.laptop_home / ".rlhf-tasks" / "runs" / "mj" / "sky" / "sky-jobs-launch.log"
        said = plain(log.read_text(errors="replace")) if log.exists() else "(no sky-jobs-launch.log)"
        print(f"rlhf-tasks launch --managed took {time.monotonic() - started:.0f} s\n{out}\n--- sky jobs launch\n{said}")
        assert launch.returncode == 0, out + said
        assert re.search(r"job mj-sky-managed-\S+: SUCCEEDED in \d+s", out), out
        assert "managed job says hi" in said, said
        queued = []  # the controller marks the job SUCCEEDED once it has taken the job's cluster down

        def succeeded():
            queued.append(plain(infra.sky("jobs", "queue", timeout=180, check=True).output))
            return re.search(r"^\s*1\s+-?\s*mj\s.*\sSUCCEEDED\s", queued[-1], re.M)
        try:
            tbmod.poll(succeeded, 180, "`sky jobs queue` to say SUCCEEDED", interval=3)
        except TimeoutError:
            controller = infra.laptop_home / "sky_logs" / "jobs_controller" / "1.log"  # in the API server's HOME
            raise AssertionError(f"{queued[-1:]}\n--- the controller's log\n"
                                 f"{plain(controller.read_text(errors='replace'))[-4000:]}") from None
        print(queued[-1])
        tbmod.poll(lambda: not node_sh(infra, "squeue -h -o '%j'").strip(), 180, "the managed job's Slurm job to end")
    finally:
        config.unlink()
        infra.sky("api", "stop", timeout=120)  # the next `sky` starts it without consolidation
