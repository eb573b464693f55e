"""A real Kubernetes control plane on this machine's loopback, for the Kubernetes tests:
etcd, kube-apiserver, kube-controller-manager and kube-scheduler, built from Kubernetes' own
module at the versions in versions.env (build.sh), with TLS, a client certificate in
`system:masters` for kubectl, and KubeRay's CRDs installed from the operator's own module.

Nothing here plays Kubernetes: the API server validates and stores, the controllers own
namespaces, garbage collection, endpoints and service accounts, the scheduler binds pods.
What runs the pods is the node runner (noderunner.py); the operator runs beside it.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_tasks.agent.protocol.ports import free_port  # noqa: F401 (noderunner takes it from here)
from rlhf_tasks.providers.base import end_process  # SIGTERM, SIGKILL after a grace, reaped

HERE = Path(__file__).resolve().parent
#: The service network the API server allocates ClusterIPs from: only ever written into
#: objects; nothing routes to it (Services resolve to pod IPs through the hosts file).
SERVICE_RANGE = "10.96.0.0/16"
CLUSTER_DOMAIN = "cluster.local"


class ControlPlaneError(RuntimeError):
    pass


def build() -> Path:
    """The cached build (bin/, crd/), built first if the versions or sources changed."""
    started = time.monotonic()
    proc = subprocess.run(["bash", str(HERE / "build.sh")], stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    if proc.returncode != 0:
        raise ControlPlaneError(f"tests/kube/build.sh failed (exit {proc.returncode})")
    out = Path(proc.stdout.strip().splitlines()[-1])
    if time.monotonic() - started > 5:
        print(f"kube: built in {time.monotonic() - started:.0f}s into {out}", file=sys.stderr)
    return out


def _build_dir() -> Path | None:
    """Where build.sh puts these versions' programs (its key), or None without Go."""
    import hashlib
    import shutil

    if shutil.which("go") is None:
        return None
    version = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, timeout=60).stdout
    hashed = b"".join((HERE / name).read_bytes() for name in ("build.sh", "versions.env", "gomod/go.mod",
                                                               "gomod/go.sum")) + version
    cache = Path(os.environ.get("RLHF_TASKS_KUBE_CACHE") or Path.home() / ".cache" / "rlhf-tasks" / "kube")
    return cache / hashlib.sha256(hashed).hexdigest()[:16]


def built(wait_for_a_build_under_way: bool = False) -> Path | None:
    """The cached build (as build() would print it) when it is there, without starting a build:
    None when Go is missing or these versions were never built (`make kube`). With
    `wait_for_a_build_under_way`, a build another process holds the lock for (`make test` starts
    one in the background) is waited for."""
    out = _build_dir()
    if out is None:
        return None
    if (out / ".done").exists():
        return out
    if wait_for_a_build_under_way and _building(out):
        return build()
    return None


def _building(out: Path) -> bool:
    """Whether a build.sh holds this build's lock now."""
    import fcntl

    try:
        with open(f"{out}.lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False
    except BlockingIOError:
        return True
    return False


def die_with_parent() -> None:
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# ------------------------------------------------------------------ certificates


@dataclass
class Pki:
    """A CA, the API server's serving certificate, an admin client certificate and the
    service-account signing key, as files under `dir`."""
    dir: Path

    def write(self) -> "Pki":
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        self.dir.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)

        def key_pem(key) -> bytes:
            return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())

        def cert(subject, key, issuer_cert, issuer_key, *, ca=False, usage=None, sans=()):
            b = (x509.CertificateBuilder().subject_name(subject)
                 .issuer_name(issuer_cert.subject if issuer_cert else subject)
                 .public_key(key.public_key()).serial_number(x509.random_serial_number())
                 .not_valid_before(now - datetime.timedelta(hours=1))
                 .not_valid_after(now + datetime.timedelta(days=2))
                 .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
            if usage:
                b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            if sans:
                b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
            return b.sign(issuer_key or key, hashes.SHA256())

        def name(cn, org=None):
            attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
            if org:
                attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
            return x509.Name(attrs)

        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = cert(name("rlhf-tasks-test-ca"), ca_key, None, None, ca=True)
        server_key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                          f"kubernetes.default.svc.{CLUSTER_DOMAIN}")]
        sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "10.96.0.1")]
        server = cert(name("kube-apiserver"), server_key, ca, ca_key, usage=[ExtendedKeyUsageOID.SERVER_AUTH],
                      sans=sans)
        admin_key = ec.generate_private_key(ec.SECP256R1())
        admin = cert(name("rlhf-tasks-test-admin", "system:masters"), admin_key, ca, ca_key,
                     usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = serialization.Encoding.PEM
        files = {"ca.crt": ca.public_bytes(pem), "ca.key": key_pem(ca_key),
                 "server.crt": server.public_bytes(pem), "server.key": key_pem(server_key),
                 "admin.crt": admin.public_bytes(pem), "admin.key": key_pem(admin_key),
                 "sa.key": key_pem(sa_key),
                 "sa.pub": sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)}
        for fname, data in files.items():
            (self.dir / fname).write_bytes(data)
            os.chmod(self.dir / fname, 0o600)
        return self

    def __getitem__(self, fname: str) -> str:
        return str(self.dir / fname)


# ------------------------------------------------------------------ the control plane


@dataclass
class ControlPlane:
    """Start with :meth:`start`, stop with :meth:`stop`; `kubeconfig` is what kubectl, the
    product under test and the operator use."""
    dir: Path
    build_dir: Path = field(default_factory=build)
    procs: dict = field(default_factory=dict)

    def __post_init__(self):
        self.dir = Path(self.dir)
        self.bin = self.build_dir / "bin"
        self.kubeconfig = self.dir / "kubeconfig"
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.started_s: float | None = None

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=die_with_parent, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def start(self, timeout: float = 90) -> "ControlPlane":
        started = time.monotonic()
        pki = self.pki = Pki(self.dir / "pki").write()
        client, peer = free_port(), free_port()
        self._spawn("etcd", [str(self.bin / "etcd"), "--name", "default", "--data-dir", str(self.dir / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{client}",
                             "--advertise-client-urls", f"http://127.0.0.1:{client}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                             "--unsafe-no-fsync", "--log-level", "warn"])
        self._spawn("kube-apiserver", [
            str(self.bin / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{client}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--tls-cert-file={pki['server.crt']}", f"--tls-private-key-file={pki['server.key']}",
            f"--client-ca-file={pki['ca.crt']}",
            f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
            f"--service-account-key-file={pki['sa.pub']}", f"--service-account-signing-key-file={pki['sa.key']}",
            f"--service-cluster-ip-range={SERVICE_RANGE}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", "--kubelet-preferred-address-types=InternalIP",
            # the endpoint reconciler refuses a loopback address for the `kubernetes` Service: nothing here
            # reaches the API server through that Service (the operator's relay does not)
            "--endpoint-reconciler-type=none", "--profiling=false", "--v=1"])
        self.kubeconfig.write_text(_kubeconfig(self.server, pki))
        self._wait_ready(started + timeout)
        common = [f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
                  "--secure-port=0", "--profiling=false", "--v=1"]
        self._spawn("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), *common,
            f"--service-account-private-key-file={pki['sa.key']}", f"--root-ca-file={pki['ca.crt']}",
            f"--cluster-signing-cert-file={pki['ca.crt']}", f"--cluster-signing-key-file={pki['ca.key']}",
            f"--service-cluster-ip-range={SERVICE_RANGE}", "--use-service-account-credentials=false"])
        self._spawn("kube-scheduler", [str(self.bin / "kube-scheduler"), *common])
        self.kubectl("apply", "--server-side", "-f", str(self.build_dir / "crd"))
        established = '{range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Established")].status} {end}'

        def crds_established() -> bool:  # (kubectl wait fails outright on a CRD with no conditions yet)
            out = self.kubectl("get", "crd", "-o", f"jsonpath={established}", check=False).stdout.split()
            return {f"ray.io_{kind}" for kind in ("rayjobs", "rayclusters", "rayservices")} <= {
                "ray.io_" + item.split(".")[0] for item in out if item.endswith("=True")}
        self._wait(crds_established, started + timeout, "KubeRay's CRDs to be established")
        self._wait(lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
                   started + timeout, "the controller manager to make the default ServiceAccount")
        self.started_s = time.monotonic() - started
        return self

    def _wait(self, fn, deadline: float, what: str) -> None:
        while not fn():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ControlPlaneError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                                            f"{self.log(name)}")
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def _wait_ready(self, deadline: float) -> None:
        ctx = ssl.create_default_context(cafile=self.pki["ca.crt"])
        ctx.load_cert_chain(self.pki["admin.crt"], self.pki["admin.key"])

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", context=ctx, timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        self._wait(ready, deadline, "kube-apiserver's /readyz")

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.bin / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            end_process(proc)
        self.procs.clear()


def _kubeconfig(server: str, pki: Pki) -> str:
    import yaml
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rlhf-tasks-test",
        "clusters": [{"name": "rlhf-tasks-test", "cluster": {"server": server, "certificate-authority": pki["ca.crt"]}}],
        "users": [{"name": "admin", "user": {"client-certificate": pki["admin.crt"], "client-key": pki["admin.key"]}}],
        "contexts": [{"name": "rlhf-tasks-test", "context": {"cluster": "rlhf-tasks-test", "user": "admin"}}],
    })
