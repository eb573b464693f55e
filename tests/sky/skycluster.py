"""SkyPilot's cloud path on namespace hosts, driven by SkyPilot's own code (see README.md here).

A cloud VM as SkyPilot's provisioner leaves it: SkyPilot's runtime virtualenv (its pinned Ray,
SKY_REMOTE_RAY_VERSION, and this SkyPilot) at ~/skypilot-runtime with ~/.sky/python_path and
~/.sky/ray_path naming it, ~/sky_workdir made, and SkyPilot's Ray started by the command
SkyPilot's provisioner builds (instance_setup.ray_head_start_command / ray_worker_start_command),
run by SkyPilot's own CommandRunner command line (which exports OMP_NUM_THREADS=1 first). Then
`sky launch`'s execution as its backend does it: CloudVmRayBackend._setup (setup on every node
through its runners), _add_job and _execute_task_n_nodes (RayCodeGen's driver, queued through
job_lib on the head and started by its scheduler), the job's status through get_job_status.

What is played: the transport (nsenter into a host instead of ssh: HostRunner below, whose
command line is SkyPilot's), the handle (the few fields the backend reads), the file_mounts /
workdir upload (copied onto each host), and the VM image (the hosts' python is this checkout's
virtualenv, with Ray 2.60 and torch, on PATH through ~/.bashrc as a VM image's conda would be).
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
        out = subprocess.run([str(building / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                              f"ray[default]=={ray_version}", "pydantic-core==2.41.1", "click<8.3.0",
                              f"skypilot[remote]=={sky_version}"], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"installing SkyPilot's runtime (ray {ray_version}, skypilot {sky_version}) failed:\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        (building / ".complete").write_text(f"built in {time.monotonic() - started:.0f} s\n")
        building.rename(target)
    return target


class HostRunner:
    """A SkyPilot CommandRunner whose transport is nsenter into a testbed host instead of ssh:
    the command line it runs is the one SkyPilot's runner builds (_get_command_to_run)."""

    def __new__(cls, tb, rank: int, env: dict[str, str]):
        from sky.skylet import log_lib
        from sky.utils import command_runner

        class _Runner(command_runner.CommandRunner):
            def run(self, cmd, *, require_outputs=False, log_path=os.devnull, process_stream=True,
                    stream_logs=True, separate_stderr=False, source_bashrc=False, skip_num_lines=0,
                    run_in_background=False, **kwargs):
                for unused in ("port_forward", "ssh_mode", "connect_timeout"):
                    kwargs.pop(unused, None)
                remote = self._get_command_to_run(cmd, process_stream, separate_stderr,
                                                   skip_num_lines=skip_num_lines, source_bashrc=source_bashrc,
                                                   run_in_background=run_in_background)
                host = tb.host(rank)
                # The transport (ssh's argv) replaced by nsenter; the command line after it is SkyPilot's.
                # (A variant quoting it whole as SSHCommandRunner does, with the log tee'd here, left
                # SkyPilot's worker raylet out of the cluster twice: RayCodeGen waited for 2 nodes.)
                prefix = [tbmod.NSENTER, f"--target={host.init_pid}", "--pid", "--uts", "--ipc", "--mount",
                          "--net", f"--wd={env['HOME']}", "--"]
                line = " ".join(map(shlex.quote, prefix)) + " " + remote
                os.makedirs(os.path.dirname(os.path.expanduser(log_path)) or ".", exist_ok=True)
                return log_lib.run_with_log(line, log_path, require_outputs=require_outputs, stream_logs=stream_logs,
                                            process_stream=process_stream, shell=True, executable="/bin/bash",
                                            env=env, **kwargs)

            def rsync(self, source, target, *, up, log_path=os.devnull, stream_logs=True, max_retry=1,
                      timeout=None):
                if not up:
                    raise NotImplementedError("download")
                home = env["HOME"]
                target = target.replace("~", home, 1) if target.startswith("~") else target
                tb.sh(rank, f"mkdir -p {shlex.quote(os.path.dirname(target))} && "
                            f"cp -r {shlex.quote(source)} {shlex.quote(target)}")

        runner = _Runner((tb.host(rank).name, rank))
        runner.rank = rank
        return runner


class SkyCluster:
    """`nodes` testbed hosts made into a SkyPilot cloud cluster, SkyPilot's Ray running on them."""

    def __init__(self, tb, tmp_path: Path, nodes: int, name: str = "sky-test"):
        from sky.skylet import constants

        self.tb, self.name, self.nodes = tb, name, nodes
        self.runtime = runtime()
        self.homes = [tmp_path / f"home-{tb.hosts[i].name}" for i in range(nodes)]
        self.envs = []
        for i, home in enumerate(self.homes):
            (home / ".sky").mkdir(parents=True)
            os.symlink(self.runtime, home / constants.SKY_REMOTE_PYTHON_ENV_NAME)
            env_dir = home / constants.SKY_REMOTE_PYTHON_ENV_NAME
            (home / ".sky" / "python_path").write_text(f"{env_dir}/bin/python\n")
            (home / ".sky" / "ray_path").write_text(f"{env_dir}/bin/ray\n")
            # The VM image's own python (ray 2.60, torch: what the task's setup checks for) first on
            # PATH for the user, as an image's conda or venv activation in ~/.bashrc puts it.
            (home / ".bashrc").write_text(f"export PATH={tbmod.BIN_DIR}:$PATH\n")
            self.envs.append({"HOME": str(home), "USER": "root", "LANG": "C.UTF-8",
                              "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
            # A VM's default route (Ray finds its node address through it); the bridge has no way out.
            subprocess.run(["ip", "-n", tb.hosts[i].netns, "route", "replace", "default", "dev", "eth0"], check=True)
        self.runners = [HostRunner(tb, i, self.envs[i]) for i in range(nodes)]
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
            script = ["mountpoint -q /opt || mount -t tmpfs tmpfs /opt"]
            for destination, source in (task.file_mounts or {}).items():
                script.append(f"mkdir -p {shlex.quote(os.path.dirname(destination))} && "
                              f"cp -r {shlex.quote(source)} {shlex.quote(destination)}")
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
        from sky.skylet import job_lib

        def done():
            status = self.status(job_id)
            return status if status is not None and status.is_terminal() else None

        return tbmod.poll(done, timeout, f"SkyPilot job {job_id} to end")

    def run_log(self) -> str:
        """The driver's run.log on the head (every node's output, prefixed by SkyPilot)."""
        path = Path(self.log_dir.replace("~", str(self.homes[0]), 1)) / "run.log"
        return path.read_text(errors="replace") if path.exists() else ""
