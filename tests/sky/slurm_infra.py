"""SkyPilot's own Slurm infra (`sky launch --infra slurm`) on the project's real Slurm testbed.

What runs is SkyPilot itself, as a user runs it: its CLI (the venv's `sky`), its API server
(`sky api start`, on the laptop's loopback), its optimizer, its Slurm provisioner (sbatch of its
"virtual instance" job, srun --overlap into it), its setup commands on the nodes and the run script
`SlurmCodeGen` generates.  The Slurm is ``tests/slurm_testbed.py``'s (Debian's slurm-wlm, one
slurmd per namespace host).  See README.md here for what is real and what is played.

The layout, as a user's site would have it:

- ``laptop`` (the testbed's laptop host): the user's machine.  Its ``/root`` is a directory of the
  test's own (``<base>/laptop-home``, bind-mounted in the laptop's mount namespace), holding
  ``~/.slurm/config``, ``~/.ssh/id_ed25519``, ``~/.sky``: the user's real home is never touched.
- ``node0``: login node (sshd on port 22, root, key auth) and compute node; ``node1``..: compute.
  Their ``/root`` is one shared directory (``<base>/home``), as an NFS home is on a real cluster:
  SkyPilot keeps each cluster's state in ``~/.sky_clusters/<name>`` and reads it from every node.
  sshd's ``SetEnv SLURM_CONF=...`` points the clients at the testbed's slurm.conf.
- What SkyPilot fetches from the internet at provisioning is served from a cache built once per
  SkyPilot version from PyPI (:func:`prepare`): the hosts' ``curl`` (bind-mounted over
  /usr/bin/curl inside the hosts only) answers ``https://astral.sh/uv/install.sh`` with a script
  that installs uv from PyPI's ``uv`` wheel, and refuses every other URL; that uv resolves
  packages from the cached wheels only (``no-index``), and, since the hosts have no CPython 3.10
  (SkyPilot asks ``uv venv --python 3.10``) and may not download one, its request for 3.10 is
  served with the hosts' 3.11.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

try:
    import testbed as tbmod
except ImportError:  # tests/ imported as a package
    from tests import testbed as tbmod

CACHE = Path(os.environ.get("RLHF_TASKS_CACHE", Path.home() / ".cache" / "rlhf-tasks")) / "sky"
SLURM_CLUSTER = "testbed"  # the name in ~/.slurm/config: SkyPilot's region for this Slurm
API_PORT = 46580  # SkyPilot's default API server port (on the laptop's loopback)
REPO = Path(__file__).resolve().parents[2]


def sky_version() -> str:
    from importlib.metadata import version
    return version("skypilot")


def cache_dir() -> Path:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return CACHE / f"slurm-sky{sky_version()}-py{py}"


def prepare() -> Path:
    """The cache SkyPilot's nodes install from, built once per (SkyPilot, Python) version.

    ``wheels/``: ``skypilot[slurm,remote]==<installed>`` and everything it needs, plus pip,
    setuptools and wheel (``uv venv --seed``) and ``uv``, downloaded from PyPI;
    ``uv``: the binary from PyPI's ``uv`` wheel; ``client/``: ``python-hostlist``, the one
    package SkyPilot's Slurm support needs on the client that this checkout's venv lacks
    (``skypilot[slurm]``), installed from ``wheels/`` with ``pip --target``.
    """
    target = cache_dir()
    if (target / ".complete").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".slurm-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").exists():
            return target
        building = target.with_name(target.name + ".tmp")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        started = time.monotonic()
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]

        def run(argv):
            out = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
            if out.returncode != 0:
                raise RuntimeError(f"{shlex.join(argv)} failed ({out.returncode}):\n"
                                   f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")

        run([*pip, "download", "-d", str(building / "wheels"),
             f"skypilot[slurm,remote]=={sky_version()}", "pip", "setuptools", "wheel", "uv"])
        wheels = building / "wheels"
        run([*pip, "install", "--no-index", "--find-links", str(wheels), "--target",
             str(building / "client"), "python-hostlist"])
        uv_wheel = glob.glob(str(wheels / "uv-*.whl"))
        if not uv_wheel:
            raise RuntimeError(f"no uv wheel in {wheels}")
        with zipfile.ZipFile(uv_wheel[0]) as z:
            member = next(n for n in z.namelist() if n.endswith(".data/scripts/uv"))
            (building / "uv").write_bytes(z.read(member))
        (building / "uv").chmod(0o755)
        (building / ".complete").write_text(f"built in {time.monotonic() - started:.0f} s\n")
        building.rename(target)
    return target


# ----------------------------------------------------------------------------- played parts

_CURL = """#!/bin/bash
# Played (tests/sky/slurm_infra.py): the testbed's hosts reach no network.  The one download
# SkyPilot's Slurm setup makes with curl, uv's install script, is served from the cache.
for a in "$@"; do
  if [ "$a" = "https://astral.sh/uv/install.sh" ]; then cat {play}/uv-install.sh; exit 0; fi
done
echo "curl (testbed host): no network here, refused: $*" >&2
exit 7
"""

_UV_INSTALL = """#!/bin/sh
# Played: astral.sh's uv installer; installs uv from PyPI's uv wheel (tests/sky/slurm_infra.py).
set -e
dir="${{UV_INSTALL_DIR:-$HOME/.local/bin}}"
mkdir -p "$dir"
cp {play}/uv "$dir/uv"
chmod 755 "$dir/uv"
echo "installed uv ($({cache}/uv -V), from PyPI's uv wheel) to $dir"
"""

_UV = """#!/bin/sh
# uv from PyPI's uv wheel, with two played site settings (tests/sky/slurm_infra.py):
# packages come from the cached wheels only (no index: the hosts reach no registry), and a
# request for Python 3.10 (SkyPilot's runtime venv) is served with the hosts' 3.11, since
# the hosts have no CPython 3.10 and uv may not download one.
prev=
for a do
  shift
  if [ "$prev" = "--python" ] && [ "$a" = "3.10" ]; then a=3.11; fi
  set -- "$@" "$a"
  prev=$a
done
export UV_CONFIG_FILE={play}/uv.toml
exec {cache}/uv "$@"
"""


def host_mounts(home: Path, cache: Path, curl: Path | None = None,
                opt: Path | None = None) -> list[tuple[str | None, str]]:
    """A host's mounts (tests/testbed.py mount_source): ``home`` over /root, keeping what every host
    must see (the checkout cloned there, this Python's prefixes, the caches); on a node the played
    ``curl`` and its own, empty ``opt`` (file_mounts such as /opt/rlhf-tasks land there)."""
    plan = tbmod.fresh_over(home, "/root", keep=sorted({*tbmod.must_see(), str(cache.resolve())}))
    if curl is not None:
        plan.append((str(curl), "/usr/bin/curl"))
    if opt is not None:
        plan += tbmod.fresh_over(opt, "/opt")
    return plan


class SkySlurm:
    """SkyPilot's client and API server on the laptop, the testbed's Slurm as its infra.

    ``slurm``: a booted ``SlurmCluster``; host 0 is the login node.  ``base``: a directory
    under the pytest basetemp (every host sees it).
    """

    def __init__(self, slurm, base: Path, cache: Path | None = None, site_python: bool = False):
        self.slurm = slurm
        self.tb = slurm.testbed
        self.base = Path(base).resolve()
        self.cache = cache or prepare()
        self.login = self.tb.host(0)
        self.home = self.base / "home"            # the cluster's shared home: /root on the nodes
        self.laptop_home = self.base / "laptop-home"  # /root on the laptop
        self.play = self.base / "play"
        self.sshd_dir = self.base / "sshd"
        self.sshd: tbmod.Proc | None = None
        self.site_python = site_python
        self.api_started = False
        for d in (self.home, self.laptop_home, self.play, self.sshd_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._write_play()
        self._mount_homes()
        self._ssh()
        self._write_client_config()

    # ------------------------------------------------------------------ setup

    def _write_play(self) -> None:
        play, cache = self.play, self.cache
        (play / "curl").write_text(_CURL.format(play=play))
        (play / "uv-install.sh").write_text(_UV_INSTALL.format(play=play, cache=cache))
        (play / "uv").write_text(_UV.format(play=play, cache=cache))
        (play / "uv.toml").write_text(
            f'no-index = true\nfind-links = ["{cache}/wheels"]\npython-downloads = "never"\n')
        for f in ("curl", "uv-install.sh", "uv"):
            (play / f).chmod(0o755)

    def _mount_homes(self) -> None:
        """In each host's own mount namespace: the test's home over ``/root`` (one shared by the
        Slurm nodes, the laptop's own), with what must stay visible under /root bound back into
        it (tests/testbed.py fresh_over: the checkout cloned there, this Python's prefixes, e.g.
        pyenv's, and the caches), and the played curl on the nodes.  Checked by a marker: nothing of
        SkyPilot's runs until /root is the test's."""
        for h in [*self.tb.hosts, self.tb.laptop]:
            home = self.laptop_home if h is self.tb.laptop else self.home
            marker = home / ".rlhf-tasks-test-home"
            marker.write_text(str(home))
            self.tb.mount(h, self.host_mounts(h), f"SkyPilot-on-Slurm host {h.name}'s mounts "
                          f"(tests/sky/slurm_infra.py host_mounts)")
            self.tb.sh(h, f"test \"$(cat /root/.rlhf-tasks-test-home)\" = {shlex.quote(str(home))}",
                       env=self.tb.env(), cwd="/", name="mount-home")

    def host_mounts(self, h) -> list[tuple[str | None, str]]:
        if h is self.tb.laptop:
            return host_mounts(self.laptop_home, self.cache)
        opt = self.base / f"opt-{h.name}"
        opt.mkdir(exist_ok=True)
        return host_mounts(self.home, self.cache, self.play / "curl", opt)

    def _ssh(self) -> None:
        """The user's key (laptop), root's authorized_keys (shared home), sshd on the login node."""
        tbmod.ensure_sshd()
        key = self.laptop_home / ".ssh" / "id_ed25519"
        key.parent.mkdir(mode=0o700, exist_ok=True)
        if not key.exists():
            tbmod._sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "user@laptop", "-f", str(key))
        auth = self.home / ".ssh" / "authorized_keys"
        auth.parent.mkdir(mode=0o700, exist_ok=True)
        auth.write_text((key.parent / "id_ed25519.pub").read_text())
        auth.chmod(0o600)
        hostkey = self.sshd_dir / "host_ed25519"
        if not hostkey.exists():
            tbmod._sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey))
        conf = self.sshd_dir / "sshd_config"
        conf.write_text("\n".join([
            "Port 22", f"HostKey {hostkey}", "AuthorizedKeysFile /root/.ssh/authorized_keys",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "AllowTcpForwarding yes",
            "PidFile none", "UseDNS no", "LogLevel VERBOSE", "MaxSessions 100", "MaxStartups 100",
            # the site's Slurm clients find their config (Debian's default is /etc/slurm)
            f"SetEnv SLURM_CONF={self.slurm.conf}{self._site_python_env()}", ""]))
        os.makedirs("/run/sshd", exist_ok=True)
        self.sshd = self.tb.run(self.login, [tbmod.SSHD, "-D", "-e", "-f", str(conf)], name="sshd-login")
        self.tb.wait_port(self.login, 22, self.login.ip, 30)

    def _site_python_env(self) -> str:
        """With ``site_python``: the user's login profile on the cluster activates a Python
        environment as a site's conda env would be (``CONDA_PREFIX``, its bin first on ``PATH``):
        this checkout's virtualenv (Ray, torch).  SkyPilot's task script then leaves its own
        ~/sky-user-env inactive (ACTIVATE_SKY_USER_ENV only activates it when no conda env is).
        In ~/.profile (SkyPilot's SSH commands are login shells: Debian's /etc/profile resets a
        PATH given by sshd's SetEnv); the job's steps inherit it through sbatch and srun."""
        if self.site_python:
            venv = Path(sys.executable).parent.parent
            (self.home / ".profile").write_text(
                "# the site's Python environment, active at login (tests/sky/slurm_infra.py)\n"
                f"export CONDA_PREFIX={venv}\nexport PATH={venv}/bin:$PATH\n")
        return ""

    def _write_client_config(self) -> None:
        slurm_dir = self.laptop_home / ".slurm"
        slurm_dir.mkdir(exist_ok=True)
        (slurm_dir / "config").write_text("\n".join([
            f"Host {SLURM_CLUSTER}", f"    HostName {self.login.name}", "    User root",
            "    IdentityFile ~/.ssh/id_ed25519", "    Port 22", ""]))

    # ------------------------------------------------------------------ client

    def env(self, **extra: str) -> dict[str, str]:
        """The laptop user's environment: their own HOME, usage collection off, the client's
        extra package (python-hostlist) and this checkout importable."""
        pythonpath = [str(self.cache / "client"), str(REPO)]
        return self.tb.env(HOME="/root", USER="root", SKYPILOT_DISABLE_USAGE_COLLECTION="1",
                           SKYPILOT_DEBUG="0", PYTHONPATH=":".join(pythonpath), TERM="dumb",
                           # SkyPilot builds its own wheel (`pip wheel`) to ship to the nodes; its
                           # build backend comes from the cache: the laptop reaches no index either
                           PIP_NO_INDEX="1", PIP_FIND_LINKS=str(self.cache / "wheels"),
                           **extra)

    def sky(self, *args: str, timeout: float = 120, check: bool = False, cwd=None,
            env: dict[str, str] | None = None) -> "tbmod.Proc":
        """Run SkyPilot's own CLI (``sky ...``) on the laptop; waits up to ``timeout``."""
        sky_bin = str(Path(sys.executable).parent / "sky")
        p = self.tb.run(self.tb.laptop, [sky_bin, *args], env=env or self.env(),
                        background=True, cwd=cwd or self.laptop_home, name="sky-" + (args[0] if args else ""))
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise TimeoutError(f"`sky {shlex.join(args)}` still running after {timeout}s:\n"
                               f"{p.output[-4000:]}") from None
        if check and p.returncode != 0:
            raise RuntimeError(f"`sky {shlex.join(args)}` exited {p.returncode}:\n{p.output[-6000:]}")
        return p

    #: What SkyPilot's managed-jobs controller asks before each look at its job (jobs/controller.py:
    #: backend_utils.async_check_network_connection, HEAD https://8.8.8.8 then https://1.1.1.1): with
    #: neither answering it logs "Network is not available" and never looks at the job again.
    PROBE_IPS = ("8.8.8.8", "1.1.1.1")

    def play_connectivity_probe(self) -> dict[str, str]:
        """Answer SkyPilot's connectivity probe on the laptop: PROBE_IPS as the laptop's own addresses (on its
        loopback, in its network namespace only) and an HTTPS server on their port 443 with a certificate of a
        CA made here; returns the environment (SSL_CERT_FILE, REQUESTS_CA_BUNDLE: that CA only) the API
        server must start with. Nothing leaves the machine."""
        tls = self.play / "probe-tls"
        tls.mkdir(exist_ok=True)
        sans = ",".join(f"IP:{ip}" for ip in self.PROBE_IPS)
        ssl_cmds = [
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=rlhf-tasks test CA",
             "-keyout", "ca.key", "-out", "ca.pem"],
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=probe", "-keyout", "probe.key",
             "-out", "probe.csr"],
            ["/bin/sh", "-c", f"printf 'subjectAltName={sans}\\n' > san.ext && openssl x509 -req -in probe.csr "
             "-CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext -out probe.pem"]]
        for argv in ssl_cmds:
            subprocess.run(argv, cwd=tls, check=True, capture_output=True, timeout=60)
        addrs = " && ".join(f"ip addr add {ip}/32 dev lo" for ip in self.PROBE_IPS)
        self.tb.run(self.tb.laptop, ["/bin/sh", "-c", addrs], env=self.tb.env(), check=True, background=False,
                    timeout=30, name="probe-addrs")
        server = (
            "import http.server, ssl\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_HEAD(self):\n        self.send_response(200); self.end_headers()\n"
            "    do_GET = do_HEAD\n"
            "srv = http.server.ThreadingHTTPServer(('0.0.0.0', 443), H)\n"
            "ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)\n"
            f"ctx.load_cert_chain({str(tls / 'probe.pem')!r}, {str(tls / 'probe.key')!r})\n"
            "srv.socket = ctx.wrap_socket(srv.socket, server_side=True)\n"
            "srv.serve_forever()\n")
        self.probe = self.tb.run(self.tb.laptop, [sys.executable, "-c", server], env=self.tb.env(), background=True,
                                 name="probe-https")
        ca = str(tls / "ca.pem")
        return {"SSL_CERT_FILE": ca, "REQUESTS_CA_BUNDLE": ca}

    def api_start(self, timeout: float = 180, env: dict[str, str] | None = None) -> "tbmod.Proc":
        p = self.sky("api", "start", timeout=timeout, check=True, env=env)
        self.api_started = True
        return p

    def close(self) -> None:
        """Tear down what SkyPilot left (its clusters' Slurm jobs go with the Slurm cluster's
        close; its API server and sshd with the testbed's hosts)."""
        if self.api_started:
            try:
                self.sky("down", "-a", "-y", timeout=120)
            except Exception:  # noqa: BLE001 - the Slurm cluster's close cancels what is left
                pass
            try:
                self.sky("api", "stop", timeout=60)
            except Exception:  # noqa: BLE001
                pass
        if getattr(self, "probe", None) is not None and self.probe.running():
            self.probe.kill()
        if self.sshd is not None and self.sshd.running():
            self.sshd.send_signal()
