"""N real "hosts" on one machine, for tests that must see what a rented cluster looks like.

Each host is a network namespace (own IP on a private bridge, own ``lo``) plus a
long-lived init process in its own PID, UTS, IPC and mount namespace: own
hostname, own process table (``ray stop`` on one host touches only that host),
own ``/tmp`` and ``/dev/shm`` (tmpfs).  Everything else on the filesystem is
shared, like an NFS mount on a real cluster; paths under ``/tmp`` named in
``shared`` (the testbed dir and the test's ``tmp_path``) are bind-mounted back
so hosts see them too.  Names resolve through one hosts file bind-mounted over
``/etc/hosts`` on every host.

Hosts are entered with ``nsenter --net`` (not ``ip netns exec``, which remounts
/sys and hides /sys/fs/cgroup that Ray's raylet reads).

Teardown kills the PIDs of this testbed's namespaces only (``ip netns pids``),
never anything by name.  Namespace names carry a per-testbed prefix
``rt-<pid>-<n>`` so stale ones of a dead test run can be found and removed.

Needs root.  Use from pytest with :func:`make_testbed_fixture`.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

PREFIX = "rt-"
SUBNET = "10.77.0"  # private range, only ever inside namespaces we create
LAPTOP_IP = f"{SUBNET}.2"
# what the testbed and its tests use beyond a base Debian: CI installs it up front
APT_PACKAGES = ("openssh-server", "openssh-client", "iproute2", "procps")
APT_INSTALL_CMD = (
    "apt-get update && DEBIAN_FRONTEND=noninteractive "
    "apt-get install -y --no-install-recommends " + " ".join(APT_PACKAGES)
)
SSHD = "/usr/sbin/sshd"
# absolute: a host command's exact env may have no PATH that finds them
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
PYTHON = sys.executable
BIN_DIR = os.path.dirname(PYTHON)

_counter = 0
#: Called with what is about to start, before a Testbed makes its first namespace: under
#: pytest, tests/conftest.py's check that the running test has the `cluster` mark.
before_start: Callable[[str], None] = lambda what: None


class TestbedError(RuntimeError):
    """The testbed itself failed (not the code under test)."""


# --------------------------------------------------------------------------- helpers


def poll(fn: Callable[[], object], timeout: float, what: str = "condition",
         interval: float = 0.2):
    """Call ``fn`` until it returns something truthy; raise TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            result = fn()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - keep polling, report the last one
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                               + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise TestbedError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _sh("ip", *args, check=check)


def _netns_pids(ns: str) -> list[int]:
    proc = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _netns_names() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # field 4 (ppid) comes after the ")" closing the command name
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def _pidns_members(init_pid: int) -> list[int]:
    """Root-namespace PIDs of all processes in init_pid's PID namespace."""
    try:
        ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return []
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    members.append(int(entry))
            except OSError:
                pass
    return members


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this process when the test process dies, so hosts never outlive it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def cleanup_stale() -> list[str]:
    """Remove namespaces left by testbeds whose test process is gone (crash, SIGKILL)."""
    removed = []
    for ns in _netns_names():
        m = re.match(rf"^{re.escape(PREFIX)}(\d+)-\d+-", ns)
        if not m or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        for pid in _netns_pids(ns):
            _kill(pid)
        try:
            poll(lambda: not _netns_pids(ns), 10, f"processes of stale netns {ns}", 0.05)
        except TimeoutError:
            continue
        _ip("netns", "del", ns, check=False)
        removed.append(ns)
    return removed


def in_ci() -> bool:
    """Whether this runs in CI (CI=true, in any case: some set True, and hosts get it lowercased),
    where a missing requirement fails a test instead of skipping it."""
    return os.environ.get("CI", "").strip().lower() == "true"


def require_root() -> str | None:
    """Reason to skip, or None.  In CI (CI=true) missing root is an error, never a skip."""
    if os.geteuid() == 0:
        for tool in ("ip", "unshare", "nsenter"):
            if not shutil.which(tool):
                raise TestbedError(f"testbed needs `{tool}` (util-linux / iproute2)")
        return None
    reason = "testbed needs root (network/PID/mount namespaces)"
    if in_ci():
        raise TestbedError(f"{reason}; CI must run these tests as root")
    return reason


REPO = Path(__file__).resolve().parent.parent
#: The tests' caches (their defaults and the variables that move them), which hosts read.
CACHE_VARS = {"RLHF_TASKS_CACHE": ".cache/rlhf-tasks", "RLHF_TASKS_KUBE_CACHE": ".cache/rlhf-tasks/kube",
              "RLHF_TASKS_DSTACK_CACHE": ".cache/rlhf-tasks/dstack",
              "RLHF_TASKS_TEST_CACHE": ".cache/rlhf-tasks-tests"}


def must_see() -> list[str]:
    """What every host must keep seeing of this machine: the checkout (its .venv with it), this
    interpreter's prefix and base prefix, the tests' caches, each as given and resolved, outermost
    only.  A user clones wherever they like (root's home on a fresh GPU machine, /var/tmp, /opt): a
    host that mounts over any of these fails its first command with nsenter's "No such file"."""
    paths = {Path(__file__).absolute().parent.parent, REPO, Path(sys.prefix), Path(sys.base_prefix),
             Path(sys.executable).parent}
    for var, default in CACHE_VARS.items():
        paths.add(Path(os.environ.get(var) or Path.home() / default))
    both = {os.path.normpath(str(p)) for p in paths} | {str(p.resolve()) for p in paths}
    return sorted(p for p in both if os.path.exists(p) and not any(_under(p, q) and p != q for q in both))


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def mount_source(path: str, plan: Sequence[tuple[str | None, str]]) -> str | None:
    """Where ``path`` reads from once the mounts of ``plan`` are made in order: each ``(source,
    target)`` a recursive bind (``mount --rbind``), or ``(None, target)`` a fresh filesystem
    (tmpfs); None when a fresh filesystem hides it."""
    path = os.path.normpath(path)
    for i in range(len(plan) - 1, -1, -1):
        source, target = plan[i]
        target = os.path.normpath(target)
        if _under(path, target):
            if source is None:
                return None
            rest = os.path.relpath(path, target)
            return mount_source(os.path.normpath(os.path.join(str(source), rest)), plan[:i])
    return path


def hidden(plan: Sequence[tuple[str | None, str]], keep: Sequence[str] | None = None) -> list[str]:
    """The paths of ``keep`` (default :func:`must_see`) that ``plan`` hides or replaces."""
    return [p for p in (must_see() if keep is None else keep) if mount_source(p, plan) != p]


def fresh_over(fresh: str | os.PathLike, over: str, before: Sequence[tuple[str | None, str]] = (),
               keep: Sequence[str] | None = None) -> list[tuple[str | None, str]]:
    """The plan that binds the directory ``fresh`` over ``over`` (a host's own /root, say) and keeps
    what must be seen under it: ``before`` (binds into ``fresh``), then each such path not yet in
    its place inside ``fresh`` bound there (a mount point made for it), then ``fresh`` over ``over``."""
    plan = list(before)
    for p in (must_see() if keep is None else keep):
        if _under(p, over):
            if p == os.path.normpath(over):
                raise TestbedError(f"{p} must stay visible to the hosts, but a test mounts a directory of its own "
                                   f"over it: clone the checkout into a directory below {over}")
            inside = os.path.join(str(fresh), os.path.relpath(p, over))
            if mount_source(inside, plan) != p:
                plan.append((p, inside))
    return [*plan, (str(fresh), over)]


def tmpfs_script(target: str, keep: Sequence[str] | None = None) -> list[str]:
    """Shell lines that mount a fresh tmpfs over ``target`` in the caller's mount namespace (a host's,
    made private) and keep what must be seen under it (default :func:`must_see`): each bound aside
    first, then moved back into its place on the tmpfs."""
    inside = [p for p in (must_see() if keep is None else keep) if _under(p, target)]
    if os.path.normpath(target) in inside:
        raise TestbedError(f"{target} must stay visible to the hosts, but a test mounts a tmpfs over it")
    t = shlex.quote(target)
    lines = [f"mkdir -p /tmp/.rlhf-tasks-keep-{i} && mount --bind {shlex.quote(p)} /tmp/.rlhf-tasks-keep-{i}"
             for i, p in enumerate(inside)]
    lines.append(f"mount -t tmpfs tmpfs {t}")
    lines += [f"mkdir -p {shlex.quote(p)} && mount --move /tmp/.rlhf-tasks-keep-{i} {shlex.quote(p)}"
              for i, p in enumerate(inside)]
    return lines


def check_plan(plan: Sequence[tuple[str | None, str]], what: str) -> None:
    """Refuse, loudly and before any mount, a host's mounts that would hide what every host must see."""
    lost = hidden(plan)
    if lost:
        raise TestbedError(
            f"{what} would hide {', '.join(lost)} from its hosts (the checkout, its virtualenv, this "
            f"Python's prefixes or the tests' caches: tests/testbed.py must_see): every command on such "
            f"a host would fail with nsenter's 'No such file or directory'. A test that hides a directory "
            f"must never hide the checkout: bind these back (tests/testbed.py fresh_over) or mount lower. "
            f"Mounts: {list(plan)}")


def ensure_sshd() -> None:
    """Install Debian's openssh-server if sshd is missing (CI installs it up front)."""
    if os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen"):
        return
    proc = subprocess.run(["bash", "-c", APT_INSTALL_CMD], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 or not os.path.exists(SSHD):
        raise TestbedError(
            f"sshd missing and `{APT_INSTALL_CMD}` failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


# --------------------------------------------------------------------------- hosts


# PID 1 of a host: set hostname, private mounts, then reap orphans forever
# (a plain `sleep infinity` would leave zombies of everything ray forks).
_INIT = r"""
import ctypes, os, signal, socket, sys
name, hosts, *shared = sys.argv[1:]
libc = ctypes.CDLL(None, use_errno=True)
def mount(src, dst, fstype=None, flags=0, data=None):
    if libc.mount(src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {src} {dst}")
MS_BIND, MS_REC, MNT_DETACH = 4096, 16384, 2
socket.sethostname(name)
mount(hosts, "/etc/hosts", flags=MS_BIND)
fds = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d in shared]
mount("tmpfs", "/tmp", "tmpfs", 0, "mode=1777")
mount("tmpfs", "/dev/shm", "tmpfs", 0, "mode=1777")
libc.umount2(b"/run/netns", MNT_DETACH)  # drop references to other testbeds' namespaces
for d, fd in zip(shared, fds):
    os.makedirs(d, exist_ok=True)
    # the fd still points at the real directory, now hidden under the tmpfs
    mount(f"/proc/self/fd/{fd}", d, flags=MS_BIND | MS_REC)
    os.close(fd)
os.chdir("/")
print("ready", flush=True)
os.close(1)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
while True:  # reap orphans, as an init must
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    signal.sigtimedwait([signal.SIGCHLD], 5)
"""


@dataclass
class Host:
    """One machine of the testbed."""
    index: int          # -1 for the laptop
    name: str           # hostname, resolvable on every host
    ip: str
    netns: str
    init_pid: int = 0   # root-namespace PID of the host's PID-namespace init
    _init_proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self._init_proc is not None and self._init_proc.poll() is None


class Proc:
    """A command running on a host: ``wait``/``returncode``/``kill`` and its log file."""

    def __init__(self, host: Host, argv: list[str], popen: subprocess.Popen, log: Path):
        self.host, self.argv, self.popen, self.log = host, argv, popen, log
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        """Root-namespace PID of the command (nsenter's child), None once it is gone."""
        if self._pid is None and self.popen.poll() is None:
            kids = _children(self.popen.pid)
            self._pid = kids[0] if kids else None
        return self._pid if self.popen.poll() is None else None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def running(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """Exit code; raises subprocess.TimeoutExpired (with the log's tail) at the deadline."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            exc.output = self.output[-4000:]
            raise

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the command itself (like systemd's main PID), not its children."""
        pid = self.pid
        if pid is None and self.popen.poll() is None:
            poll(lambda: self.pid or self.popen.poll() is not None, 5, "command pid", 0.02)
            pid = self.pid
        if pid is not None:
            _kill(pid, sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the command's whole process group (it runs in a session of its own).

        nsenter itself is spared: it reaps its child and exits with the child's status.
        """
        if self.popen.poll() is None:
            for pid in _group_members(self.popen.pid):
                if pid != self.popen.pid:
                    _kill(pid, sig)

    @property
    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __repr__(self) -> str:
        return f"<Proc {self.host.name} {shlex.join(self.argv)[:60]!r} rc={self.returncode}>"


@dataclass
class HttpResponse:
    status: int | None  # None: no HTTP answer at all (refused, timeout...)
    body: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def json(self):
        return json.loads(self.body)


_HTTP = r"""
import json, sys, urllib.request, urllib.error
spec = json.loads(sys.argv[1])
data = spec["data"].encode() if spec["data"] is not None else None
req = urllib.request.Request(spec["url"], data=data, method=spec["method"],
                             headers=spec["headers"])
try:
    with urllib.request.urlopen(req, timeout=spec["timeout"]) as r:
        out = {"status": r.status, "body": r.read().decode("utf-8", "replace"), "error": ""}
except urllib.error.HTTPError as e:
    out = {"status": e.code, "body": e.read().decode("utf-8", "replace"), "error": str(e)}
except Exception as e:
    out = {"status": None, "body": "", "error": repr(e)}
print(json.dumps(out))
"""

_WAIT_PORT = r"""
import socket, sys, time
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
while True:
    try:
        socket.create_connection((addr, port), timeout=1).close()
        sys.exit(0)
    except OSError as e:
        if time.monotonic() >= deadline:
            print(f"{addr}:{port} not accepting after {timeout}s: {e}")
            sys.exit(1)
        time.sleep(0.05)
"""


class Testbed:
    """N hosts (``hosts[i]``, named ``node<i>``) on a private bridge, plus a ``laptop`` host.

    The laptop is on the same bridge (it can reach hosts' public ports) but is
    not part of the cluster; it reaches a host's loopback-only services only
    through :meth:`laptop_forward`.
    """

    def __init__(self, n: int, dir: str | os.PathLike, *, shared: Sequence[str | os.PathLike] = (),
                 names: Sequence[str] | None = None):
        """``dir`` holds the hosts file, keys and logs; ``shared``: dirs hosts must see too.

        Create it from the main thread: hosts are bound to the creating thread's
        life (PR_SET_PDEATHSIG), so a crashed test run leaves no host running.
        """
        global _counter
        before_start(f"{n} namespace hosts (a Testbed)")
        reason = require_root()
        if reason:
            raise TestbedError(reason)
        cleanup_stale()
        _counter += 1
        self.prefix = f"{PREFIX}{os.getpid()}-{_counter}"
        self.dir = Path(dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        # Paths under /tmp are hidden by each host's private /tmp: bind them back.
        # The venv, the checkout and the cwd too, in case CI cloned under /tmp.
        paths = {self.dir, *map(Path, shared), Path(sys.prefix), Path(sys.base_prefix),
                 Path(__file__).parent.parent, Path.cwd()}
        resolved = {str(p.resolve()) for p in paths}
        self.shared = sorted(p for p in resolved if p.startswith("/tmp/"))
        self.hosts_file = self.dir / "hosts"
        self.aliases: dict[str, int] = {}
        self.bridge_ns = f"{self.prefix}-br"
        names = list(names or [f"node{i}" for i in range(n)])
        self.hosts = [Host(i, names[i], f"{SUBNET}.{10 + i}", f"{self.prefix}-h{i}")
                      for i in range(n)]
        self.laptop = Host(-1, "laptop", LAPTOP_IP, f"{self.prefix}-lap")
        self._procs: list[Proc] = []
        self._seq = 0
        self._sshd: dict[int, Proc] = {}
        self._own: set[tuple[str, str]] = set()  # (host, path) given a directory of its own (own)
        self._forwards: dict[int, tuple[Proc, int, int]] = {}  # local port -> (ssh, host, port)
        self._closed = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            try:
                self.close()
            except TestbedError:
                pass  # the boot error is the one to see
            raise

    # ----------------------------------------------------------------- setup

    def _all_hosts(self) -> list[Host]:
        return [*self.hosts, self.laptop]

    def _create(self) -> None:
        self._write_hosts_file()
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for k, h in enumerate(self._all_hosts()):
            _ip("netns", "add", h.netns)
            port = f"v{k}"
            _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", h.netns)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        for h in self._all_hosts():
            self._boot(h)

    def _boot(self, h: Host) -> None:
        """Start the host's init (PID 1 of its PID namespace) and wait until its mounts are set."""
        argv = [NSENTER, f"--net=/run/netns/{h.netns}",
                UNSHARE, "--pid", "--fork", "--kill-child", "--mount-proc", "--uts", "--ipc",
                "--mount", "--propagation", "private",
                *self._py("hostinit", _INIT), h.name, str(self.hosts_file), *self.shared]
        err = self.dir / f"{h.name}-init.err"
        with open(err, "wb") as errf:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=errf, preexec_fn=_die_with_parent, env={"PATH": os.defpath})
        h._init_proc = p
        line = b""
        deadline = time.monotonic() + 20
        while not line.endswith(b"\n") and time.monotonic() < deadline and p.poll() is None:
            r, _, _ = select.select([p.stdout], [], [], 0.5)
            if r:
                chunk = os.read(p.stdout.fileno(), 64)
                if not chunk:
                    break
                line += chunk
        p.stdout.close()
        if line.strip() != b"ready":
            raise TestbedError(f"host {h.name} did not boot: {err.read_text()[-2000:]}")
        kids = _children(p.pid)  # unshare's only child is the init
        if len(kids) != 1:
            raise TestbedError(f"host {h.name}: expected one init process, found {kids}")
        h.init_pid = kids[0]

    def _py(self, name: str, source: str) -> list[str]:
        """argv running a helper script kept in the (shared) testbed dir: short argv in ps."""
        path = self.dir / "bin" / f"{name}.py"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            path.write_text(source.lstrip())
        return [PYTHON, "-I", "-S", str(path)]

    def _write_hosts_file(self) -> None:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.ip}\t{h.name}" for h in self._all_hosts()]
        lines += [f"{self.hosts[i].ip}\t{alias}" for alias, i in self.aliases.items()]
        # rewrite in place: the file is bind-mounted by inode into every host
        with open(self.hosts_file, "w") as f:
            f.write("\n".join(lines) + "\n")

    def add_alias(self, name: str, i: int) -> None:
        """Make ``name`` (e.g. ``abc123.runpod.internal``) resolve to host i on every host."""
        self.aliases[name] = i
        self._write_hosts_file()

    def set_aliases(self, aliases: Mapping[str, int]) -> None:
        """Make exactly these names (name -> host index) resolve, beside the hosts' own."""
        if dict(aliases) != self.aliases:
            self.aliases = dict(aliases)
            self._write_hosts_file()

    # ----------------------------------------------------------------- running

    def host(self, h: int | str | Host) -> Host:
        if isinstance(h, Host):
            return h
        if h == "laptop":
            return self.laptop
        if isinstance(h, str):
            return next(x for x in self._all_hosts() if x.name == h)
        return self.hosts[h]

    def env(self, **extra: str) -> dict[str, str]:
        """A minimal host environment (venv's bin first on PATH) plus ``extra``.

        Nothing of the test runner's own environment leaks in, as on a fresh node.
        """
        env = {"PATH": f"{BIN_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": "/root", "LANG": "C.UTF-8", "USER": "root"}
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, h: int | str | Host, cmd: str | Sequence[str], *,
            env: Mapping[str, str] | None = None, background: bool = True,
            timeout: float = 120, check: bool = False, cwd: str | os.PathLike | None = None,
            name: str | None = None, log: str | os.PathLike | None = None) -> Proc:
        """Run ``cmd`` on a host with exactly ``env`` (default :meth:`env`).

        A string runs under ``bash -c``; a list is exec'd as is.  Output (stdout
        and stderr) goes to ``log``, by default ``<dir>/<host>/<seq>-<name>.log``.
        ``cwd`` defaults to the caller's.  With
        ``background=False`` waits up to ``timeout`` (``check``: raise on a
        non-zero exit).
        """
        host = self.host(h)
        if not host.alive:
            raise TestbedError(f"host {host.name} is down")
        argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        self._seq += 1
        first = (cmd.split() or ["bash"])[0] if isinstance(cmd, str) else argv[0]
        label = re.sub(r"[^A-Za-z0-9_.-]+", "_", name or os.path.basename(first))[:40]
        logdir = self.dir / host.name
        logdir.mkdir(exist_ok=True)
        log = Path(log) if log is not None else logdir / f"{self._seq:03d}-{label}.log"
        wd = str(cwd) if cwd is not None else os.getcwd()
        full = [NSENTER, f"--target={host.init_pid}", "--pid", "--uts", "--ipc", "--mount",
                "--net", f"--wd={wd}", "--", *argv]
        with open(log, "wb") as out:
            popen = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, env=dict(env if env is not None
                                                                       else self.env()),
                                     start_new_session=True)
        proc = Proc(host, argv, popen, log)
        self._procs.append(proc)
        if not background:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.popen.wait(10)
                raise TestbedError(f"{proc!r} timed out after {timeout}s:\n{proc.output[-4000:]}")
            if check and proc.returncode != 0:
                raise TestbedError(f"{proc!r} failed:\n{proc.output[-4000:]}")
        return proc

    def sh(self, h: int | str | Host, cmd: str, **kw) -> str:
        """Run ``cmd`` to completion (must succeed) and return its output."""
        return self.run(h, cmd, background=False, check=True, **kw).output

    def mount(self, h: int | str | Host, plan: Sequence[tuple[str | None, str]], what: str,
              tmpfs_options: Mapping[str, str] | None = None) -> None:
        """Make ``plan``'s mounts in the host's mount namespace, in order (see :func:`mount_source`;
        ``tmpfs_options``: a fresh filesystem's ``-o``), once :func:`check_plan` passes; then check on
        the host, with the system's own shell, that it still sees what it must."""
        check_plan(plan, what)
        script = ["set -e"]
        for source, target in plan:
            t = shlex.quote(str(target))
            if source is None:
                opts = (tmpfs_options or {}).get(str(target))
                script.append(f"mkdir -p {t} && mount -t tmpfs {'-o ' + shlex.quote(opts) + ' ' if opts else ''}tmpfs {t}")
            else:
                script.append(f"{{ [ -e {t} ] || mkdir -p {t}; }} && mount --rbind {shlex.quote(str(source))} {t}")
        self.sh(h, "\n".join(script), cwd="/", env={"PATH": os.defpath}, name="mount")
        self.check_sees(h, what)

    def own(self, h: int | str | Host, path: str) -> None:
        """Give the host an empty directory of its own at ``path`` (a container's own /opt, say), once:
        a directory of the testbed's bound over the machine's, what must be seen under it bound back
        (a tmpfs there would hide a checkout cloned under it)."""
        host = self.host(h)
        if (host.name, path) in self._own:
            return
        fresh = self.dir / "own" / host.name / path.strip("/")
        shutil.rmtree(fresh, ignore_errors=True)  # empty at each boot, as a tmpfs would be
        fresh.mkdir(parents=True)
        self.mount(host, fresh_over(fresh, path), f"host {host.name}'s own {path} (tests/testbed.py own)")
        self._own.add((host.name, path))

    def check_sees(self, h: int | str | Host, what: str) -> None:
        """Fail loudly when the host no longer sees what every host must (:func:`must_see`)."""
        paths = must_see()
        p = self.run(h, ["/bin/sh", "-c", 'for p; do [ -e "$p" ] || echo "$p"; done', "sh", *paths],
                     env={"PATH": os.defpath}, cwd="/", background=False, timeout=30, name="check-sees")
        lost = p.output.split()
        if p.returncode != 0 or lost:
            raise TestbedError(f"host {self.host(h).name}: after {what} it no longer sees {', '.join(lost)} "
                               f"(the checkout, its virtualenv, this Python's prefixes or the tests' caches: "
                               f"tests/testbed.py must_see): a test that hides a directory must never hide "
                               f"the checkout. {p.output[-2000:]}")

    # ----------------------------------------------------------------- faults

    def processes(self, h: int | str | Host) -> list[int]:
        """Root-namespace PIDs of the host's processes, its init excluded."""
        host = self.host(h)
        return [p for p in _pidns_members(host.init_pid) if p != host.init_pid]

    def kill(self, h: int | str | Host, sig: int = signal.SIGKILL, timeout: float = 15) -> None:
        """Kill every process on the host except its init: a crash, the host stays up.

        Its /tmp survives; run new commands on it afterwards to "restart".  With
        ``sig=SIGTERM`` each process gets it once, for a graceful stop.
        """
        host = self.host(h)
        sent: set[int] = set()

        def gone():
            pids = self.processes(host)
            for pid in pids:  # SIGKILL again for late forks; other signals once each
                if sig == signal.SIGKILL or pid not in sent:
                    _kill(pid, sig)
                    sent.add(pid)
            return not pids
        poll(gone, timeout, f"processes of {host.name} to die", 0.05)
        self._reap()

    def reboot(self, h: int | str | Host, timeout: float = 15) -> None:
        """Kill the whole host (init too) and boot it again: fresh /tmp, same name and IP."""
        host = self.host(h)
        self._kill_host(host, timeout)
        self._own = {(name, path) for name, path in self._own if name != host.name}
        self._boot(host)

    def _kill_host(self, host: Host, timeout: float) -> None:
        # Kill inside-out.  A process whose parent is outside its PID namespace
        # (nsenter's child, the init under unshare) becomes a zombie of the root
        # namespace's PID 1 if that parent dies first, which may take seconds to
        # reap; and the namespace is not gone until it is.  So kill the PID
        # namespace (init first), let nsenter/unshare reap and exit by
        # themselves, and only then kill whatever else is left in the netns.
        unshare = host._init_proc

        def gone():
            members = _pidns_members(host.init_pid) if host.init_pid else []
            for pid in members:
                _kill(pid)
            if members:
                return False
            rest = [p for p in _netns_pids(host.netns) if unshare is None or p != unshare.pid]
            for pid in rest:
                _kill(pid)
            return not rest and (unshare is None or unshare.poll() is not None)
        poll(gone, timeout, f"processes of {host.name} to die", 0.02)
        self._reap()

    def _reap(self) -> None:
        for p in self._procs:
            p.popen.poll()

    # ----------------------------------------------------------------- probes

    def _probe_log(self, h: int | str | Host, what: str) -> Path:
        """One log per probe kind and host, overwritten: polling loops leave no pile of files."""
        return self.dir / self.host(h).name / f"probe-{what}.log"

    def wait_port(self, h: int | str | Host, port: int, addr: str = "127.0.0.1",
                  timeout: float = 30) -> None:
        """Wait until ``addr:port`` accepts TCP connections as seen from host h."""
        p = self.run(h, [*self._py("wait_port", _WAIT_PORT), addr, str(port), str(timeout)],
                     log=self._probe_log(h, "wait_port"), background=False, timeout=timeout + 15)
        if p.returncode != 0:
            raise TimeoutError(f"{self.host(h).name}: {p.output.strip()}")

    def http(self, h: int | str | Host, url: str, *, method: str | None = None,
             data: str | dict | None = None, headers: Mapping[str, str] | None = None,
             timeout: float = 10) -> HttpResponse:
        """HTTP request made from inside host h (so its loopback and names apply)."""
        hdrs = dict(headers or {})
        if isinstance(data, dict):
            data = json.dumps(data)
            hdrs.setdefault("Content-Type", "application/json")
        spec = {"url": url, "method": method or ("POST" if data is not None else "GET"),
                "data": data, "headers": hdrs, "timeout": timeout}
        p = self.run(h, [*self._py("http", _HTTP), json.dumps(spec)],
                     log=self._probe_log(h, "http"), background=False, timeout=timeout + 15)
        try:
            out = json.loads(p.output.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return HttpResponse(None, "", f"probe failed: {p.output[-2000:]}")
        return HttpResponse(out["status"], out["body"], out["error"])

    # ----------------------------------------------------------------- laptop

    def laptop_forward(self, remote_port: int, host: int = 0, local_port: int | None = None,
                       timeout: float = 30) -> int:
        """``ssh -N -L`` from the laptop to host's 127.0.0.1:remote_port; returns the laptop port.

        Starts sshd on the host (port 22, keys under the testbed dir) the first
        time.  Returns once the forward accepts connections on the laptop's
        127.0.0.1.
        """
        ensure_sshd()
        target = self.host(host)
        live = {lp: f for lp, f in self._forwards.items() if f[0].running()}
        for lp, (_, h, rp) in live.items():
            if (h, rp) == (target.index, remote_port) and local_port in (None, lp):
                return lp
        if local_port is None:
            local_port = remote_port if remote_port not in live else max(30000, *live) + 1
        key = self._ssh_keys()
        sshd = self._sshd.get(target.index)
        if sshd is None or not sshd.running():
            sshd = self._start_sshd(target, timeout)
        ssh = self.run(self.laptop, [
            "ssh", "-N", "-F", "/dev/null", "-i", str(key),
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", f"UserKnownHostsFile={self.dir / 'ssh' / 'known_hosts'}",
            "-o", "ExitOnForwardFailure=yes", "-o", "ServerAliveInterval=5",
            "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}",
            "-p", "22", f"root@{target.name}"], name=f"ssh-L{local_port}")
        self._forwards[local_port] = (ssh, target.index, remote_port)

        def accepting():
            if not ssh.running():
                raise TestbedError(f"ssh forward exited ({ssh.returncode}):\n{ssh.output}")
            probe = [*self._py("wait_port", _WAIT_PORT), "127.0.0.1", str(local_port), "0"]
            return self.run(self.laptop, probe, log=self._probe_log("laptop", "wait_port"),
                            background=False, timeout=15).returncode == 0
        try:
            poll(accepting, timeout, f"laptop forward :{local_port}", 0.1)
        except TimeoutError as exc:
            raise TestbedError(f"{exc}\nssh log:\n{ssh.output}\nsshd log:\n{sshd.output}") from None
        return local_port

    def _ssh_keys(self) -> Path:
        d = self.dir / "ssh"
        key = d / "id_ed25519"
        if not key.exists():
            d.mkdir(mode=0o700, exist_ok=True)
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "testbed", "-f", str(key))
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_ed25519"))
            shutil.copy(d / "id_ed25519.pub", d / "authorized_keys")
            (d / "sshd_config").write_text("\n".join([
                "Port 22", f"HostKey {d / 'host_ed25519'}",
                f"AuthorizedKeysFile {d / 'authorized_keys'}", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
                "StrictModes no", "AllowTcpForwarding yes", "PidFile none", "UseDNS no",
                "LogLevel VERBOSE", ""]))
        return key

    def _start_sshd(self, target: Host, timeout: float) -> Proc:
        os.makedirs("/run/sshd", exist_ok=True)
        sshd = self.run(target, [SSHD, "-D", "-e", "-f", str(self.dir / "ssh" / "sshd_config")],
                        name="sshd")
        self._sshd[target.index] = sshd
        try:
            self.wait_port(target, 22, target.ip, timeout)
        except TimeoutError as exc:
            raise TestbedError(f"sshd on {target.name} did not come up: {exc}\n{sshd.output}")
        return sshd

    # ----------------------------------------------------------------- teardown

    def close(self) -> None:
        """Kill every process of this testbed (by namespace PIDs) and delete its namespaces.

        Idempotent; also registered with atexit.
        """
        if self._closed:
            return
        self._closed = True
        errors = []
        for h in self._all_hosts():
            try:
                self._kill_host(h, 15)
            except Exception as exc:  # noqa: BLE001 - tear down the rest anyway
                errors.append(f"{h.name}: {exc}")
        for p in self._procs:
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                errors.append(f"{p!r} did not exit")
        for ns in [h.netns for h in self._all_hosts()] + [self.bridge_ns]:
            if ns in _netns_names():
                r = _ip("netns", "del", ns, check=False)
                if r.returncode != 0:
                    errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
        atexit.unregister(self.close)
        if errors:
            raise TestbedError("testbed teardown incomplete: " + "; ".join(errors))

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- pytest


def make_testbed_fixture(n: int = 2, scope: str = "function", **kwargs):
    """A pytest fixture giving a fresh ``Testbed(n)``, torn down after the test (pass or fail).

    In conftest.py: ``testbed2 = make_testbed_fixture(2)``.  Its files and logs
    are in ``<tmp_path>/testbed`` (``function`` scope).  The whole pytest
    basetemp is shared with the hosts, so every test's tmp_path is visible on
    them.  Skips without root, except in CI (CI=true), where that is an error.
    A test using it (directly or through another fixture) is a `cluster` test.
    """
    import pytest

    def _fixture(request, tmp_path_factory):
        reason = require_root()
        if reason:
            pytest.skip(reason)
        if scope == "function":
            base = request.getfixturevalue("tmp_path") / "testbed"
        else:
            base = tmp_path_factory.mktemp(f"testbed{n}-")
        tb = Testbed(n, base, shared=[tmp_path_factory.getbasetemp()], **kwargs)
        request.addfinalizer(tb.close)
        return tb

    _fixture.starts_cluster = True  # every test using it gets the `cluster` mark (tests/conftest.py)
    return pytest.fixture(scope=scope)(_fixture)
