"""`--provider slurm` on a real Slurm (tests/slurm_testbed.py: slurmctld, one slurmd per
namespace host). `rlhf-tasks launch` runs on the testbed's "laptop" (a login node: it
reaches slurmctld and the shared filesystem, not the compute nodes' ports).

There is no slurmdbd here, so `sacct` cannot answer: Slurm's own record of a finished
job comes from `scontrol show job` (and the jobcomp file), which is what the provider
reads too (sacct is its fallback where accounting exists).

Of the ways to run an image, podman runs here for real (an image imported from a local
root filesystem); pyxis (not packaged by Debian) and docker (no daemon on this machine)
are checked as rendered text only (tests/test_slurm_render.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

import slurm_testbed as stmod
import testbed as tbmod
from conftest import ROOT, need
from test_e2e_local import FAIL_WITH_SECRET

#: node1 alone is `small`: a heterogeneous job whose first component asks for it has its head there, which is
#: not the first host of the job's sorted node list (test_status_then_down...).
slurm = stmod.make_slurm_fixture(3, features={0: "big", 1: "small", 2: "big"})

#: FAIL_WITH_SECRET, after printing a file of its job.working_dir (the job's own directory).
FAIL_IN_WORKDIR = ("python3 -c 'import json, os; print(open(\"shipped.txt\").read().strip(), flush=True); "
                   "print(\"the key is\", os.environ[\"FX_SECRET\"], flush=True); json.loads(\"{\")'")

#: Processes a compute host keeps between jobs: the Slurm daemons (and the fixture's probes).
IDLE = {"slurmd", "slurmctld", "munged", "sinfo", "scontrol", "squeue"}


def launcher_env(slurm, home: Path, **extra) -> dict[str, str]:
    """The login node's environment: Slurm's config, this checkout first on the path."""
    return slurm.env(PYTHONPATH=str(ROOT), RLHF_TASKS_HOME=str(home), PYTHONUNBUFFERED="1", **extra)


def cli(slurm, args: list[str], cwd: Path, home: Path, background=False, timeout=600, **env):
    return slurm.run(["rlhf-tasks", *args], "laptop", env=launcher_env(slurm, home, **env), cwd=cwd,
                     background=background, timeout=timeout, name=args[0])


def tiny_grpo(tmp_path: Path, steps: int, preflight: bool = True) -> Path:
    """tasks/tiny-grpo.yaml with fewer steps and its checkpoints on the shared filesystem
    (`preflight=False` where a test is not about the run's start: ~8 s a cluster)."""
    task = yaml.safe_load((ROOT / "tasks" / "tiny-grpo.yaml").read_text())
    task["job"]["args"].update(steps=steps, save_every=10)
    if not preflight:
        task["preflight"] = "off"
    task["checkpoints"]["path"] = str(tmp_path / "ckpt")
    path = tmp_path / "tiny-grpo.yaml"
    path.write_text(yaml.safe_dump(task))
    return path


def job_id_in(output: str) -> int:
    return int(re.search(r"submitted Slurm job (\d+)", output).group(1))


def strays(slurm) -> dict[str, list[str]]:
    """{host: command lines} of processes beyond the idle Slurm daemons (agents, Ray, jobs)."""
    found = {}
    for h in slurm.testbed.hosts:
        left = []
        for pid, cmd in slurm.host_processes(h.index):
            try:
                exe = os.path.basename(os.readlink(f"/proc/{pid}/exe")).removesuffix("-wlm")
            except OSError:
                continue
            if exe not in IDLE:
                left.append(cmd[:120])
        if left:
            found[h.name] = left
    return found


def no_strays(slurm, timeout: float = 60) -> None:
    last = {}

    def clean():
        last.clear()
        last.update(strays(slurm))
        return not last
    try:
        tbmod.poll(clean, timeout, "every host back to its Slurm daemons", 0.5)
    except TimeoutError:
        raise AssertionError(f"processes left on the hosts: {last}") from None


@pytest.fixture
def head_name_on_loopback(slurm, tmp_path):
    """node0 resolves its own name to 127.0.1.1 only, as some Debian hosts do (the other
    hosts still resolve it to its address): a mount in node0's namespace, undone after."""
    hosts = (slurm.testbed.hosts_file.read_text().replace(f"{slurm.testbed.hosts[0].ip}\tnode0\n", "")
             + "127.0.1.1\tnode0\n")
    private = tmp_path / "hosts-node0"
    private.write_text(hosts)
    slurm.testbed.sh(0, f"mount --bind {shlex.quote(str(private))} /etc/hosts")
    try:
        assert slurm.testbed.sh(0, "getent ahostsv4 node0").split()[0] == "127.0.1.1"
        assert slurm.testbed.sh(1, "getent ahostsv4 node0").split()[0] == slurm.testbed.hosts[0].ip
        yield
    finally:
        slurm.testbed.sh(0, "umount /etc/hosts")


def test_tiny_grpo_succeeds_and_the_reward_rises(slurm, tmp_path, head_name_on_loopback):
    task = tiny_grpo(tmp_path, steps=20, preflight=False)  # the claim is the run and its reward, not its start
    home = tmp_path / "home"
    run = cli(slurm, ["launch", str(task), "--provider", "slurm"], tmp_path, home, timeout=600)
    out = run.output
    assert run.returncode == 0, out[-6000:]
    job = job_id_in(out)
    # Slurm's record of the job (no sacct here: scontrol / the jobcomp record)
    assert slurm.job_state(job) == ("COMPLETED", 0), slurm.job_info(job)

    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    start, end = rows[0]["mean_reward"], rows[-1]["mean_reward"]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert end > start and f"reward {start:.2f} -> {end:.2f}" in out, (start, end)
    assert rows[-1]["world_size"] == 3 and len(set(rows[-1]["node_ids"])) == 3
    assert f"Slurm job {job}: PENDING" in out or f"Slurm job {job}: RUNNING" in out
    assert f"job tiny-grpo-{job}: SUCCEEDED" in out and f"Slurm job {job} COMPLETED with exit code 0" in out

    # the head never took 127.0.1.1, although its own name resolves to it on node0
    head_out = (home / "runs" / "tiny-grpo" / "slurm" / f"rlhf-tasks-{job}" / "node0.out").read_text()
    assert f"using {slurm.testbed.hosts[0].ip}, this node's address on the route to node1" in head_out
    assert f"node 0 of 3, address {slurm.testbed.hosts[0].ip}, head {slurm.testbed.hosts[0].ip}" in head_out

    token = (home / "clusters" / "tiny-grpo" / "token").read_text()
    script = (home / "runs" / "tiny-grpo" / "slurm" / "tiny-grpo.sbatch").read_text()
    logs = "".join(p.read_text(errors="replace") for p in (home / "runs").rglob("*.out"))
    assert token not in script and token not in out and token not in logs
    no_strays(slurm)


def test_a_failing_job_fails_the_slurm_job_and_a_pending_job_says_why(slurm, tmp_path):
    blocker = tmp_path / "blocker.sh"
    blocker.write_text("#!/bin/bash\nsrun --nodes=3 --ntasks=3 sleep 601\n")
    blocking = slurm.sbatch(blocker, "--nodes=3", "--exclusive")
    task = tmp_path / "fail.yaml"
    task.write_text(yaml.safe_dump({
        "name": "fail", "nodes": 2, "resources": {"cpus": 1}, "ray": {"object_store_memory": "80MB"}, "preflight": "off",
        "checkpoints": {"path": str(tmp_path / "ckpt")}, "wait": {"head": "3m", "nodes": "3m"},
        "secrets": ["FX_SECRET"],
        "job": {"recipe": "command", "working_dir": "code", "timeout": "5m", "max_restarts": 0,
                "args": {"entrypoint": FAIL_IN_WORKDIR}}}))
    # job.working_dir, relative: of the task file's directory (on the shared filesystem), read by the head
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "shipped.txt").write_text("shipped from the launcher's directory\n")
    home = tmp_path / "home"
    secret = "fx-secret-value-0123456789"
    try:
        slurm.wait_running(blocking)
        launch = cli(slurm, ["launch", str(task), "--provider", "slurm"], tmp_path, home, background=True,
                     FX_SECRET=secret)
        tbmod.poll(lambda: re.search(r"Slurm job \d+: PENDING \((Resources|Priority)\)", launch.output), 60,
                   "the launcher to show the job PENDING with Slurm's reason")
    finally:
        slurm.scancel(blocking)
    assert launch.wait(600) == 1, launch.output[-6000:]
    out = launch.output
    job = job_id_in(out)
    assert slurm.job_state(job) == ("FAILED", 1), slurm.job_info(job)
    assert f"job fail-{job}: FAILED" in out and f"Slurm job {job} FAILED with exit code 1" in out
    assert f"failed: running job fail-{job}: it ended FAILED" in out  # the launcher's one verdict
    assert "shipped from the launcher's directory" in out  # the job ran in its working_dir, uploaded by the head
    # The failure's forensics (issue 22): the head's driver raised; the bundle is on the shared filesystem.
    firsts = out[out.index("first error on each node:"):].splitlines()
    assert firsts[1].strip().startswith("node0 (") and "json.decoder.JSONDecodeError" in firsts[1], out[-3000:]
    bundle = Path(re.search(r"every node's logs: (\S+\.tar\.gz)", out).group(1))
    with tarfile.open(bundle) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert {"node0/rlhf-tasks/agent-node0.log", "node1/rlhf-tasks/agent-node1.log", "index.json"} <= set(members)
    assert "the key is [secret FX_SECRET]" in "".join(members.values())
    assert not any(secret in text for text in members.values())
    no_strays(slurm)


def test_status_then_down_in_the_middle_of_a_run_leaves_no_process(slurm, tmp_path):
    """Two nodes as two node groups (issue 46): a heterogeneous job, one component per group, each on the
    nodes its own placement.slurm.constraint picks; the head is the first group's node though it is not the
    first of the job's hosts by name; every group's nodes in before the job (the head's count, from Ray's own
    node labels); then status and down of the whole job mid-run."""
    task = tiny_grpo(tmp_path, steps=100000, preflight=False)
    spec = yaml.safe_load(task.read_text())
    del spec["nodes"], spec["resources"]  # a worker beside the head is all the claim needs (one node stays idle)
    where = f"echo $(hostname) {{group}} $RLHF_TASKS_NODE_RANK >> {tmp_path}/groups.txt"
    spec["groups"] = [
        {"name": "trainer", "nodes": 1, "resources": {"cpus": 1}, "setup": [where],
         "placement": {"slurm": {"constraint": "small"}}},
        {"name": "reward", "nodes": 1, "resources": {"cpus": 1}, "setup": [where],
         "placement": {"slurm": {"constraint": "big"}}}]
    task.write_text(yaml.safe_dump(spec))
    home = tmp_path / "home"
    launch = cli(slurm, ["launch", str(task), "--provider", "slurm"], tmp_path, home, background=True)
    tbmod.poll(lambda: "submitted Slurm job" in launch.output, 60, "the launcher to submit")
    job = job_id_in(launch.output)
    tbmod.poll(lambda: re.search(r"step \d+/100000 ", launch.output) or not launch.running(), 300,
               "the training to report a step")
    assert launch.running(), launch.output[-6000:]

    status = cli(slurm, ["status", "tiny-grpo"], tmp_path, home, timeout=120)
    assert status.returncode == 0, status.output
    assert f"Slurm job {job}: RUNNING" in status.output
    assert f"job tiny-grpo-{job}: RUNNING" in status.output, status.output
    components = slurm.sh(["scontrol", "-o", "show", "job", str(job)], name="scontrol-het").splitlines()
    assert [re.search(r" NodeList=(\S+)", line).group(1) for line in components][0] == "node1", components
    ran = sorted((tmp_path / "groups.txt").read_text().split("\n")[:2])
    (reward_host,) = [line.split()[0] for line in ran if " reward " in line]
    assert ran == sorted(["node1 trainer 0", f"{reward_host} reward 1"]) and reward_host in ("node0", "node2"), ran
    run_dir = home / "runs" / "tiny-grpo" / "slurm" / f"rlhf-tasks-{job}"
    logs = "".join(p.read_text(errors="replace") for p in sorted(run_dir.rglob("*")) if p.is_file())
    assert "cluster ready: group trainer: 1 of 1 nodes; group reward: 1 of 1 nodes" in logs, logs[-3000:]

    down = cli(slurm, ["down", "tiny-grpo"], tmp_path, home, timeout=300)
    assert down.returncode == 0 and f"cancelled Slurm job {job}; its steps are gone" in down.output, down.output
    assert slurm.job_state(job).state == "CANCELLED"
    assert launch.wait(120) == 1, launch.output[-4000:]
    assert f"Slurm job {job} CANCELLED" in launch.output
    no_strays(slurm)  # raylets, GCS, dashboard, reward server, trainer, agents: all gone


def test_sbatch_test_only_takes_the_guides_options_and_refuses_in_its_own_words(slurm, tmp_path):
    """`check --provider slurm` and `launch` on a login node ask the real sbatch --test-only (its parser, then
    slurmctld; nothing submitted): the guides' options are taken with Slurm's estimate; a refusal exits 2 naming
    the field of the line without which sbatch takes the script, in sbatch's words, and `launch` writes nothing."""
    home = tmp_path / "home"

    def task(**options) -> str:
        path = tmp_path / "opts.yaml"
        path.write_text(yaml.safe_dump({
            "name": "opts", "nodes": 2, "resources": {"cpus": 1}, "checkpoints": {"path": str(tmp_path / "ckpt")},
            "placement": {"max_duration": "10m", "slurm": options},
            "job": {"recipe": "command", "working_dir": None, "args": {"entrypoint": "true"}}}))
        return str(path)

    good = task(nodelist="node[1-2]", output="logs/%x-%j.out", mail_type=["END"], mail_user="rlhf@example.org",
                overcommit=True, sbatch=["--mem=0", "--comment=x"])
    taken = cli(slurm, ["check", good, "--provider", "slurm"], tmp_path, home)
    assert taken.returncode == 0, taken.output
    assert re.search(r"asked +slurm(?:-wlm)? 22\.05\.\d+'s sbatch --test-only takes opts\.sbatch: sbatch: Job \d+ to start at "
                     r"\S+ using \d+ processors on nodes node\[1-2\] in partition main", taken.output), taken.output
    for options, fields, words in (
            ({"nodelist": "node[0-2]"}, "placement.slurm.nodelist, nodes", "sbatch: error: invalid number of nodes "
                                                                          "(-N 3-2)"),
            ({"partition": "gpu"}, "placement.slurm.partition", "Invalid partition name specified"),
            ({"sbatch": ["--comment=ok", "--bogus=1"]}, "placement.slurm.sbatch[1]",
             "sbatch: unrecognized option '--bogus=1'"),
            ({"sbatch": ["--mail-type=FAILED"]}, "placement.slurm.sbatch[0]",
             "sbatch: error: Invalid --mail-type specification")):
        refused = cli(slurm, ["check", task(**options), "--provider", "slurm"], tmp_path, home)
        assert refused.returncode == 2, refused.output
        assert re.search(rf"{re.escape(fields)}: slurm(?:-wlm)? 22\.05\.\d+'s sbatch --test-only refuses opts\.sbatch: .*"
                         rf"{re.escape(words)}", refused.output), refused.output
    launch = cli(slurm, ["launch", task(partition="gpu"), "--provider", "slurm"], tmp_path, home)
    assert launch.returncode == 2 and "placement.slurm.partition: " in launch.output, launch.output
    assert not (home / "runs").exists() and "submitted Slurm job" not in launch.output


GLOO_PROGRAM = """
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(f"GLOO rank {rank} of {world} on {socket.gethostname()} node {os.environ['GROUP_RANK']}: sum {value.item():g}",
      flush=True)
dist.destroy_process_group()
"""


def test_torchrun_recipe_runs_a_gloo_program_on_two_nodes(slurm, tmp_path):
    program = tmp_path / "allreduce.py"
    program.write_text(GLOO_PROGRAM)
    task = tmp_path / "gloo.yaml"
    task.write_text(yaml.safe_dump({
        "name": "gloo", "nodes": 2, "resources": {"cpus": 1}, "wait": {"head": "2m"},
        # Slurm's own options as the guides write them (issue 47 item 2), and two through the pass-through
        "placement": {"slurm": {"nodelist": "node[0-1]", "output": "logs/%x-%j.out", "error": "logs/%x-%j.err",
                                "mail_type": "END,fail", "mail_user": "rlhf@example.org", "overcommit": True,
                                "sbatch": ["--mem=0", "--comment=gloo-run"]}},
        "job": {"recipe": "torchrun", "timeout": "5m",
                "args": {"script": str(program), "nproc_per_node": 2, "port": 29517}}}))
    home = tmp_path / "home"
    run = cli(slurm, ["launch", str(task), "--provider", "slurm"], tmp_path, home, timeout=300)
    out = run.output
    assert run.returncode == 0, out[-6000:]
    job = job_id_in(out)
    assert slurm.job_state(job) == ("COMPLETED", 0), slurm.job_info(job)
    # What slurmctld made of the rendered lines; the script's output where the task put it, followed by launch
    submitted = home / "runs" / "gloo" / "slurm"
    info = slurm.job_info(job)
    assert (info["ReqNodeList"], info["MailType"], info["MailUser"], info["MinMemoryNode"], info["Comment"]) == (
        "node[0-1]", "END,FAIL", "rlhf@example.org", "0", "gloo-run"), info
    assert (info["StdOut"], info["StdErr"]) == (f"{submitted}/logs/gloo-{job}.out", f"{submitted}/logs/gloo-{job}.err")
    assert f"rlhf-tasks: the node agents ended with exit code 0" in (submitted / "logs" / f"gloo-{job}.out").read_text()
    assert f"rlhf-tasks: job {job} on node[0-1]" in out
    run_dir = submitted / f"rlhf-tasks-{job}"
    lines = "".join((run_dir / f"node{n}.out").read_text() for n in range(2))
    ranks = sorted(re.findall(r"GLOO rank (\d) of 4 on (node\d) node (\d): sum 10", lines))
    assert ranks == [("0", "node0", "0"), ("1", "node0", "0"), ("2", "node1", "1"), ("3", "node1", "1")], lines
    assert "ray start" not in lines  # no Ray at all
    assert f"Slurm job {job} COMPLETED with exit code 0" in out
    no_strays(slurm)


# ------------------------------------------------------------------ the podman variant

PODMAN_CONF = """[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
# On each host's private /tmp: every node its own image store, as on a real cluster.
PODMAN_STORAGE = """[storage]
driver = "vfs"
graphroot = "/tmp/podman-rlhf/storage"
runroot = "/tmp/podman-rlhf/run"
"""
THIN_IMAGE = "localhost/rlhf-thin:test"
IMAGE_SITE = "/image/site"  # the thin image's own PYTHONPATH


@pytest.fixture
def podman_image(slurm, tmp_path):
    """An image imported on every host from a local root filesystem (no registry): empty but
    for /etc/passwd; the machine's /usr, Python and this checkout are mounted into it by the
    task (placement.slurm.mounts), its PATH puts the venv's python3 first. Yields the
    environment podman needs here (what a site's /etc/containers holds): runc, not crun
    (crun refuses this machine's hybrid cgroups), and rlimits no higher than the machine's
    (no CAP_SYS_RESOURCE here)."""
    for tool in ("podman", "runc", "catatonit"):
        need(shutil.which(tool) is not None or os.path.exists(f"/usr/libexec/podman/{tool}"),
             "podman, runc and catatonit (apt-get install podman runc catatonit)")
    import resource
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    (tmp_path / "containers.conf").write_text(PODMAN_CONF.format(nofile=nofile, nproc=nproc))
    (tmp_path / "storage.conf").write_text(PODMAN_STORAGE)
    env = {"CONTAINERS_CONF": str(tmp_path / "containers.conf"),
           "CONTAINERS_STORAGE_CONF": str(tmp_path / "storage.conf")}
    rootfs = tmp_path / "rootfs"
    for sub in ("usr", "etc", "tmp", "proc", "dev", "sys", "root", "run", "var/tmp"):
        (rootfs / sub).mkdir(parents=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        (rootfs / link).symlink_to(f"usr/{link}")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\n")
    (rootfs / "tmp").chmod(0o1777)
    # a package only the image's own PYTHONPATH finds (as in images that rely on PYTHONPATH)
    (rootfs / "image" / "site").mkdir(parents=True)
    (rootfs / "image" / "site" / "image_site_marker.py").write_text("")
    tarball = tmp_path / "rootfs.tar"
    slurm.testbed.sh(0, f"tar -C {shlex.quote(str(rootfs))} -cf {shlex.quote(str(tarball))} .")
    path = f"{tbmod.BIN_DIR}:/usr/local/bin:/usr/bin:/bin"
    for h in slurm.testbed.hosts:
        slurm.testbed.sh(h.index, f"podman import --change ENV=PATH={path} --change ENV=PYTHONPATH={IMAGE_SITE} "
                         f"{shlex.quote(str(tarball))} {THIN_IMAGE}",
                         env=slurm.env(**env))
    before = set(Path("/sys/fs/cgroup").glob("*/libpod_parent"))
    yield env
    # podman (cgroupfs) leaves its empty parent cgroups on the machine: remove those it made
    for parent in set(Path("/sys/fs/cgroup").glob("*/libpod_parent")) - before:
        for cgroup in sorted((p for p in parent.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [parent]:
            try:
                cgroup.rmdir()
            except OSError:
                pass  # still in use


def podman_task(tmp_path: Path, steps: int) -> Path:
    """tiny-grpo on 2 nodes in the thin image, with podman; setup records the container's PID 1 and
    the PYTHONPATH it runs with (the image's own, after the agent's lib/), importing from both."""
    task = tiny_grpo(tmp_path, steps=steps)
    spec = yaml.safe_load(task.read_text())
    here = sorted({str(ROOT), sys.prefix, sys.base_prefix})
    spec.update(nodes=2, image=THIN_IMAGE, preflight="off")
    # setup runs where the agent runs: PID 1 there is podman's init, not the host's
    spec["setup"] = [f"tr '\\0' ' ' < /proc/1/cmdline > {tmp_path}/ckpt/pid1-node$SLURM_NODEID",
                     "python3 -c 'import image_site_marker, rlhf_tasks.demo, os; print(os.environ[\"PYTHONPATH\"])' "
                     f"> {tmp_path}/ckpt/pythonpath-node$SLURM_NODEID"]
    spec["placement"] = {"slurm": {"container": "podman", "mounts": ["/usr:/usr:ro", *(f"{p}:{p}:ro" for p in here)]}}
    task.write_text(yaml.safe_dump(spec))
    return task


def no_containers(slurm, env: dict[str, str]) -> None:
    for h in slurm.testbed.hosts:  # --rm, even when the job was cancelled
        assert not slurm.testbed.sh(h.index, "podman ps -aq", env=slurm.env(**env)).strip(), h.name


def test_the_podman_variant_runs_the_agents_in_containers(slurm, tmp_path, podman_image):
    task = podman_task(tmp_path, steps=10)
    home = tmp_path / "home"
    run = cli(slurm, ["launch", str(task), "--provider", "slurm"], tmp_path, home, timeout=600, **podman_image)
    out = run.output
    assert run.returncode == 0, out[-6000:]
    job = job_id_in(out)
    assert slurm.job_state(job) == ("COMPLETED", 0), slurm.job_info(job)
    assert f"job tiny-grpo-{job}: SUCCEEDED" in out and "reward " in out, out[-6000:]  # CI saw this fail once, its output cut off
    script = (home / "runs" / "tiny-grpo" / "slurm" / "tiny-grpo.sbatch").read_text()
    assert "podman run --rm --init" in script
    run_dir = home / "runs" / "tiny-grpo" / "slurm" / f"rlhf-tasks-{job}"
    for n in range(2):
        assert "node %d of 2" % n in (run_dir / f"node{n}.out").read_text()
        assert (tmp_path / "ckpt" / f"pid1-node{n}").read_text().startswith("/run/podman-init -- python3 ")
        # the image's PYTHONPATH kept, the agent's lib/ before it (issue 32, item 3)
        assert (tmp_path / "ckpt" / f"pythonpath-node{n}").read_text() == f"{run_dir}/lib:{IMAGE_SITE}\n"
    no_strays(slurm)  # podman, conmon and the containers' processes are gone too
    no_containers(slurm, podman_image)


def test_down_stops_the_podman_containers(slurm, tmp_path, podman_image):
    home = tmp_path / "home"
    launch = cli(slurm, ["launch", str(podman_task(tmp_path, steps=100000)), "--provider", "slurm"], tmp_path, home,
                 background=True, **podman_image)
    tbmod.poll(lambda: re.search(r"step \d+/100000 ", launch.output) or not launch.running(), 300,
               "the training to report a step")
    assert launch.running(), launch.output[-6000:]
    job = job_id_in(launch.output)
    down = cli(slurm, ["down", "tiny-grpo"], tmp_path, home, timeout=300, **podman_image)
    # asked to stop (not killed), the job stopped every node's container by name, then ended
    assert down.returncode == 0 and f"stopped Slurm job {job} and its podman containers" in down.output, down.output
    no_containers(slurm, podman_image)  # already: down returns once the job (and its clean-up step) ended
    assert launch.wait(120) == 1
    no_strays(slurm)


#: A mount namespace of the test's own where the AMD GPU's devices exist (this machine has none): the
#: host's /dev under a tmpfs that adds /dev/kfd, /dev/dri and /dev/infiniband as device nodes.
AMD_DEVICES = """set -e
mount --make-rprivate /
mount --rbind /dev "$host_dev"
mount -t tmpfs tmpfs /dev
for name in null zero full random urandom tty; do touch "/dev/$name"; mount --bind "$host_dev/$name" "/dev/$name"; done
mkdir /dev/shm /dev/pts /dev/dri /dev/infiniband
mount --bind "$host_dev/shm" /dev/shm
mknod /dev/kfd c 1 3
mknod /dev/dri/renderD128 c 1 5
mknod /dev/infiniband/uverbs0 c 1 7
"""


@pytest.mark.cluster
@pytest.mark.parametrize("privileged", [False, True])
def test_podman_takes_the_amd_lines_as_verls_amd_script_runs_them(privileged, tmp_path):
    """The podman variant's lines for an AMD task (tasks/verl-ppo-gsm8k-mi300x.yaml), as podman reads them:
    the rendered `podman run` options, expanded by bash as the script is, given to `podman create` (run's
    options) in a store of the test's own, and the container inspected: verl's AMD script's devices, group,
    capability and seccomp, and --privileged where the site opts in (placement.slurm.privileged)."""
    for tool in ("podman", "unshare", "mknod"):
        need(shutil.which(tool) is not None, f"{tool} (apt-get install podman util-linux coreutils)")
    need(os.geteuid() == 0, "root, to make the GPU's device nodes in a mount namespace")
    from rlhf_tasks import providers
    from rlhf_tasks.spec import parse_task

    data = yaml.safe_load((ROOT / "tasks" / "verl-ppo-gsm8k-mi300x.yaml").read_text())
    data["checkpoints"]["path"] = str(tmp_path / "ckpt")
    data["placement"]["slurm"] = {"container": "podman", "privileged": privileged}
    provider = providers.get("slurm")
    (script,) = provider.render(provider.plan(parse_task(data))).values()
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("podman run --rm --init"))
    end = lines.index(f"    {shlex.quote(data['image'])} \\")
    options = "\n".join(lines[start:end]).replace("podman run", "podman create", 1)
    for sub in ("rootfs/etc", "run", "ckpt", "host_dev"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "rootfs" / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\n")
    (tmp_path / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{tmp_path}/storage"\nrunroot = "{tmp_path}/runroot"\n')
    (tmp_path / "containers.conf").write_text('[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n'
                                              'events_logger = "file"\n')
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "CONTAINERS_STORAGE_CONF": str(tmp_path / "storage.conf"),
           "CONTAINERS_CONF": str(tmp_path / "containers.conf"), "host_dev": str(tmp_path / "host_dev"),
           "run_dir": str(tmp_path / "run"), "container": "amd-lines"}
    create = (AMD_DEVICES + options + f"\n    --rootfs {tmp_path}/rootfs true >/dev/null\n"
              "podman inspect --format '{{json .HostConfig}}' amd-lines\npodman rm amd-lines >/dev/null\n")
    made = subprocess.run(["unshare", "--mount", "bash", "-c", create], env=env, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    host = json.loads(made.stdout)
    assert host["SecurityOpt"] == ["seccomp=unconfined"] and host["GroupAdd"] == ["video"], host
    # --privileged has every capability: podman then lists none as added
    assert (host["Privileged"], host["CapAdd"]) == ((True, []) if privileged else (False, ["CAP_SYS_PTRACE"]))
    # the task's 128GB /dev/shm, in the container's own IPC namespace (podman refuses the size with the host's)
    assert (host["NetworkMode"], host["IpcMode"], host["ShmSize"]) == ("host", "shareable", 128 * 10**9)
    devices = {d["PathInContainer"] for d in host["Devices"]}  # --privileged: the host's, all of them, at start
    assert devices == (set() if privileged else {"/dev/kfd", "/dev/dri/renderD128", "/dev/infiniband/uverbs0"})


# A cluster whose Slurm tracks a task by its process group only (proctrack/pgid): the
# agent's children (Ray, services, each in a session of its own) are invisible to it, so
# only the agent's own clean-up, and the kernel killing its children with it, stop them.
slurm_pgid = stmod.make_slurm_fixture(2, proctrack="proctrack/pgid")


def test_down_leaves_no_process_where_slurm_sees_only_the_agents(slurm_pgid, tmp_path):
    task = tiny_grpo(tmp_path, steps=100000, preflight=False)
    spec = yaml.safe_load(task.read_text())
    spec["nodes"] = 2
    task.write_text(yaml.safe_dump(spec))
    home = tmp_path / "home"
    launch = cli(slurm_pgid, ["launch", str(task), "--provider", "slurm"], tmp_path, home, background=True)
    tbmod.poll(lambda: re.search(r"step \d+/100000 ", launch.output) or not launch.running(), 300,
               "the training to report a step")
    assert launch.running(), launch.output[-6000:]
    job = job_id_in(launch.output)
    down = cli(slurm_pgid, ["down", "tiny-grpo"], tmp_path, home, timeout=300)
    assert down.returncode == 0, down.output
    assert slurm_pgid.job_state(job).state == "CANCELLED"
    assert launch.wait(120) == 1
    no_strays(slurm_pgid)

