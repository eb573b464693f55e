"""A real Slurm cluster on the namespace testbed, for testing the Slurm provider for real.

Debian's stock ``slurm-wlm`` and ``munge`` (22.05), no mocks: one ``munged``,
one ``slurmctld`` and one ``slurmd`` per testbed host (``node0``..``node<n-1>``,
``NodeName=node[0-2]`` with the hosts' IPs as ``NodeAddr``).  Every daemon
runs inside a host (the controller and munged on host 0, beside its slurmd),
so each slurmd has port 6818 to itself and the controller's hostname matches
``SlurmctldHost``.  munged's socket is a file in the shared cluster dir, which
every host reaches.

Everything the cluster writes (``slurm.conf``, munge key and socket, state,
spool, logs, job completion records, job output) lives under ``dir``; daemons
and clients find the config through ``SLURM_CONF``.  Nothing touches
``/etc/slurm``, ``/etc/munge`` or ``/var``.

Process tracking is ``proctrack/linuxproc`` with ``task/none`` (``proctrack=``
picks another, e.g. ``proctrack/pgid``): no systemd and no per-host cgroup tree here.  Unlike cgroups on a real cluster, a process
that daemonizes away from its step (reparented to the host's init) escapes
``scancel``; a step's ordinary children do not.

No accounting database: ``sacct`` cannot work without slurmdbd (22.05 has no
``accounting_storage/filetxt``; ``sacct`` answers "accounting storage is
disabled").  :meth:`SlurmCluster.job_state` reads ``scontrol show job``
(finished jobs are kept for ``MinJobAge``, one hour here) and falls back to the
``jobcomp/filetxt`` record, which holds every finished job's final state and
exit code.

Timing here (2 cores): boot (daemons start -> every node idle) ~1.1 s; a
trivial batch job ~1 s from sbatch to COMPLETED (slurmctld schedules on its
one-second tick; the first job after boot ~2 s).  One cluster per set of
hosts: a second one finds ports 6817/6818 taken and fails to boot at once.

Usage::

    slurm = make_slurm_fixture(3)          # module-scoped pytest fixture

    def test_x(slurm, tmp_path):
        script = tmp_path / "job.sh"; script.write_text("#!/bin/bash\\nsrun hostname\\n")
        job = slurm.sbatch(script, "--nodes=3", env=slurm.env(TOKEN="..."))
        assert slurm.wait_job(job, 60) == ("COMPLETED", 0)
        print(slurm.output(job))           # <dir>/jobs/slurm-<id>.out

API: ``SlurmCluster(testbed, dir)`` boots and waits until ``sinfo`` shows every
node idle (``boot_seconds``); ``env(**extra)``; ``run(cmd, host=0, ...)`` ->
testbed ``Proc``; ``sh(cmd, host=0)`` -> output; ``sbatch(script, *args)`` ->
job id; ``job_state(id)`` / ``wait_job(id, timeout)`` -> ``(state, exit_code)``;
``job_info(id)`` -> all fields; ``scancel(id)``; ``output(id)``;
``node_states()``; ``slurm_processes()``; ``close()`` (cancels jobs, stops the
daemons by PID, raises if any Slurm process of the cluster is left).
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import time
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

try:
    import testbed as tbmod
except ImportError:  # tests/ imported as a package
    from tests import testbed as tbmod

SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
MUNGED = "/usr/sbin/munged"
APT_PACKAGES = ("slurm-wlm", "munge")
# what must be gone from the hosts once the cluster is closed
SLURM_PROGRAMS = ("slurmctld", "slurmd", "slurmstepd", "munged")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
UNIX_SOCKET_MAX = 107  # sun_path


class JobState(NamedTuple):
    state: str           # COMPLETED, FAILED, CANCELLED, RUNNING, PENDING...
    exit_code: int | None  # the job script's exit code (Slurm's ExitCode=<code>:<signal>)


def slurm_missing() -> str | None:
    """Reason the cluster cannot run here, or None (CI installs slurm-wlm and munge up front)."""
    for path in (SLURMCTLD, SLURMD, MUNGED):
        if not os.path.exists(path):
            return f"{path} missing (apt-get install {' '.join(APT_PACKAGES)})"
    return None


def parse_fields(text: str) -> dict[str, str]:
    """``Key=value Key2=value2`` (scontrol -o, jobcomp/filetxt) -> dict; values hold no spaces
    except in a few fields we do not read."""
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))


class SlurmCluster:
    """munged + slurmctld on ``controller``, slurmd on every host of ``testbed``."""

    def __init__(self, testbed: "tbmod.Testbed", dir: str | os.PathLike | None = None, *,
                 controller: int = 0, real_memory_mb: int = 1024,
                 proctrack: str = "proctrack/linuxproc",
                 features: Mapping[int, str] | None = None,
                 boot_timeout: float = 60):
        reason = slurm_missing()
        if reason:
            raise tbmod.TestbedError(reason)
        self.testbed = testbed
        self.dir = Path(dir if dir is not None else testbed.dir / "slurm").resolve()
        self.controller = testbed.host(controller)
        self.nodes = [h.name for h in testbed.hosts]
        self.conf = self.dir / "slurm.conf"
        self.jobs_dir = self.dir / "jobs"
        self.jobcomp = self.dir / "jobcomp.txt"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        if len(str(self.munge_socket)) > UNIX_SOCKET_MAX:
            raise tbmod.TestbedError(f"munge socket path too long: {self.munge_socket}")
        self.cpus = os.cpu_count() or 1  # every host shares the machine's cores
        self.real_memory_mb = real_memory_mb
        self.proctrack = proctrack  # proctrack/pgid: Slurm signals a task's process group only
        self.features = dict(features or {})  # host index -> its nodes' Features= (for --constraint)
        self.munged: tbmod.Proc | None = None
        self.slurmctld: tbmod.Proc | None = None
        self.slurmd: dict[str, tbmod.Proc] = {}
        self.boot_seconds: float | None = None
        self._closed = False
        try:
            self._write_files()
            self._boot(boot_timeout)
        except BaseException:
            try:
                self.close()
            except tbmod.TestbedError:
                pass  # the boot error is the one to see
            raise

    # ----------------------------------------------------------------- setup

    def _write_files(self) -> None:
        for sub in ("state", "log", "jobs", *(f"spool/{n}" for n in self.nodes)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700, exist_ok=True)
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(128))
            key.chmod(0o600)
        (self.dir / "plugstack.conf").write_text("")  # not /etc/slurm/plugstack.conf
        d = self.dir
        node_lines = [f"NodeName={h.name} NodeAddr={h.ip} CPUs={self.cpus} "
                      f"RealMemory={self.real_memory_mb} State=UNKNOWN"
                      + (f" Features={self.features[i]}" if i in self.features else "")
                      for i, h in enumerate(self.testbed.hosts)]
        self.conf.write_text("\n".join([
            "# written by tests/slurm_testbed.py",
            "ClusterName=testbed",
            f"SlurmctldHost={self.controller.name}({self.controller.ip})",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/spool/%n/slurmd.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            f"PlugStackConfig={d}/plugstack.conf",
            # no systemd, no per-host cgroup tree: track steps by process ancestry
            f"ProctrackType={self.proctrack}", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={self.jobcomp}",
            "MpiDefault=none", "SwitchType=switch/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill", "SchedulerParameters=batch_sched_delay=0",
            "ReturnToService=2", "MinJobAge=3600", "KillWait=2", "InactiveLimit=0",
            "SlurmdTimeout=120", "SlurmctldTimeout=120", "MessageTimeout=20",
            "SlurmctldDebug=info", "SlurmdDebug=info", "MailProg=/bin/true",
            *node_lines,
            "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            ""]))

    def _boot(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        tb = self.testbed
        m = self.dir / "munge"
        self.munged = tb.run(self.controller, [
            MUNGED, "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}", f"--log-file={self.dir / 'log' / 'munged.log'}"],
            env=self.env(), name="munged")
        tbmod.poll(lambda: not self.munged.running() or self.munge_socket.is_socket(),
                   deadline - time.monotonic(), "munged's socket", 0.05)
        self._check_daemons()
        started = time.monotonic()
        self.slurmctld = tb.run(self.controller, [SLURMCTLD, "-D", "-c"], env=self.env(),
                                name="slurmctld")
        for h in tb.hosts:
            self.slurmd[h.name] = tb.run(h, [SLURMD, "-D"], env=self.env(), name="slurmd")

        def all_idle_or_a_daemon_died():
            if not all(p.running() for p in self._daemons()):
                return True
            states = self.node_states()
            return len(states) == len(self.nodes) and all(
                s == "idle" for s in states.values())
        try:
            tbmod.poll(all_idle_or_a_daemon_died, deadline - time.monotonic(),
                       "every node idle in sinfo", 0.1)
            self._check_daemons()
        except (TimeoutError, tbmod.TestbedError) as exc:
            raise tbmod.TestbedError(f"{exc}\n{self.diagnostics()}") from None
        self.boot_seconds = time.monotonic() - started

    def _daemons(self) -> list["tbmod.Proc"]:
        return [p for p in (*self.slurmd.values(), self.slurmctld, self.munged) if p]

    def _check_daemons(self) -> None:
        for p in self._daemons():
            if not p.running():
                raise tbmod.TestbedError(f"{p!r} exited ({p.returncode}):\n{p.output[-3000:]}")

    def diagnostics(self) -> str:
        """Tails of the daemons' logs, for error messages."""
        parts = []
        for log in sorted((self.dir / "log").glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    # ----------------------------------------------------------------- clients

    def env(self, **extra: str) -> dict[str, str]:
        """A client's environment on a host: SLURM_CONF, the venv's bin first on PATH, ``extra``."""
        return self.testbed.env(SLURM_CONF=str(self.conf), **extra)

    def run(self, cmd: str | Sequence[str], host: int | str = 0, *,
            env: Mapping[str, str] | None = None, background: bool = False,
            timeout: float = 60, check: bool = False, cwd: str | os.PathLike | None = None,
            name: str | None = None, log: str | os.PathLike | None = None) -> "tbmod.Proc":
        """Run a client command (sbatch, srun, squeue...) inside a host; waits unless ``background``."""
        return self.testbed.run(host, cmd, env=env if env is not None else self.env(),
                                background=background, timeout=timeout, check=check,
                                cwd=cwd if cwd is not None else self.jobs_dir, name=name,
                                log=log)

    def sh(self, cmd: str | Sequence[str], host: int | str = 0, **kw) -> str:
        """Run a client command to completion (it must succeed) and return its output."""
        return self.run(cmd, host, check=True, **kw).output

    def _probe(self, argv: list[str], what: str) -> "tbmod.Proc":
        """A polled query with one log file per kind, overwritten: no pile of logs."""
        return self.run(argv, self.controller.index, timeout=30,
                        log=self.dir / "log" / f"probe-{what}.out")

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` from sinfo (idle, alloc, mix, down*, unk*...)."""
        p = self._probe(["sinfo", "-h", "-N", "-o", "%N %t"], "sinfo")
        if p.returncode != 0:
            return {}
        return dict(line.split() for line in p.output.splitlines() if len(line.split()) == 2)

    def sbatch(self, script: str | os.PathLike, *args: str, env: Mapping[str, str] | None = None,
               host: int | str = 0, cwd: str | os.PathLike | None = None) -> int:
        """Submit ``script`` with ``sbatch --parsable``; returns the job id.

        The job's working dir (and default ``slurm-%j.out``) is ``cwd``, by default
        ``<dir>/jobs``, which every host sees.  With Slurm's default ``--export=ALL``
        the job's steps get ``env`` (default :meth:`env`).
        """
        p = self.run(["sbatch", "--parsable", *args, str(script)], host, env=env, cwd=cwd,
                     name="sbatch")
        ids = re.findall(r"^(\d+)(?:;\S+)?$", p.output, re.M)
        if p.returncode != 0 or not ids:
            raise tbmod.TestbedError(f"sbatch failed ({p.returncode}):\n{p.output[-3000:]}")
        return int(ids[-1])

    def scancel(self, job_id: int, *args: str) -> None:
        self.sh(["scancel", *args, str(job_id)], name="scancel")

    def job_info(self, job_id: int) -> dict[str, str]:
        """Every field of the job: ``scontrol show job``, else its jobcomp record, else {}."""
        p = self._probe(["scontrol", "-o", "show", "job", str(job_id)], "scontrol-job")
        if p.returncode == 0 and f"JobId={job_id} " in p.output:
            return parse_fields(p.output)
        try:
            lines = self.jobcomp.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            lines = []
        for line in reversed(lines):
            if line.startswith(f"JobId={job_id} "):
                return parse_fields(line)
        return {}

    def job_state(self, job_id: int) -> JobState:
        """``(state, exit_code)``; ``("UNKNOWN", None)`` for a job Slurm does not know."""
        info = self.job_info(job_id)
        if not info:
            return JobState("UNKNOWN", None)
        code = info.get("ExitCode", "")
        return JobState(info.get("JobState", "UNKNOWN"),
                        int(code.split(":")[0]) if code[:1].isdigit() else None)

    def wait_job(self, job_id: int, timeout: float = 60) -> JobState:
        """Poll until the job reaches a final state; raise TimeoutError with its state."""
        last = [JobState("UNKNOWN", None)]

        def done():
            last[0] = self.job_state(job_id)
            return last[0].state in TERMINAL_STATES
        try:
            tbmod.poll(done, timeout, f"job {job_id} to finish", 0.1)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; last state {last[0]}") from None
        return last[0]

    def wait_running(self, job_id: int, timeout: float = 30) -> None:
        def running():
            state = self.job_state(job_id).state
            if state in TERMINAL_STATES:
                raise tbmod.TestbedError(f"job {job_id} ended ({state}) before it ran")
            return state == "RUNNING"
        tbmod.poll(running, timeout, f"job {job_id} to run", 0.1)

    def output(self, job_id: int) -> str:
        """The job's default output file ``<dir>/jobs/slurm-<id>.out``."""
        return (self.jobs_dir / f"slurm-{job_id}.out").read_text(errors="replace")

    # ----------------------------------------------------------------- processes

    def host_processes(self, h: int | str) -> list[tuple[int, str]]:
        """``(pid, command line)`` of every process on a host (root-namespace PIDs)."""
        out = []
        for pid in self.testbed.processes(h):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            out.append((pid, cmd))
        return out

    def slurm_processes(self) -> list[tuple[str, int, str]]:
        """``(host, pid, program)`` of this cluster's Slurm and munge processes.

        Theirs are those started with this cluster's ``SLURM_CONF`` (slurmstepd
        inherits it from slurmd), so another cluster's are never counted or killed.
        """
        mine = f"SLURM_CONF={self.conf}".encode()
        found = []
        for h in self.testbed.hosts:
            if not h.alive:
                continue
            for pid in self.testbed.processes(h.index):
                try:
                    exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
                    prog = exe.removesuffix("-wlm")  # Debian's alternatives: slurmd-wlm
                    if prog not in SLURM_PROGRAMS:
                        continue
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if mine not in f.read().split(b"\0"):
                            continue
                except OSError:
                    continue
                found.append((h.name, pid, prog))
        return found

    # ----------------------------------------------------------------- teardown

    def close(self, timeout: float = 30) -> None:
        """Cancel every job, stop the daemons by PID, kill stray step daemons; idempotent.

        Raises TestbedError if a Slurm process of this cluster is still there.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        if self.slurmctld is not None and self.slurmctld.running():
            try:  # let Slurm end the jobs itself, as on a real cluster
                self.run(["scancel", "--user=root"], timeout=15, name="scancel-all")
                tbmod.poll(lambda: not self.run(["squeue", "-h", "-o", "%i"], timeout=15,
                                                name="squeue").output.strip(),
                           min(15, deadline - time.monotonic()), "the job queue to empty", 0.2)
            except (TimeoutError, tbmod.TestbedError):
                pass  # what is left gets killed below
        daemons = self._daemons()
        for p in daemons:
            p.send_signal(signal.SIGTERM)
        try:
            tbmod.poll(lambda: not any(p.running() for p in daemons),
                       max(1, min(10, deadline - time.monotonic())), "Slurm daemons to stop", 0.05)
        except TimeoutError:
            for p in daemons:
                p.kill()
                p.send_signal(signal.SIGKILL)

        def gone():
            left = self.slurm_processes()
            for _, pid, prog in left:
                if prog == "slurmstepd":  # with its tasks: what scancel would have killed
                    for kid in _descendants(pid):
                        tbmod._kill(kid)
                tbmod._kill(pid)
            return not left
        try:
            tbmod.poll(gone, max(1, deadline - time.monotonic()), "Slurm processes to die", 0.05)
        except TimeoutError:
            raise tbmod.TestbedError(
                f"Slurm processes left after close: {self.slurm_processes()}") from None


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = tbmod._children(todo.pop())
        out += kids
        todo += kids
    return out


# --------------------------------------------------------------------------- pytest


def make_slurm_fixture(n: int = 3, scope: str = "module", **kwargs):
    """A pytest fixture: a booted ``SlurmCluster`` on a fresh ``Testbed(n)``, closed afterwards.

    In a test module: ``slurm = make_slurm_fixture(3)``; the testbed is
    ``slurm.testbed``.  Skips without root or Slurm, except in CI (CI=true),
    where that is an error.
    """
    import pytest

    def _fixture(request, tmp_path_factory):
        reason = tbmod.require_root() or slurm_missing()
        if reason:
            if tbmod.in_ci():
                pytest.fail(f"required in CI: {reason}")
            pytest.skip(reason)
        base = tmp_path_factory.mktemp(f"slurm{n}-")
        tb = tbmod.Testbed(n, base / "testbed", shared=[tmp_path_factory.getbasetemp()])
        request.addfinalizer(tb.close)
        cluster = SlurmCluster(tb, base / "slurm", **kwargs)
        request.addfinalizer(cluster.close)
        return cluster

    _fixture.starts_cluster = True  # every test using it gets the `cluster` mark (tests/conftest.py)
    return pytest.fixture(scope=scope)(_fixture)
