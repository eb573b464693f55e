"""SkyPilot's cloud path on namespace hosts, driven by SkyPilot's own code (see README.md here).

A cloud VM as SkyPilot's provisioner leaves it: SkyPilot's runtime virtualenv (its pinned Ray,
SKY_REMOTE_RAY_VERSION, and this SkyPilot) at ~/skypilot-runtime with ~/.sky/python_path and
~/.sky/ray_path naming it, ~/sky_workdir made, and SkyPilot's Ray started by the command
SkyPilot's provisioner builds (instance_setup.ray_head_start_command / ray_worker_start_command),
run by SkyPilot's own CommandRunner command line (which exports OMP_NUM_THREADS=1 first). Then
`sky launch`'s execution as its backend does it: CloudVmRayBackend._setup (setup on every node
through its runners), _add_job and _execute_task_n_nodes (RayCodeGen's driver, queued through
job_lib on the head and started by its scheduler), the job's status through get_job_status.

SkyPilot's client reaches the hosts as it reaches a cloud's VMs: its own SSHCommandRunner, a real
ssh to a real sshd on each host (the ssh client in the laptop's network namespace), each host's
root with its own home (the host's /etc/passwd says so).

What is played: the upload (streamed through SkyPilot's ssh command line: no rsync here), the
handle (the few fields the backend reads), the file_mounts / workdir copy, and the VM image (the
hosts' python is this checkout's virtualenv, with Ray 2.60 and torch, on PATH through ~/.bashrc
as a VM image's conda would be).
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import testbed as tbmod

BUILD_TIMEOUT = 900  # the runtime's pip install from PyPI: 67 s here
CACHE = Path(os.environ.get("RLHF_TASKS_CACHE", Path.home() / ".cache" / "rlhf-tasks")) / "sky"


def versions() -> tuple[str, str]:
    """(SkyPilot's pinned remote Ray, this SkyPilot), as SkyPilot's own code says."""
    from importlib.metadata import version

    from sky.skylet import constants

    return constants.SKY_REMOTE_RAY_VERSION, version("skypilot")


def runtime() -> Path:
    """SkyPilot's runtime virtualenv, built once per (Ray, SkyPilot, Python) version under CACHE
    from PyPI with the pins SkyPilot's RAY_INSTALLATION_COMMANDS uses; later runs reuse it."""
    ray_version, sky_version = versions()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = CACHE / f"runtime-ray{ray_version}-sky{sky_version}-py{py}"
    if (target / ".complete").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time (pytest-xdist workers, parallel runs)
        if (target / ".complete").exists():
            return target
        building = target.with_name(target.name + ".tmp")
        shutil.rmtree(building, ignore_errors=True)
        python = Path(sys.base_prefix) / "bin" / f"python{py}"
        started = time.monotonic()
        subprocess.run([str(python), "-m", "venv", str(building)], check=True)
        # SkyPilot installs its own wheel with [remote] and Ray with these pins (constants.RAY_INSTALLATION_COMMANDS).
        argv = [str(building / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                f"ray[default]=={ray_version}", "pydantic-core==2.41.1", "click<8.3.0",
                f"skypilot[remote]=={sky_version}"]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"installing SkyPilot's runtime took over {BUILD_TIMEOUT} s (67 s is usual):\n"
                               f"{(exc.stdout or b'')[-3000:]!r}\n{(exc.stderr or b'')[-3000:]!r}") from None
        if out.returncode != 0:
            raise RuntimeError(f"installing SkyPilot's runtime (ray {ray_version}, skypilot {sky_version}) failed:\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        (building / ".complete").write_text(f"built in {time.monotonic() - started:.0f} s\n")
        building.rename(target)
    return target


# Every command SkyPilot's runner sends a host is bounded (SkyPilot passes no timeout of its own):
# a command that hangs fails the test with subprocess.TimeoutExpired instead of hanging it.
COMMAND_TIMEOUT = 300


def host_runner(tb, rank: int, key: Path):
    """SkyPilot's own SSHCommandRunner to a testbed host's sshd (root@<host ip>:22, the testbed's
    key). The one played part: its ssh runs in the laptop's network namespace (`nsenter --net`),
    the machine `sky launch` runs on, since this process's namespace has no route to the hosts.

    A real ssh matters: log_lib.run_with_log starts SkyPilot's subprocess_daemon for every command,
    which polls the local process tree each second and, once the command ends, SIGTERMs every
    descendant it last saw. Over ssh those are the ssh client only; with `nsenter` as the
    transport they were the host's own processes, and the raylet that `ray start` had just forked
    on the worker got SIGTERM (its raylet.out: "Raylet received SIGTERM, shutting down...") a
    second after the worker joined: RayCodeGen then waited forever for 2 nodes."""
    from sky.utils import command_runner

    netns = f"--net=/run/netns/{tb.laptop.netns}"

    class _Runner(command_runner.SSHCommandRunner):
        def ssh_base_command(self, **kwargs):
            return [tbmod.NSENTER, netns, "--", *super().ssh_base_command(**kwargs)]

        def run(self, cmd, **kwargs):
            kwargs.setdefault("timeout", COMMAND_TIMEOUT)
            return super().run(cmd, **kwargs)

        def rsync(self, source, target, *, up, log_path=os.devnull, stream_logs=True, max_retry=1,
                  timeout=None):
            # Played upload (this machine has no rsync): the file, or the directory's contents
            # as `rsync src/ dst` copies them, streamed through SkyPilot's own ssh command line.
            if not up:
                raise NotImplementedError("download")
            remote = (f"~/{shlex.quote(target[2:])}" if target.startswith("~/") else shlex.quote(target))
            ssh = self.ssh_base_command(ssh_mode=command_runner.SshMode.NON_INTERACTIVE, port_forward=None,
                                        connect_timeout=None)
            if os.path.isdir(source):
                pack = subprocess.Popen(["tar", "-C", source, "-cf", "-", "."], stdout=subprocess.PIPE)
                stdin, unpack = pack.stdout, f"mkdir -p {remote} && tar -C {remote} -xf -"
            else:
                pack, stdin = None, open(source, "rb")
                unpack = f"mkdir -p $(dirname {remote}) && cat > {remote}"
            with stdin:
                out = subprocess.run([*ssh, unpack], stdin=stdin, capture_output=True,
                                     timeout=timeout or COMMAND_TIMEOUT)
            if pack is not None:
                pack.wait(COMMAND_TIMEOUT)
            if out.returncode != 0 or (pack is not None and pack.returncode != 0):
                raise RuntimeError(f"upload of {source} to {self.node_id}:{target} failed "
                                   f"({out.returncode}): {out.stderr.decode(errors='replace')[-2000:]}")

    runner = _Runner((tb.host(rank).ip, 22), ssh_user="root", ssh_private_key=str(key),
                     disable_control_master=True)
    runner.rank = rank
    return runner


class SkyCluster:
    """`nodes` testbed hosts made into a SkyPilot cloud cluster, SkyPilot's Ray running on them."""

    def __init__(self, tb, tmp_path: Path, nodes: int, name: str = "sky-test"):
        from sky.skylet import constants

        self.tb, self.name, self.nodes = tb, name, nodes
        self.runtime = runtime()
        self.homes = [tmp_path / f"home-{tb.hosts[i].name}" for i in range(nodes)]
        tbmod.ensure_sshd()
        key = tb._ssh_keys()  # pylint: disable=protected-access  (the testbed's sshd and key)
        passwd = Path("/etc/passwd").read_text().splitlines()
        for i, home in enumerate(self.homes):
            (home / ".sky").mkdir(parents=True)
            os.symlink(self.runtime, home / constants.SKY_REMOTE_PYTHON_ENV_NAME)
            env_dir = home / constants.SKY_REMOTE_PYTHON_ENV_NAME
            (home / ".sky" / "python_path").write_text(f"{env_dir}/bin/python\n")
            (home / ".sky" / "ray_path").write_text(f"{env_dir}/bin/ray\n")
            # The VM image's own python (ray 2.60, torch: what the task's setup checks for) first on
            # PATH for the user, as an image's conda or venv activation in ~/.bashrc puts it.
            (home / ".bashrc").write_text(f"export PATH={tbmod.BIN_DIR}:$PATH\n")
            # Each host's root has its own home (the hosts share this machine's files): the host's
            # /etc/passwd says so, and sshd logs root in there (HOME, ~, the login's cwd).
            mine = tmp_path / f"passwd-{tb.hosts[i].name}"
            mine.write_text("\n".join(":".join(f[:5] + [str(home)] + f[6:]) if f[0] == "root" else line
                                      for line in passwd for f in [line.split(":")]) + "\n")
            tb.sh(i, f"mount --bind {shlex.quote(str(mine))} /etc/passwd")
            # A VM's default route (Ray finds its node address through it); the bridge has no way out.
            subprocess.run(["ip", "-n", tb.hosts[i].netns, "route", "replace", "default", "dev", "eth0"], check=True)
            tb._start_sshd(tb.hosts[i], 30)  # pylint: disable=protected-access
        self.runners = [host_runner(tb, i, key) for i in range(nodes)]
        for runner in self.runners:
            self._ok(runner, constants.SETUP_SKY_DIRS_COMMANDS, "making SkyPilot's directories")

    @property
    def ips(self) -> list[str]:
        return [self.tb.hosts[i].ip for i in range(self.nodes)]

    @staticmethod
    def _ok(runner, cmd: str, what: str, **kw) -> str:
        code, out, err = runner.run(cmd, require_outputs=True, stream_logs=False, **kw)
        if code != 0:
            raise RuntimeError(f"{what} on {runner.node_id} failed ({code}):\n{out[-3000:]}\n{err[-3000:]}")
        return out

    def start_ray(self) -> None:
        """SkyPilot's Ray as its provisioner starts it (instance_setup.start_ray_on_head_node and
        start_ray_on_worker_nodes: these commands, source_bashrc=True, through the runner)."""
        from sky.provision import instance_setup
        from sky.skylet import constants

        self._ok(self.runners[0], instance_setup.ray_head_start_command(None, None), "starting SkyPilot's Ray head",
                 source_bashrc=True)
        worker = (f'export SKYPILOT_RAY_HEAD_IP="{self.ips[0]}"; export SKYPILOT_RAY_PORT={constants.SKY_REMOTE_RAY_PORT}; '
                  + instance_setup.ray_worker_start_command(None, None, no_restart=False))
        for runner in self.runners[1:]:
            self._ok(runner, worker, "starting SkyPilot's Ray worker", source_bashrc=True)
        self.wait_nodes(60)

    def ray_status(self) -> str:
        """`ray status` of SkyPilot's Ray on the head, by SkyPilot's own command."""
        from sky.provision import instance_setup

        code, out, err = self.runners[0].run(instance_setup.RAY_STATUS_WITH_SKY_RAY_PORT_COMMAND,
                                             require_outputs=True, stream_logs=False, separate_stderr=True,
                                             timeout=60)
        return out if code == 0 else f"(ray status failed, {code}) {out}\n{err}"

    def wait_nodes(self, timeout: float) -> None:
        """Every node alive in SkyPilot's Ray, counted as SkyPilot counts them from `ray status`
        (backend_utils._count_healthy_nodes_from_ray, as wait_until_ray_cluster_ready does)."""
        from sky.backends import backend_utils

        seen = {"status": ""}

        def all_up():
            seen["status"] = self.ray_status()
            return sum(backend_utils._count_healthy_nodes_from_ray(seen["status"])) == self.nodes  # pylint: disable=protected-access

        try:
            tbmod.poll(all_up, timeout, f"{self.nodes} nodes in SkyPilot's Ray", 1)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nray status:\n{seen['status']}\n{self.diagnosis()}") from None

    def diagnosis(self) -> str:
        """What to look at when SkyPilot's Ray or job is stuck: each host's raylet log tail."""
        parts = []
        for i in range(self.nodes):
            out = self.tb.run(i, "tail -n 15 /tmp/ray_skypilot/session_latest/logs/raylet.out; "
                                 "pgrep -a raylet | cut -c1-150", background=False, timeout=30).output
            parts.append(f"--- {self.tb.hosts[i].name}: raylet.out tail, raylets\n{out}")
        return "\n".join(parts)

    def handle(self):
        """What CloudVmRayBackend reads of a CloudVmRayResourceHandle on the legacy (SSH) path."""
        return SimpleNamespace(
            cluster_name=self.name, cluster_name_on_cloud=self.name, num_ips_per_node=1,
            is_grpc_enabled_with_flag=False, internal_ips=lambda: list(self.ips),
            get_command_runners=lambda *a, **k: list(self.runners), head_ip=self.ips[0],
            launched_resources=SimpleNamespace(cloud="played-cloud", region="played-region", zone=None,
                                               extract_docker_image=lambda: None),
            provision_runtime_metadata=SimpleNamespace(setup_done=False), cached_cluster_info=None,
            docker_user=None, ssh_user="root")

    def place(self, task, render_dir: Path) -> None:
        """What `sky launch` uploads before it runs anything: file_mounts and the workdir (to
        ~/sky_workdir), resolved by SkyPilot's Task against the directory it runs from."""
        for i in range(self.nodes):
            self.tb.own(i, "/opt")  # the VM's own /opt (tests/testbed.py own)
            script = ["true"]
            for destination, source in (task.file_mounts or {}).items():
                # as rsync does it: a directory's contents into the destination, merged with what
                # an earlier launch left there (`cp -r` would nest it inside an existing one)
                src, dst = shlex.quote(source), shlex.quote(destination)
                script.append(f"mkdir -p {shlex.quote(os.path.dirname(destination))} && "
                              f"if [ -d {src} ]; then mkdir -p {dst} && cp -rT {src} {dst}; else cp {src} {dst}; fi")
            if task.workdir:
                script.append(f"cp -r {shlex.quote(task.workdir)}/. {shlex.quote(str(self.homes[i] / 'sky_workdir'))}/")
            self.tb.sh(i, " && ".join(script), cwd=str(render_dir))

    def launch(self, task, backend_log_home: Path):
        """`sky launch`'s execution (CloudVmRayBackend: _setup, _add_job, _execute_task_n_nodes);
        the job id. The driver runs on the head, started by job_lib's scheduler."""
        from sky.backends import backend_utils, cloud_vm_ray_backend

        backend = cloud_vm_ray_backend.CloudVmRayBackend()
        handle = self.handle()
        backend._setup(handle, task, detach_setup=False)  # pylint: disable=protected-access
        resources_str = backend_utils.get_task_resources_str(task)
        job_id, log_dir = backend._add_job(handle, task.name, resources_str, "{}")  # pylint: disable=protected-access
        backend._execute_task_n_nodes(handle, task, job_id, remote_log_dir=log_dir)  # pylint: disable=protected-access
        self.backend, self.log_dir = backend, log_dir
        return job_id

    def status(self, job_id: int):
        statuses = self.backend.get_job_status(self.handle(), job_ids=[job_id], stream_logs=False)
        return statuses.get(job_id) if isinstance(statuses, dict) else statuses

    def wait(self, job_id: int, timeout: float):
        seen = {}

        def done():
            seen["status"] = status = self.status(job_id)
            return status if status is not None and status.is_terminal() else None

        try:
            return tbmod.poll(done, timeout, f"SkyPilot job {job_id} to end", 2)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; its status: {seen.get('status')}\nrun.log tail:\n{self.run_log()[-3000:]}\n"
                                 f"ray status:\n{self.ray_status()}\n{self.diagnosis()}") from None

    def run_log(self) -> str:
        """The driver's run.log on the head (every node's output, prefixed by SkyPilot)."""
        path = Path(self.log_dir.replace("~", str(self.homes[0]), 1)) / "run.log"
        return path.read_text(errors="replace") if path.exists() else ""
