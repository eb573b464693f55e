"""The real dstack server and CLI for the tests, and an SSH fleet of namespace hosts (README.md here).

``ensure_dstack()`` installs ``dstack[server]`` at the version in ``versions.env`` into a cached
virtualenv outside the repository (``~/.cache/rlhf-tasks/dstack/<version>-py<X.Y>/venv``, moved by
``RLHF_TASKS_DSTACK_CACHE``), once per version: the test fixture calls it, so ``make test`` on a fresh
machine does. :class:`DstackBed` starts the server on the loopback of the testbed's ``laptop`` host
(the one host on the hosts' bridge that is not a fleet host, so the server reaches the hosts' sshd as it
reaches any SSH fleet's), with its own home, SQLite database and admin token, and configures the CLI
against it with ``dstack project add``. Nothing leaves the machine: the laptop's network namespace has
no route beyond the testbed's bridge, and the settings that would look outside are pointed at nothing
(see README.md for each).

Each fleet host gets what a fresh on-prem machine has and the shared filesystem of the testbed does not
give it: its own ``/root`` (``.bashrc``/``.profile`` of a fresh Debian root, ``~/.ssh`` empty), ``/opt``,
``/checkpoints``, ``/etc/systemd/system`` and ``/usr/local/bin`` (the real one's programs linked, plus
the ``sudo`` and ``systemctl`` stand-ins: there is no sudo here and systemd cannot run in a namespace
host), and a real sshd (Debian's openssh-server) on port 22 reading ``~/.ssh/authorized_keys`` as a
default sshd does. The server provisions them itself through its SSH fleet code; the shim it downloads
(``DSTACK_SHIM_DOWNLOAD_URL``) is ``agent.py`` here, served from the laptop.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import testbed as tbmod  # noqa: E402


def versions() -> dict[str, str]:
    out = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


DSTACK_VERSION = versions()["DSTACK_VERSION"]
SERVER_PORT = 3000
DOWNLOAD_PORT = 3001
PROJECT = "main"
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
#: Each fleet host's disk as its shim reports it (free space under /var/lib/docker, a tmpfs of this size).
DOCKER_DISK = "200g"
#: The CPUs each fleet host's shim reports in `host_info.json` (by the host's index; the host's own count beyond
#: them), which the server's offers for the SSH fleet's instances are made of: hosts that differ, so that a task's
#: node groups (`resources.cpus` 4 and exactly 2) land each on its host by dstack's own offer matching. The played
#: shim limits no job's CPUs, as it plays no container.
PLAYED_CPUS = (2, 4)


def cache_dir() -> Path:
    base = Path(os.environ.get("RLHF_TASKS_DSTACK_CACHE") or Path.home() / ".cache" / "rlhf-tasks" / "dstack")
    return base / f"{DSTACK_VERSION}-py{PY}"


def ensure_dstack(log=print) -> Path:
    """The cached virtualenv's bin directory with ``dstack`` at DSTACK_VERSION, installed once (a lock
    keeps two test workers from installing it at once)."""
    root = cache_dir()
    venv = root / "venv"
    done = root / "installed"
    if done.exists():
        return venv / "bin"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return venv / "bin"
        started = time.monotonic()
        log(f"dstack: installing dstack[server]=={DSTACK_VERSION} into {venv} (about a minute, once)")
        shutil.rmtree(venv, ignore_errors=True)
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               f"dstack[server]=={DSTACK_VERSION}"], capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install dstack[server]=={DSTACK_VERSION} failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        done.write_text(f"{time.monotonic() - started:.0f} s\n")
        return venv / "bin"


# ----------------------------------------------------------------------------- stand-ins on the hosts

SUDO = """#!/bin/sh
# sudo stand-in (tests/dstack): every command here runs as root already; drop sudo's own options.
while [ $# -gt 0 ]; do case "$1" in -E|-n|-H|-S|--preserve-env*) shift;; --) shift; break;; *) break;; esac; done
exec "$@"
"""

# systemctl stand-in: what dstack's SSH fleet setup runs (daemon-reload, enable, restart, status) for
# the units it writes, read as systemd reads them (EnvironmentFile, WorkingDirectory, ExecStart).
SYSTEMCTL = r'''#!{python} -I
import os, signal, subprocess, sys, time
args = [a for a in sys.argv[1:] if not a.startswith("-")]
if not args or args[0] in ("daemon-reload", "enable", "disable", "is-system-running"):
    sys.exit(0)
verb, names = args[0], [n if n.endswith(".service") else n + ".service" for n in args[1:]]
run = "/root/.systemctl"
os.makedirs(run, exist_ok=True)
def unit(name):
    conf = {}
    for line in open(f"/etc/systemd/system/{name}"):
        if "=" in line and not line.startswith("#"):
            k, _, v = line.strip().partition("=")
            conf[k] = v
    return conf
def pid_of(name):
    try:
        pid = int(open(f"{run}/{name}.pid").read())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None
def stop(name):
    pid = pid_of(name)
    if pid:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(100):
            if pid_of(name) is None:
                break
            time.sleep(0.1)
        else:
            os.killpg(pid, signal.SIGKILL)
def start(name):
    conf = unit(name)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           "HOME": "/root", "USER": "root"}
    ef = conf.get("EnvironmentFile")
    if ef:
        for line in open(ef.lstrip("-")):
            k, _, v = line.strip().partition("=")
            if k:
                env[k] = v.strip('"')
    log = open(f"{run}/{name}.log", "ab")
    p = subprocess.Popen(conf["ExecStart"].split(), cwd=conf.get("WorkingDirectory", "/"), env=env,
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    open(f"{run}/{name}.pid", "w").write(str(p.pid))
for name in names:
    if verb in ("stop", "restart"):
        stop(name)
    if verb in ("start", "restart"):
        start(name)
    if verb == "status":
        state = "active (running)" if pid_of(name) else "inactive (dead)"
        print(f"* {name}\n     Active: {state}")
    if verb == "is-active":
        sys.exit(0 if pid_of(name) else 3)
'''

# uv stand-in: dstack's default image (dstackai/base) has uv, and with no `image:` the server prefixes the
# job's commands with `uv venv -q --prompt dstack -p 3.11 --seed $DSTACK_VENV_DIR` and sources its
# activate (dstack/_internal/server/services/jobs/configurators/base.py, _dstack_image_commands). The image
# played here is the host with the test virtualenv: the venv made is that virtualenv (its bin first on PATH).
UV = """#!/bin/sh
# uv stand-in (tests/dstack): `uv python find` finds no preinstalled build; `uv venv ... DIR` makes DIR a
# venv whose activate puts the test virtualenv first on PATH (the played image's Python, with Ray and torch).
case "$1" in
  python) exit 1;;
  venv) for last; do :; done; mkdir -p "$last/bin"
        printf 'export VIRTUAL_ENV=%s\\nexport PATH={venv_bin}:$PATH\\n' "$last" > "$last/bin/activate";;
  *) echo "uv stand-in: $* not played" >&2; exit 2;;
esac
"""

SSHD_CONFIG = """Port 22
HostKey {key}
AuthorizedKeysFile .ssh/authorized_keys {extra}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AllowTcpForwarding yes
PidFile none
UseDNS no
Subsystem sftp internal-sftp
LogLevel VERBOSE
"""


def host_mounts(base: Path) -> list[tuple[str | None, str]]:
    """A fleet host's mounts (tests/testbed.py mount_source): its own /root (a fresh Debian root's,
    with this machine's pyenv and caches bound in, and whatever else every host must see under /root:
    a checkout cloned there), /usr/local/bin, systemd units, /opt, a container's own directories, and
    the disk its shim reports: the free space under Docker's root dir (a tmpfs of DOCKER_DISK here,
    nothing allocated until written), as a rented machine's data disk."""
    root, home = base / "root", Path("/root")
    before = [(str(home / d), str(root / d)) for d in (".pyenv", ".cache") if (home / d).exists()]
    plan = tbmod.fresh_over(root, "/root", before)
    for src, dst in (("usr-local-bin", "/usr/local/bin"), ("systemd", "/etc/systemd/system"), ("opt", "/opt"),
                     ("checkpoints", "/checkpoints"), ("dstack", "/dstack")):
        plan += tbmod.fresh_over(base / src, dst)
    return [*plan, (None, "/var/lib/docker")]


class DstackBed:
    """A testbed of ``n`` fleet hosts and the laptop; on the laptop the dstack server and CLI."""

    def __init__(self, n: int, dir: Path, shared=()):
        self.bin = ensure_dstack()
        self.dir = Path(dir).resolve()
        # the cached virtualenv is on every host, as the test's own is (sys.prefix), wherever HOME is (/tmp too)
        self.tb = tbmod.Testbed(n, self.dir / "testbed", shared=[*shared, self.dir, self.bin.parent])
        try:
            self.home = self.dir / "home"  # the laptop user's home: the CLI's ~/.dstack
            self.server_dir = self.dir / "server"
            self.token = secrets.token_hex(16)
            self.url = f"http://127.0.0.1:{SERVER_PORT}"
            self.downloads = self.dir / "downloads"
            self._serve_downloads()
            self._start_server()
            self.cli("project", "add", "--name", PROJECT, "--url", self.url, "--token", self.token, "-y")
            self.key = self.tb._ssh_keys()
            for h in self.tb.hosts:
                self._prepare_host(h)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the server and the CLI

    def env(self, **extra) -> dict[str, str]:
        """The laptop user's environment: the dstack venv's CLI on PATH, HOME with the CLI config."""
        return self.tb.env(PATH=f"{self.bin}:{tbmod.BIN_DIR}:/usr/local/bin:/usr/bin:/bin", HOME=str(self.home),
                           **extra)

    def _no_update_check(self) -> None:
        # The CLI checks get.dstack.ai for a newer version once a day (dstack/_internal/cli/utils/updates.py),
        # unless ~/.cache/.dstack/cli/last_check was touched today; it has no setting to turn it off.
        path = self.home / ".cache" / ".dstack" / "cli" / "last_check"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def _start_server(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self._no_update_check()
        self.server_dir.mkdir(parents=True, exist_ok=True)
        url = f"http://{tbmod.LAPTOP_IP}:{DOWNLOAD_PORT}"
        env = self.env(
            DSTACK_SERVER_DIR=str(self.server_dir),  # its SQLite database (server/data/sqlite.db), keys, logs
            DSTACK_DEFAULT_CREDS_DISABLED="1",  # no backend made from this machine's cloud credentials
            GPUHUNT_CATALOG_URL="http://127.0.0.1:1",  # the offers catalog: nothing listens there
            DSTACK_SERVER_CONFIG_DISABLED="1",  # no server/config.yml written or read
            DSTACK_SHIM_DOWNLOAD_URL=url + "/{version}/dstack-shim-linux-{arch}",
            DSTACK_RUNNER_DOWNLOAD_URL=url + "/{version}/dstack-runner-linux-{arch}",
            DSTACK_SERVER_LOG_LEVEL="DEBUG", DSTACK_SERVER_LOG_FORMAT="standard",
            DSTACK_SERVER_RELOAD_DISABLED="1",
        )
        self.server = self.tb.run("laptop", [str(self.bin / "dstack"), "server", "--host", "127.0.0.1",
                                             "--port", str(SERVER_PORT), "--token", self.token, "-n"],
                                  env=env, name="dstack-server", cwd=self.dir)

        def up():
            return not self.server.running() or self.tb.http(
                "laptop", f"{self.url}/api/server/get_info", method="POST", data={},
                headers={"Authorization": f"Bearer {self.token}"}).ok
        tbmod.poll(up, 120, "the dstack server to answer", 0.5)
        if not self.server.running():
            raise RuntimeError(f"dstack server exited ({self.server.returncode}):\n{self.server.output[-4000:]}")

    def cli(self, *args: str, check: bool = True, timeout: float = 120, cwd=None, env=None) -> tbmod.Proc:
        """Run the real `dstack` CLI on the laptop (to completion)."""
        self._no_update_check()
        proc = self.tb.run("laptop", [str(self.bin / "dstack"), *args], env=env or self.env(), background=False,
                           timeout=timeout, cwd=cwd or self.dir, name="dstack-" + (args[0] if args else ""))
        if check and proc.returncode != 0:
            raise RuntimeError(f"dstack {' '.join(args)} exited {proc.returncode}:\n{proc.output[-4000:]}")
        return proc

    def api(self, path: str, body: dict | None = None) -> dict | list:
        """A call to the server's HTTP API as the admin (POST, JSON), from the laptop."""
        r = self.tb.http("laptop", f"{self.url}{path}", method="POST", data=body or {},
                         headers={"Authorization": f"Bearer {self.token}"}, timeout=30)
        if not r.ok:
            raise RuntimeError(f"POST {path}: {r.status} {r.error or ''} {r.body[-2000:]}")
        return r.json()

    # ------------------------------------------------------------------ what the hosts download

    def _serve_downloads(self) -> None:
        d = self.downloads / DSTACK_VERSION
        d.mkdir(parents=True, exist_ok=True)
        program = (HERE / "agent.py").read_text()
        body = f"#!{sys.executable} -I\n" + program.replace("@DSTACK_VERSION@", DSTACK_VERSION).replace(
            "@IMAGE_PATH@", f"{tbmod.BIN_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").replace(
            "@PLAYED_CPUS@", json.dumps({h.name: cpus for h, cpus in zip(self.tb.hosts, PLAYED_CPUS)}))
        for name in ("dstack-shim-linux-amd64", "dstack-runner-linux-amd64", "dstack-shim-linux-arm64",
                     "dstack-runner-linux-arm64"):
            (d / name).write_text(body)
        self.fileserver = self.tb.run("laptop", [sys.executable, "-m", "http.server", "--bind", tbmod.LAPTOP_IP,
                                                 "--directory", str(self.downloads), str(DOWNLOAD_PORT)],
                                      name="downloads")
        self.tb.wait_port("laptop", DOWNLOAD_PORT, tbmod.LAPTOP_IP)

    # ------------------------------------------------------------------ fleet hosts

    def _prepare_host(self, h) -> None:
        base = self.dir / "fleet" / h.name
        root, ulb = base / "root", base / "usr-local-bin"
        for d in (root / ".pyenv", root / ".cache", root / ".ssh", ulb, base / "systemd", base / "opt",
                  base / "checkpoints", base / "dstack"):
            d.mkdir(parents=True, exist_ok=True)
        for name in (".bashrc", ".profile"):  # a fresh Debian root's
            src = Path("/etc/skel") / name
            if src.exists():
                shutil.copy(src, root / name)
        for entry in Path("/usr/local/bin").iterdir():
            if not (ulb / entry.name).exists():
                (ulb / entry.name).symlink_to(entry)
        (ulb / "sudo").write_text(SUDO)
        (ulb / "systemctl").write_text(SYSTEMCTL.replace("{python}", sys.executable))
        (ulb / "uv").write_text(UV.replace("{venv_bin}", tbmod.BIN_DIR))
        for name in ("sudo", "systemctl", "uv"):
            os.chmod(ulb / name, 0o755)
        keys = self.dir / "ssh"
        keys.mkdir(exist_ok=True)
        hostkey = keys / f"{h.name}-host"
        if not hostkey.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)], check=True)
        (keys / "authorized_keys").write_text(Path(str(self.key) + ".pub").read_text())
        (base / "sshd_config").write_text(SSHD_CONFIG.format(key=hostkey, extra=keys / "authorized_keys"))
        for mountpoint in ("/checkpoints", "/dstack", "/var/lib/docker"):  # a container's own directories: empty mount points here
            os.makedirs(mountpoint, exist_ok=True)
        self.tb.mount(h, host_mounts(base), f"dstack fleet host {h.name}'s mounts (tests/dstack/server.py host_mounts)",
                      tmpfs_options={"/var/lib/docker": f"size={DOCKER_DISK}"})
        os.makedirs("/run/sshd", exist_ok=True)
        sshd = self.tb.run(h, [tbmod.SSHD, "-D", "-e", "-f", str(base / "sshd_config")], name="sshd", cwd="/")
        try:
            self.tb.wait_port(h, 22, h.ip, 30)
        except TimeoutError as exc:
            raise RuntimeError(f"sshd on {h.name}: {exc}\n{sshd.output}") from None

    def cpus(self) -> dict[str, int]:
        """Each fleet host's address -> the CPUs its shim reports (PLAYED_CPUS; the host's own beyond them)."""
        own = os.cpu_count() or 1
        return {h.ip: PLAYED_CPUS[i] if i < len(PLAYED_CPUS) else own for i, h in enumerate(self.tb.hosts)}

    def fleet_hosts(self, n: int | None = None) -> list[str]:
        return [h.ip for h in self.tb.hosts[:n]]

    def ssh_config(self, n: int | None = None) -> dict:
        """The `ssh_config` of a fleet of these hosts, as an on-prem user writes it."""
        return {"user": "root", "identity_file": str(self.key), "hosts": self.fleet_hosts(n)}

    def close(self) -> None:
        self.tb.close()


def wait_for(fn, timeout: float, what: str, interval: float = 1.0):
    return tbmod.poll(fn, timeout, what, interval)


def dump(data) -> str:
    return json.dumps(data, indent=1, default=str)
